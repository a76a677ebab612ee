"""megatron-core backend on CPU over gloo (real megatron-core modules, our process groups and attention).

Each world checks several things at once (spawning a world with megatron-core costs seconds on 2 cores):
logits equal the native model at tp 1 and 2 for Llama, Qwen2 (q/k/v bias) and a tied-embedding model;
megatron-core's schedule with our forward step gives the native loss and gradients (micro-batch scaling undone);
its WORLD-wide optimizer collective, scoped to the role's group, cannot hang a split placement;
packed and shared-prompt rows equal unpacked; log-probs, entropy and gradients equal the native path;
HF load -> training shards -> reshard -> generation shards equal the native ones exactly; a TP2 x PP2
build has the mapping's names and shapes and its pipelined logits equal the native model, Qwen3's q/k
layernorms included (tied heads at pp > 1 need CUDA in megatron-core: tests/parallel/test_megatron_gpu.py).
"""

import pytest
import torch

from tests.dist_utils import run_world

pytest.importorskip("megatron.core")

TOL = 1e-5
CONFIGS = {
    "llama": dict(),
    "qwen2_bias": dict(model_type="qwen2"),
    "tied": dict(model_type="qwen2", tie_word_embeddings=True),
}
# in the TP2 x PP2 build only (its tp 1 / 2 cases, and transformers' logits: tests/parallel/test_megatron_qwen3.py)
PP_ONLY = {"qwen3": dict(tie_word_embeddings=False)}


