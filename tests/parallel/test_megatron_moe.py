"""Qwen3-MoE on the megatron-core backend (megatron-core's MoE layer: TraceRouter, alltoall dispatcher, SequentialMLP
experts; models/megatron_moe.py), on CPU over gloo, fp32, against the native model on the same weights.

One world of 2 ranks (each its own row): at ep = 1 the logits, every MoE layer's router logits and chosen experts,
the load-balancing loss and every parameter's gradient (log-probs + coefficient x aux loss) equal the native model's;
routing replay routes exactly as recorded with perturbed routers (and the forward equals the native replay), without
replay the routers differ from the record; the reshard to whole generation weights is exact; without
norm_topk_prob (softmax, then top-k, not renormalised) the logits equal too. At ep = 2 (each rank 2
of the 4 experts, tokens by all-to-all) the logits and gradients equal ep = 1's (an expert's: summed over the ranks
whose tokens reach it), the export equals the native weights and the reshard too.
"""

import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_world

pytest.importorskip("megatron.core")

TOL = 1e-5
COEF = 0.1  # the load-balancing loss's weight: large enough that a missing aux gradient shows


def _native(norm_topk_prob: bool = True):
    from models.config import preset_config
    from models.llama import LlamaForCausalLM, init_weights

    # 4 experts, top-2 renormalised; layer 0 dense, layers 1-2 sparse (the aux loss pools two layers)
    cfg = preset_config("tiny-qwen3-moe", hidden_size=32, num_hidden_layers=3, head_dim=16, intermediate_size=64,
                        num_experts=4, moe_intermediate_size=16, mlp_only_layers=[0], router_aux_loss_coef=COEF,
                        norm_topk_prob=norm_topk_prob)
    model = LlamaForCausalLM(cfg)
    init_weights(model, seed=0)
    with torch.no_grad():  # routers with decisive logits, so routing does not hinge on rounding
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(n)))
    return model


def _runner(native, *, ep):
    from parallel.backends import build_runner
    from parallel.dims import ParallelDims, build_mesh

    dims = ParallelDims(dp=2, ep=ep)
    return build_runner(copy.deepcopy(native), backend="megatron", mesh=build_mesh(dims, [0, 1], device_type="cpu"),
                        dims=dims)


def _loss(logits, ids, trace):
    """A log-prob loss over the row plus COEF x the trace's load-balancing loss."""
    lp = torch.log_softmax(logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None]).sum()
    return -lp + COEF * trace.aux_loss(4)


def _megatron_pass(runner, ids, pos, trace):
    from models.megatron_model import megatron_hidden

    runner.gpt.zero_grad(set_to_none=True)
    w, _ = runner.head("lm_head")
    logits = megatron_hidden(runner.gpt, ids, pos, routing=trace).transpose(0, 1) @ w.t()
    _loss(logits, ids, trace).backward()
    # an expert no token reached may have no gradient: zero, as the native stacked experts' rows are
    return logits.detach(), {n: p.grad if p.grad is not None else torch.zeros_like(p)
                             for n, p in runner.gpt.named_parameters()}


