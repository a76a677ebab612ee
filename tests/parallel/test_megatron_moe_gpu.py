"""Qwen3-MoE on the megatron-core backend on one GPU (what the CPU test cannot reach: CUDA's dispatcher path, DDP's
expert buffers, the second distributed optimizer megatron chains for expert parameters, the trainer loop).

    source .whl/prelude.sh && python -m pytest -q -s -m gpu tests/parallel/test_megatron_moe_gpu.py
    (or: bash bench/gpu_suite.sh megatron_moe; expected 2-4 minutes on one H200, the GRPO run most of it)

Each test prints one JSON line ("test": ...) with its measurements, or the error, so one run says everything.
- parity: fp32 on CUDA (TF32 off), megatron's MoE model vs the native model on the same weights: logits, router
  logits, experts and every gradient (log-probs + aux loss) within 1e-4 (the CPU test holds 1e-5; CUDA's GEMMs
  sum in another order); bf16 logits reported beside the native bf16 model's own gap to fp32.
- training: bf16 params with fp32 masters, DDP + distributed optimizer (at ep = 1 megatron treats the experts as
  dense parameters: one optimizer), 3 steps: finite losses and grad norms, router and experts updated, the
  checkpoint state round trip exact.
- GRPO: the tiny MoE preset with actor.backend=megatron and routing replay, 3 steps, finite metrics, the final
  checkpoint's HF export loads into the native model (finite weights and logits).
- 2 GPUs (skipped with fewer): fp32 training at ep = 2 equals ep = 1 (dp = 2 both) over 3 optimizer steps: losses,
  grad norms and the exported weights; megatron chains a second distributed optimizer for the experts there. Until it
  has passed, launch refuses the megatron backend at ep > 1 (launcher.planning.plan._validate_megatron_moe).
"""

from __future__ import annotations

import copy
import json
import math
import traceback

import pytest
import torch

from tests.dist_utils import run_world
from tests.parallel.test_megatron_gpu import _batch as dense_batch
from tests.parallel.test_megatron_gpu import _runner

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _cfg():
    from models.config import preset_config

    # 8 experts, top-2 renormalised; layer 0 dense, layers 1-3 sparse
    return preset_config("tiny-qwen3-moe", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=4096,
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, mlp_only_layers=[0],
                         router_aux_loss_coef=0.01)


def _native(cfg, dtype=torch.float32):
    from models.llama import LlamaForCausalLM, init_weights

    m = LlamaForCausalLM(cfg)
    init_weights(m, seed=0)
    with torch.no_grad():  # decisive routers, so that rounding differences do not flip experts
        for n, p in m.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(n)))
    return m.to("cuda", dtype)


def _batch(cfg):
    """3 packed rows [1, 96] (two documents each) and next-token targets (the dense GPU test's batches)."""
    return dense_batch(cfg, b=3, t=96)


def _guarded(rank, world, body):
    """Run a world body, returning its result or the error text (the lead's one run must show what failed)."""
    try:
        return body(rank, world)
    except Exception:  # reported, then asserted on by the test
        return {"error": traceback.format_exc()[-6000:]}


def _parity_body(rank, world):
    from models.document_attention import DocumentAttention
    from models.megatron_map import megatron_to_hf
    from models.megatron_model import megatron_hidden
    from models.moe import RouterTrace

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = _cfg()
    mbs, targets = _batch(cfg)
    mb = mbs[0]
    native = _native(cfg)
    runner, _ = _runner(copy.deepcopy(native))
    w, _ = runner.head("lm_head")
    tn, tm = RouterTrace(keep_logits=True, keep_choice=True), RouterTrace(keep_logits=True, keep_choice=True)
    attn = DocumentAttention(mb.position_ids)
    ref = native(mb.input_ids, mb.position_ids, attn=attn, routing=tn)
    got = megatron_hidden(runner.gpt, mb.input_ids, mb.position_ids, attn=attn, routing=tm).transpose(0, 1) @ w.t()

    def loss(logits, trace):
        lp = torch.log_softmax(logits[0].float(), -1).gather(1, targets[0][:, None]).mean()
        return -lp + cfg.router_aux_loss_coef * trace.aux_loss(cfg.num_experts)

    loss(ref, tn).backward()
    loss(got, tm).backward()
    # an expert no token reached may have no gradient: zero, as the native stacked experts' rows are
    grads = megatron_to_hf({n: p.grad if p.grad is not None else torch.zeros_like(p)
                            for n, p in runner.gpt.named_parameters()}, cfg, tp=1, pp=1, pp_rank=0)
    params = dict(native.named_parameters())
    out = dict(
        shapes={n: list(p.shape) for n, p in runner.gpt.named_parameters()
                if "layers.1." in n and ".local_experts." not in n or ".layers.1.mlp.experts.local_experts.0." in n},
        logits=(got - ref).abs().max().item(),
        router_logits=max((tm.logits[i] - tn.logits[i]).abs().max().item() for i in cfg.moe_layers),
        same_experts=all(torch.equal(tm.chosen[i].sort(-1).values, tn.chosen[i].sort(-1).values)
                         for i in cfg.moe_layers),
        aux=abs(tm.aux_loss(cfg.num_experts).item() - tn.aux_loss(cfg.num_experts).item()),
        grads=max((g - params[n].grad).abs().max().item() for n, g in grads.items()),
        grad_scale=max(p.grad.abs().max().item() for p in params.values()),
    )
    # bf16: megatron vs native, beside the native bf16 model's own distance to fp32
    with torch.no_grad():
        n16 = copy.deepcopy(native).to(torch.bfloat16)
        m16, _ = _runner(copy.deepcopy(n16))
        w16, _ = m16.head("lm_head")
        l16 = n16(mb.input_ids, mb.position_ids, attn=attn, routing=RouterTrace()).float()
        g16 = (megatron_hidden(m16.gpt, mb.input_ids, mb.position_ids, attn=attn, routing=RouterTrace())
               .transpose(0, 1) @ w16.t()).float()
    out.update(bf16_megatron_vs_native=(g16 - l16).abs().max().item(),
               bf16_native_vs_fp32=(l16 - ref.detach()).abs().max().item())
    return out