def _native(name):
    from models.config import preset_config
    from models.llama import LlamaForCausalLM, init_weights

    cfg = preset_config("tiny-qwen3", **PP_ONLY[name]) if name in PP_ONLY else preset_config("tiny", **CONFIGS[name])
    model = LlamaForCausalLM(cfg)
    init_weights(model, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero biases, so a q/k/v bias mix-up cannot hide
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
            elif cfg.qk_norm and n.endswith("norm.weight"):  # Qwen3's q/k norms away from 1, q != k
                p.normal_(1.0, 0.2, generator=gen)
    return model


def _megatron(native, tp, world, pp=1):
    """The factory's megatron runner of `native` (same weights) -> (runner, its GPTModel, its groups)."""
    from parallel.backends import build_runner
    from parallel.dims import ParallelDims, build_mesh

    dims = ParallelDims(tp=tp, pp=pp, dp=world // (tp * pp))
    mesh = build_mesh(dims, list(range(world)), device_type="cpu")
    runner = build_runner(native, backend="megatron", mesh=mesh, dims=dims)
    return runner, runner.gpt, runner.pgc


def _gather_vocab(local, pgc):
    import torch.distributed as dist

    parts = [torch.empty_like(local) for _ in range(pgc.tp.size())]
    dist.all_gather(parts, local.contiguous(), group=pgc.tp)
    return torch.cat(parts, dim=-1)


def _logprob_grad_case(native, gpt, pgc, ids, pos):
    """Chunked (vocab-parallel) log-probs + entropy and their gradients, megatron vs native."""
    from models.logprobs import compute_token_logprobs
    from models.megatron_map import megatron_to_hf
    from models.megatron_model import head_weight, megatron_hidden
    from parallel.sharding import tp_slices
    from parallel.vocab_parallel import vocab_parallel_token_logprobs

    cfg = native.config
    tp, r = pgc.tp.size(), pgc.tp.rank()
    targets = torch.randint(0, cfg.vocab_size, ids.shape, generator=torch.Generator().manual_seed(3))
    w_lp, w_ent = torch.rand(ids.numel()), torch.rand(ids.numel())
    h = megatron_hidden(gpt, ids, pos).transpose(0, 1).reshape(-1, cfg.hidden_size)
    lp, ent = vocab_parallel_token_logprobs(h, head_weight(gpt), targets.reshape(-1), tp_group=pgc.tp,
                                            vocab_start=r * cfg.vocab_size // tp, with_entropy=True, chunk_size=5)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    nh = native.hidden_states(ids, pos).reshape(-1, cfg.hidden_size)
    nlp, nent = compute_token_logprobs(nh, native.lm_head.weight, targets.reshape(-1), with_entropy=True,
                                       chunk_size=5)
    ((nlp * w_lp).sum() + (nent * w_ent).sum()).backward()
    grads = megatron_to_hf({n: p.grad for n, p in gpt.named_parameters()}, cfg, tp=tp, pp=1, pp_rank=0)
    ngrads = dict(native.named_parameters(remove_duplicate=False))
    gerr = max((g - ngrads[n].grad[tp_slices(n, tuple(ngrads[n].shape), rank=r, world=tp)]).abs().max().item()
               for n, g in grads.items())
    return (lp - nlp).abs().max().item(), (ent - nent).abs().max().item(), gerr


def _packing_case(native, gpt):
    """Two sequences packed in one row, and a prompt shared by two responses, equal their unpacked runs."""
    from models.document_attention import DocumentAttention
    from models.megatron_model import megatron_hidden

    g = torch.Generator().manual_seed(5)
    a, b = torch.randint(3, 500, (1, 5), generator=g), torch.randint(3, 500, (1, 4), generator=g)
    p, r1, r2 = (torch.randint(3, 500, (1, n), generator=g) for n in (3, 2, 2))

    def run(ids, pos, attn=None):
        return megatron_hidden(gpt, ids, pos, attn=attn).transpose(0, 1)[0]

    def solo(x):
        return run(x, torch.arange(x.shape[1])[None])

    packed_pos = torch.cat([torch.arange(5), torch.arange(4)])[None]
    packed = run(torch.cat([a, b], 1), packed_pos, DocumentAttention(packed_pos, backend="mask"))
    err = max((packed[:5] - solo(a)).abs().max().item(), (packed[5:] - solo(b)).abs().max().item())
    shared_pos = torch.tensor([[0, 1, 2, 3, 4, 3, 4]])
    shared = run(torch.cat([p, r1, r2], 1), shared_pos, DocumentAttention(shared_pos, backend="mask"))
    err = max(err, (shared[:5] - solo(torch.cat([p, r1], 1))).abs().max().item(),
              (shared[5:] - solo(torch.cat([p, r2], 1))[3:]).abs().max().item())
    native_packed = native.hidden_states(torch.cat([a, b], 1), packed_pos,
                                         attn=DocumentAttention(packed_pos, backend="mask"))[0]
    return max(err, (packed - native_packed).abs().max().item())


def _export_case(native, runner, rank, *, exact_names: bool = False) -> bool:
    """The TP all-gathered HF export equals the native parameters (only the exporter rank gets it).
    exact_names: the export holds exactly the native names, a tied head's alias included."""
    full = runner.export_state_dict()
    if rank:
        return full is None
    want = {n: p.detach() for n, p in native.named_parameters(remove_duplicate=not exact_names)}
    names_ok = set(full) == set(want) if exact_names else set(full) >= set(want)
    return names_ok and all(torch.equal(full[n], want[n]) for n in want)


def _reshard_case(native, runner, pgc, world):
    """Megatron training shards (TP=world) -> generation TP=1 equal the native full tensors exactly."""
    from parallel.reshard import GenLayout, TrainLayout, param_specs, plan_reshard
    from parallel.reshard_exec import build_reshard_groups, execute_reshard

    train, gen = TrainLayout(tp=pgc.tp.size(), pp=1, dp=pgc.dp.size()), GenLayout(tp=1, dp=world)
    import torch.distributed as dist

    rank = dist.get_rank()
    groups = build_reshard_groups((train, gen), list(range(world)))
    plan = plan_reshard(train, gen, param_specs(native.config, itemsize=4), only_rank=rank)
    with torch.no_grad():
        out = execute_reshard(plan, runner.training_shards(), groups=groups, bucket_bytes=1 << 16)
    full = {n: p.detach() for n, p in native.named_parameters(remove_duplicate=False)}
    assert set(out) == set(full)
    return all(torch.equal(out[n], full[n]) for n in full)


def _schedule_case(native, runner):
    """megatron-core's own no-pipelining schedule drives our forward step and loss on CPU: the summed loss
    and the gradients of two uneven packed micro-batches equal the native model's (the schedule divides
    each micro-batch loss by their count; the runner undoes it). The schedule's one CUDA allocation (a
    token counter, `torch.zeros(device="cuda")`) is redirected to the CPU for this process only."""
    import types

    import megatron.core.pipeline_parallel.schedules as schedules

    import parallel.megatron_runner as megatron_runner
    from models.document_attention import DocumentAttention
    from models.logprobs import compute_token_logprobs
    from models.megatron_map import megatron_to_hf
    from parallel.runner import MicroBatch
    from parallel.sharding import tp_slices
    from parallel.vocab_parallel import vocab_parallel_token_logprobs

    class _CpuCounters(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

        def zeros(self, *args, device=None, **kwargs):
            return torch.zeros(*args, **kwargs)

    schedules.torch = _CpuCounters("torch")
    megatron_runner.require_cuda = lambda what: None
    runner.attn_factory = DocumentAttention
    cfg, tp, r = native.config, runner.pgc.tp.size(), runner.pgc.tp.rank()
    g = torch.Generator().manual_seed(11)
    mbs = [MicroBatch(torch.randint(3, 500, (1, n), generator=g),
                      torch.cat([torch.arange(n - 4), torch.arange(4)])[None]) for n in (9, 13)]
    targets = [torch.roll(mb.input_ids, -1, 1)[0] for mb in mbs]
    denom = sum(t.numel() for t in targets)
    for p in runner.gpt.parameters():
        p.grad = None

    def loss_fn(h, k):
        w, start = runner.head("lm_head")
        lp, _ = vocab_parallel_token_logprobs(h[0], w, targets[k], tp_group=runner.pgc.tp, vocab_start=start)
        loss = -lp.sum() / denom
        return loss, {"loss": float(loss.detach())}

    metrics = runner._run_schedule(mbs, fn=loss_fn, forward_only=False)
    native.zero_grad(set_to_none=True)
    nloss = 0.0
    for k, mb in enumerate(mbs):
        h = native.hidden_states(mb.input_ids, mb.position_ids, attn=DocumentAttention(mb.position_ids))
        loss = -compute_token_logprobs(h[0], native.lm_head.weight, targets[k])[0].sum() / denom
        loss.backward()
        nloss += float(loss)
    grads = megatron_to_hf({n: p.grad for n, p in runner.gpt.named_parameters()}, cfg, tp=tp, pp=1, pp_rank=0)
    ref = dict(native.named_parameters())
    gerr = max((gr - ref[n].grad[tp_slices(n, tuple(ref[n].shape), rank=r, world=tp)]).abs().max().item()
               for n, gr in grads.items())
    return max(abs(sum(m["loss"] for m in metrics) - nloss), gerr)


def _worker_case(native, rank, world):
    """A reference PolicyWorker on backend megatron (TP=2, built by the one factory) reports the same response
    log-probs and entropies as the same worker on the native backend (packed, shared-prompt micro-batches)."""
    import copy

    from parallel.dims import ParallelDims, build_mesh
    from ppo.batch.experience import Experience, Sample
    from ppo.roles.actor_critic import PolicyWorker
    from ppo.roles.workers import WorkerSpec

    g = torch.Generator().manual_seed(7)
    samples = []
    for i in range(4):
        prompt = torch.randint(3, 500, (5,), generator=g).tolist()
        for j in range(2):  # two responses per prompt: shared-prompt packing
            resp = torch.randint(3, 500, (3 + i + j,), generator=g).tolist()
            samples.append(Sample(uid=2 * i + j, prompt_index=i, prompt_ids=prompt, response_ids=resp,
                                  behaviour_logprobs=[], finish_reason="stop"))
    exp = Experience(samples)
    dims = ParallelDims(tp=2, pp=1, dp=world // 2)
    mesh = build_mesh(dims, list(range(world)), device_type="cpu")
    out = {}
    for backend in ("native", "megatron"):
        spec = WorkerSpec(mesh=mesh, dims=dims, device=torch.device("cpu"), dtype=torch.float32, backend=backend,
                          share_prompts=True)
        worker = PolicyWorker(copy.deepcopy(native), spec, temperature=0.7, pad_id=0, trainable=False)
        out[backend] = worker.compute_logprobs(exp, worker.plan(exp, mini_batch_size=0, max_tokens=24),
                                               with_entropy=True)
    if rank:  # tp rank 1 is no owner: it reports nothing on either backend
        return not out["native"]["logp"] and not out["megatron"]["logp"]
    n, m = out["native"], out["megatron"]
    return max(max((n[k][u] - m[k][u]).abs().max().item() for u in n[k]) for k in ("logp", "entropy")) < TOL


def _split_case(native, rank, world):
    """Split placement: only rank 1 hosts a megatron role. Building its optimizer's param groups makes
    megatron-core's WORLD all_gather_object, which rank 0 never joins; scoped to the role's group it
    completes (rank 0 waits at the barrier meanwhile instead of matching megatron's collective)."""
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    from parallel.backends import build_runner
    from parallel.dims import ParallelDims, build_mesh
    from parallel.megatron_runner import role_scoped_all_gather_object

    meshes = [build_mesh(ParallelDims(), [r], device_type="cpu") for r in range(world)]  # every rank builds all
    groups = None
    if rank == 1:
        runner = build_runner(native, backend="megatron", mesh=meshes[1], dims=ParallelDims())
        with role_scoped_all_gather_object(runner.pgc.intra_dist_opt):
            groups = _get_param_groups([runner.gpt], OptimizerConfig(lr=1e-5), None)
    dist.barrier()
    return rank == 0 or sum(len(g["params"]) for g in groups) == len(list(runner.gpt.parameters()))


def _grad_norm_case(rank, world):
    """grad_norm_one_sync over the world: each rank's gradient shards -> the L2 norm of all of them (relative error)."""
    import torch.distributed as dist

    from parallel.megatron_runner import grad_norm_one_sync

    def shards(r):
        g = torch.Generator().manual_seed(r)
        return [torch.randn(n, generator=g) for n in (5, 64, 300)]

    class DistOptLike:  # the two methods of megatron's DistributedOptimizer that the norm reads
        def get_main_grads_for_grad_norm(self):
            return shards(rank)

        def get_grad_stats_parallel_group(self):
            return dist.group.WORLD

    want = torch.linalg.vector_norm(torch.cat([t for r in range(world) for t in shards(r)]).double()).item()
    return abs(grad_norm_one_sync(DistOptLike()) - want) / want


def _tp_body(rank, world):
    from megatron.core import parallel_state

    from parallel.runner import MicroBatch

    torch.manual_seed(0)
    ids = torch.randint(3, 500, (2, 7), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(7).expand(2, 7)
    out = {}
    for name in CONFIGS:
        native = _native(name)
        ref = native(ids, pos).detach()
        for tp in (1, 2):
            runner, gpt, pgc = _megatron(native, tp, world)  # forward-only (no optimizer): runs on CPU at pp = 1
            w, start = runner.head("lm_head")
            assert start == pgc.tp.rank() * w.shape[0] and runner.has_first and runner.has_last
            rows = [MicroBatch(ids[i:i + 1], pos[i:i + 1]) for i in range(len(ids))]
            logits = _gather_vocab(torch.cat(runner.forward(rows, reduce=lambda h, k, w=w: h @ w.t())), pgc)
            out[(name, tp, "logits")] = (logits - ref).abs().max().item()
            if name != "qwen2_bias":
                native.zero_grad(set_to_none=True)
                out[(name, tp, "logprob_grad")] = _logprob_grad_case(native, gpt, pgc, ids, pos)
            if tp == 2 and name == "llama":
                with torch.no_grad():
                    out[(name, tp, "packing")] = _packing_case(native, gpt)
            if tp == 2 and name != "qwen2_bias":
                out[(name, tp, "reshard")] = _reshard_case(native, runner, pgc, world)
                out[(name, tp, "export")] = _export_case(native, runner, rank)
            if tp == 2 and name == "llama":  # (the native TP plan refuses tied heads at tp > 1)
                out[(name, tp, "worker")] = _worker_case(native, rank, world)
                out[(name, tp, "schedule")] = _schedule_case(native, runner)
    out[("llama", 1, "split")] = _split_case(_native("llama"), rank, world)
    out[("all", world, "grad_norm")] = _grad_norm_case(rank, world)
    out["globals_untouched"] = not parallel_state.model_parallel_is_initialized()
    return out


@pytest.mark.distributed
def test_megatron_matches_native_at_tp1_and_tp2():
    for res in run_world(_tp_body, world_size=2, timeout=300):
        assert res.pop("globals_untouched")
        for key, val in res.items():
            if key[2] in ("reshard", "export", "worker", "split"):
                assert val is True, key
            elif key[2] == "logprob_grad":
                assert max(val) < TOL, (key, val)
            else:
                assert val < TOL, (key, val)


def _pp_body(rank, world):
    import torch.distributed as dist

    from models.megatron_map import hf_names, hf_to_megatron
    from models.megatron_model import head_weight, megatron_hidden

    out = {}
    ids = torch.randint(3, 500, (2, 6), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(6).expand(2, 6)
    for name in ("llama", "qwen2_bias", "qwen3"):  # tied heads at pp > 1: GPU test (megatron syncs them with .cuda())
        native = _native(name)
        _, gpt, pgc = _megatron(native, 2, world, pp=2)
        lay = dict(tp=2, pp=2, pp_rank=pgc.pp.rank())
        full = {n: p.detach() for n, p in native.named_parameters(remove_duplicate=False)}
        from parallel.sharding import tp_slices

        local = {n: full[n][tp_slices(n, tuple(full[n].shape), rank=pgc.tp.rank(), world=2)]
                 for n in hf_names(native.config, pp=2, pp_rank=lay["pp_rank"])}
        want = {n: tuple(t.shape) for n, t in hf_to_megatron(local, native.config, **lay).items()}
        got = {n: tuple(p.shape) for n, p in gpt.named_parameters()}
        out[(name, "names")] = want == got
        # a two-stage forward by hand (megatron's schedules need CUDA): stage 0 sends [T, B, H] to stage 1
        peer = dist.get_global_rank(pgc.pp, 1 - pgc.pp.rank())
        with torch.no_grad():
            if pgc.pp.rank() == 0:
                dist.send(megatron_hidden(gpt, ids, pos).contiguous(), peer)
            else:
                buf = torch.empty(6, 2, native.config.hidden_size)
                dist.recv(buf, peer)
                h = megatron_hidden(gpt, None, pos, hidden_in=buf).transpose(0, 1)
                logits = _gather_vocab(h @ head_weight(gpt).t(), pgc)
                out[(name, "pp_logits")] = (logits - native(ids, pos)).abs().max().item()
    return out


@pytest.mark.distributed
def test_tp2_pp2_build_names_shapes_and_logits():
    results = run_world(_pp_body, world_size=4, timeout=300)
    for rank, res in enumerate(results):
        for key, val in res.items():
            if key[1] == "names":
                assert val, (rank, key)
            else:
                assert val < TOL, (rank, key, val)
    assert sum(1 for res in results for k in res if k[1] == "pp_logits") == 6  # 2 last-stage ranks x 3 models


def test_the_megatron_runner_has_every_member_of_the_runner_contract():
    """Callers never branch on the backend (parallel.runner.ModelRunner): a member the megatron runner lacked
    (lora_modules) crashed the supervised warm-up of a megatron actor on the GPU."""
    from parallel.megatron_runner import MegatronRunner
    from parallel.runner import ModelRunner

    assert [n for n in vars(ModelRunner) if not n.startswith("_") and not hasattr(MegatronRunner, n)] == []
    assert MegatronRunner.lora_modules.fget(None) == {}