def _ep1_case(native, runner, ids, pos) -> dict:
    from models.megatron_map import megatron_to_hf
    from models.moe import RouterTrace
    from parallel.runner import MicroBatch

    cfg, out = native.config, {}
    tn, tm = RouterTrace(keep_logits=True, keep_choice=True), RouterTrace(keep_logits=True, keep_choice=True)
    native.zero_grad(set_to_none=True)
    ref = native(ids, pos, routing=tn)
    _loss(ref, ids, tn).backward()
    logits, grads = _megatron_pass(runner, ids, pos, tm)
    out["logits"] = (logits - ref.detach()).abs().max().item()
    with torch.no_grad():  # the runner's own path (MicroBatch, router_trace) gives the same logits
        w, _ = runner.head("lm_head")
        via_runner = runner.forward([MicroBatch(ids, pos)], reduce=lambda h, k: h @ w.t())[0]
    out["runner_logits"] = (via_runner - ref.detach()).abs().max().item()
    out["router_logits"] = max((tm.logits[i] - tn.logits[i]).abs().max().item() for i in cfg.moe_layers)
    out["same_experts"] = all(torch.equal(tm.chosen[i].sort(-1).values, tn.chosen[i].sort(-1).values)
                              for i in cfg.moe_layers)
    out["aux"] = abs(tm.aux_loss(4).item() - tn.aux_loss(4).item())
    hf_grads = megatron_to_hf(grads, cfg, tp=1, pp=1, pp_rank=0)
    params = dict(native.named_parameters())
    assert set(hf_grads) == set(params)
    out["grads"] = max((g - params[n].grad).abs().max().item() for n, g in hf_grads.items())
    out["router_grad_nonzero"] = all(hf_grads[f"model.layers.{i}.mlp.gate.weight"].abs().sum() > 0
                                     and hf_grads[f"model.layers.{i}.mlp.experts.down_proj"].abs().sum() > 0
                                     for i in cfg.moe_layers)
    out.update(_replay_case(native, runner, ids, pos, recorded={i: tn.chosen[i] for i in cfg.moe_layers}))
    return out


def _replay_case(native, runner, ids, pos, *, recorded) -> dict:
    """Routers perturbed on both sides: replay routes every token as recorded and equals the native replay."""
    from models.megatron_model import megatron_hidden
    from models.moe import RouterTrace

    native = copy.deepcopy(native)
    gen = torch.Generator().manual_seed(7)
    saved = [r.weight.detach().clone() for r in runner.gpt.moe_routers]
    with torch.no_grad():
        for i, router in zip(native.config.moe_layers, runner.gpt.moe_routers):
            delta = torch.randn(router.weight.shape, generator=gen)
            native.model.layers[str(i)].mlp.gate.weight += delta
            router.weight += delta
        out = {}
        for replay in (True, False):
            tn, tm = (RouterTrace(recorded=recorded, replay=replay, keep_choice=True) for _ in range(2))
            w, _ = runner.head("lm_head")
            got = megatron_hidden(runner.gpt, ids, pos, routing=tm).transpose(0, 1) @ w.t()
            ref = native(ids, pos, routing=tn)
            as_recorded = all(torch.equal(tm.chosen[i].long(), recorded[i].long()) for i in recorded)
            out[f"replay_{replay}"] = ((got - ref).abs().max().item(), as_recorded, int(tm.mismatched),
                                       int(tn.mismatched))
        for router, w0 in zip(runner.gpt.moe_routers, saved):  # the runner's routers as they were
            router.weight.copy_(w0)
    return out


def _ep2_case(native, runner, ids, pos, rank, *, ref_logits, ref_grads) -> dict:
    from models.moe import RouterTrace

    out = {}
    logits, grads = _megatron_pass(runner, ids, pos, RouterTrace())
    out["ep2_logits"] = (logits - ref_logits).abs().max().item()
    errs = []
    # an expert's gradient holds both ranks' tokens (they reach it by all-to-all): the sum of ep = 1's over the ranks
    # (megatron's DDP then divides by dp, as for every other gradient); the rest is the rank's own
    for n, g in ref_grads.items():
        if ".local_experts." in n:
            dist.all_reduce(g)
    for n, g in grads.items():  # local expert e of expert-parallel rank r is global expert 2 r + e
        if ".local_experts." in n:
            head, rest = n.split(".local_experts.")
            e, tail = rest.split(".", 1)
            n = f"{head}.local_experts.{2 * rank + int(e)}.{tail}"
        errs.append((g - ref_grads[n]).abs().max().item())
    out["ep2_grads"] = max(errs)
    full = {n: p.detach() for n, p in native.named_parameters()}
    export = runner.export_state_dict()
    out["ep2_export"] = (export is None) if rank else (set(export) == set(full)
                                                       and all(torch.equal(export[n], full[n]) for n in full))
    out["ep2_reshard"] = _reshard_is_exact(native, runner, rank, ep=2)
    return out