def test_megatron_moe_matches_native_on_cuda():
    res = run_world(_guarded, 1, (_parity_body,), backend="nccl", timeout=300)[0]
    print(json.dumps({"test": "megatron_moe_parity_cuda", **res}))
    assert "error" not in res, res["error"]
    assert res["logits"] < 1e-4 and res["router_logits"] < 1e-4 and res["aux"] < 1e-5, res
    assert res["same_experts"], res
    assert res["grads"] <= 1e-4 * max(res["grad_scale"], 1.0), res
    assert math.isfinite(res["bf16_megatron_vs_native"]) and res["bf16_megatron_vs_native"] < 1.0, res


def _train_body(rank, world):
    from parallel.megatron_runner import megatron_optimizers
    from parallel.vocab_parallel import vocab_parallel_token_logprobs

    cfg = _cfg()
    mbs, targets = _batch(cfg)
    native = _native(cfg)
    runner, opt = _runner(copy.deepcopy(native), dtype=torch.bfloat16, lr=1e-3)
    twin, twin_opt = _runner(copy.deepcopy(native), dtype=torch.bfloat16, lr=1e-3)

    def loss_fn(r):
        def fn(h, k):
            w, start = r.head("lm_head")
            lp, _ = vocab_parallel_token_logprobs(h.reshape(-1, h.shape[-1]), w, targets[k].reshape(-1),
                                                  tp_group=r.pgc.tp, vocab_start=start)
            loss = -lp.sum() / targets.numel()
            return loss, {"loss": float(loss)}
        return fn

    before = {n: p.detach().float().clone() for n, p in runner.gpt.named_parameters()}
    losses, norms, metrics = [], [], []
    for _ in range(3):
        m = runner.forward_backward(mbs, loss_fn=loss_fn(runner))
        metrics.append({k: float(v) for k, v in m[0].items()})
        losses.append(sum(x["loss"] for x in m))
        norms.append(runner.optimizer_step(opt, max_norm=1.0))
    moved = {n: (p.detach().float() - before[n]).abs().max().item() for n, p in runner.gpt.named_parameters()}
    saved = runner.checkpoint_state(opt)
    twin.load_checkpoint_state(twin_opt, saved)
    again = twin.checkpoint_state(twin_opt)
    same = set(saved["params"]) == set(again["params"]) and all(
        torch.equal(saved["params"][n], again["params"][n]) for n in saved["params"])
    same_opt = len(saved.get("dist_optim", [])) == len(again.get("dist_optim", [])) and all(
        set(a) == set(b) and all(torch.equal(a[n]["param"], b[n]["param"]) for n in a)
        for a, b in zip(saved.get("dist_optim", []), again.get("dist_optim", [])))
    return dict(losses=losses, grad_norms=norms, first_metrics=metrics[0],
                optimizers=len(megatron_optimizers(runner.optimizer)),
                expert_buffers=len(getattr(runner.ddp, "expert_parallel_buffers", [])),
                router_moved=min(v for n, v in moved.items() if n.endswith("mlp.router.weight")),
                # an expert no token reached in the 3 steps keeps its weights: the largest and the share that moved
                experts_moved=max(v for n, v in moved.items() if ".local_experts." in n),
                experts_moved_share=sum(v > 0 for n, v in moved.items() if ".local_experts." in n)
                / sum(".local_experts." in n for n in moved),
                checkpoint_params_equal=same, checkpoint_optimizers=len(saved.get("dist_optim", [])),
                checkpoint_masters_equal=same_opt)