def _reshard_is_exact(native, runner, rank, *, ep) -> bool:
    """The hybrid engine's reshard of the runner's training shards (dp 2) to whole weights on each rank (the
    engine's layout) equals the native weights."""
    from parallel.reshard import GenLayout, TrainLayout, param_specs, plan_reshard
    from parallel.reshard_exec import build_reshard_groups, execute_reshard

    full = {n: p.detach() for n, p in native.named_parameters()}
    train, gen = TrainLayout(dp=2, ep=ep), GenLayout(tp=1, dp=2)
    groups = build_reshard_groups((train, gen), [0, 1])
    plan = plan_reshard(train, gen, param_specs(native.config, itemsize=4), only_rank=rank)
    with torch.no_grad():
        got = execute_reshard(plan, runner.training_shards(), groups=groups, bucket_bytes=1 << 16)
    return set(got) == set(full) and all(torch.equal(got[n], full[n]) for n in full)


def _body(rank, world):
    from megatron.core import parallel_state

    from models.megatron_model import megatron_hidden

    native = _native()
    ids = torch.randint(3, native.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))[rank:rank + 1]
    pos = torch.arange(13)[None]
    ep1 = _runner(native, ep=1)
    out = _ep1_case(native, ep1, ids, pos)
    out["ep1_reshard"] = _reshard_is_exact(native, ep1, rank, ep=1)
    # norm_topk_prob=False: megatron's softmax-then-top-k (moe_router_pre_softmax), not renormalised
    plain = _native(norm_topk_prob=False)
    with torch.no_grad():
        runner = _runner(plain, ep=1)
        w, _ = runner.head("lm_head")
        got = megatron_hidden(runner.gpt, ids, pos).transpose(0, 1) @ w.t()
        out["unnormalised_logits"] = (got - plain(ids, pos)).abs().max().item()
        out["unnormalised_pre_softmax"] = runner.gpt.config.moe_router_pre_softmax
    from models.moe import RouterTrace

    ref_logits, ref_grads = _megatron_pass(ep1, ids, pos, RouterTrace())
    ref_grads = {n: g.clone() for n, g in ref_grads.items()}
    # at ep > 1 megatron's dispatcher gathers the token counts and exchanges the rows into buffers it allocates on
    # torch.cuda.current_device() (tensor_parallel/mappings.py:141, 442): on this CPU-only host, the CPU. Everything
    # else (our groups, expert slices, gradients, export, reshard) runs as it does on GPUs.
    with mock.patch("torch.cuda.current_device", return_value="cpu"):
        ep2 = _runner(native, ep=2)
        out.update(_ep2_case(native, ep2, ids, pos, rank, ref_logits=ref_logits, ref_grads=ref_grads))
    out["globals_untouched"] = not parallel_state.model_parallel_is_initialized()
    return out


@pytest.mark.distributed
def test_megatron_moe_layer_matches_native_and_ep2_matches_ep1():
    for res in run_world(_body, world_size=2, timeout=300):
        assert res.pop("unnormalised_pre_softmax") is True
        for key in ("logits", "runner_logits", "router_logits", "aux", "grads", "ep2_logits", "ep2_grads",
                    "unnormalised_logits"):
            assert res[key] < TOL, (key, res[key])
        for key in ("same_experts", "router_grad_nonzero", "ep1_reshard", "ep2_export", "ep2_reshard",
                    "globals_untouched"):
            assert res[key] is True, key
        err, as_recorded, mismatched, native_mismatched = res["replay_True"]
        assert err < TOL and as_recorded and mismatched == native_mismatched > 0, res["replay_True"]
        err, as_recorded, mismatched, native_mismatched = res["replay_False"]
        assert err < TOL and not as_recorded and mismatched == native_mismatched > 0, res["replay_False"]