def test_megatron_moe_trains_with_the_distributed_optimizer():
    res = run_world(_guarded, 1, (_train_body,), backend="nccl", timeout=300)[0]
    print(json.dumps({"test": "megatron_moe_train", **res}))
    assert "error" not in res, res["error"]
    assert all(math.isfinite(x) for x in res["losses"] + res["grad_norms"]), res
    assert all(n > 0 for n in res["grad_norms"]), res
    assert "aux_loss" in res["first_metrics"] and res["first_metrics"]["aux_loss"] > 0, res
    assert res["optimizers"] == 1 and res["expert_buffers"] == 0, res  # ep = 1: experts are dense to megatron
    assert res["router_moved"] > 0 and res["experts_moved"] > 0, res
    assert res["checkpoint_params_equal"] and res["checkpoint_masters_equal"] and res["checkpoint_optimizers"] == 1


def test_grpo_with_a_megatron_moe_actor_on_the_gpu(tmp_path):
    from models import load_pretrained
    from tests.ppo.test_trainer import _ok, launch, metrics

    res = launch(tmp_path, 1, "conf/grpo_tiny.yaml", "model.preset=tiny-qwen3-moe", "trainer.device=cuda",
                 "model.dtype=bfloat16", "actor.backend=megatron", "actor.router_replay=true",
                 "trainer.total_steps=3", "trainer.experiment_name=mmoe", timeout=400)
    print(json.dumps({"test": "grpo_megatron_moe", "returncode": res.returncode,
                      "stderr_tail": res.stderr[-3000:] if res.returncode else ""}))
    _ok(res)
    rows = metrics(tmp_path / "mmoe")
    print(json.dumps({"test": "grpo_megatron_moe_metrics", "rows": [
        {k: r.get(k) for k in ("step", "reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/aux_loss",
                               "actor/router_mismatch", "actor/kl", "perf/mfu/actor")} for r in rows]}))
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert r["actor/aux_loss"] > 0 and 0.0 <= r["actor/router_mismatch"] <= 1.0, r
    final = tmp_path / "mmoe" / "checkpoints" / "step_3" / "actor"
    model = load_pretrained(final)  # the HF export (stacked experts written one tensor per expert) loads natively
    assert model.config.is_moe and model.config.num_experts == 8
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 7, 9]]))
    assert torch.isfinite(logits).all()


def _ep_train_body(rank, world):
    from parallel.backends import build_runner
    from parallel.dims import ParallelDims, build_mesh
    from parallel.megatron_runner import megatron_optimizers
    from parallel.vocab_parallel import vocab_parallel_token_logprobs

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = _cfg()
    mbs, targets = _batch(cfg, b=4, seed=rank)  # each dp rank its own rows
    native = _native(cfg)
    out = {}
    for ep in (1, 2):
        dims = ParallelDims(dp=2, ep=ep)
        mesh = build_mesh(dims, [0, 1], device_type="cuda")
        runner = build_runner(copy.deepcopy(native), backend="megatron", mesh=mesh, dims=dims)
        opt = runner.build_optimizer(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)

        def fn(h, k, runner=runner):
            w, start = runner.head("lm_head")
            lp, _ = vocab_parallel_token_logprobs(h.reshape(-1, h.shape[-1]), w, targets[k].reshape(-1),
                                                  tp_group=runner.pgc.tp, vocab_start=start)
            loss = -lp.sum() / targets.numel()
            return loss, {"loss": float(loss)}

        losses, norms = [], []
        for _ in range(3):
            losses.append(sum(m["loss"] for m in runner.forward_backward(mbs, loss_fn=fn)))
            norms.append(runner.optimizer_step(opt, max_norm=1.0))
        out[ep] = dict(losses=losses, norms=norms, optimizers=len(megatron_optimizers(runner.optimizer)),
                       export=runner.export_state_dict())
    res = dict(losses_ep1=out[1]["losses"], losses_ep2=out[2]["losses"], norms_ep1=out[1]["norms"],
               norms_ep2=out[2]["norms"], optimizers_ep2=out[2]["optimizers"])
    if rank == 0:
        a, b = out[1]["export"], out[2]["export"]
        res["same_names"] = set(a) == set(b)
        res["weight_diff"] = max((a[n].float() - b[n].float()).abs().max().item() for n in a)
    return res


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_megatron_moe_expert_parallel_training_equals_ep1_on_two_gpus():
    res = run_world(_guarded, 2, (_ep_train_body,), backend="nccl", timeout=300)
    print(json.dumps({"test": "megatron_moe_ep2_train", "ranks": res}))
    for r in res:
        assert "error" not in r, r["error"]
        assert r["optimizers_ep2"] == 2, r  # dense and expert distributed optimizers
        for a, b in zip(r["losses_ep1"] + r["norms_ep1"], r["losses_ep2"] + r["norms_ep2"]):
            assert abs(a - b) <= 1e-4 * max(abs(a), 1.0), r
    assert res[0]["same_names"] and res[0]["weight_diff"] < 1e-4, res[0]
