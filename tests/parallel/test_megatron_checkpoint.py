"""A megatron checkpoint (tp=2, dp=2) converted for the native backend (parallel/megatron_checkpoint.py) and resharded
into a native runner: fp32 masters, Adam moments and the step land exactly on the known full tensors they were made
from. The rank states are in the exact checkpoint format: parameters from a real megatron-core GPTModel built on
CPU (tp=2 over gloo; tied Qwen3 with q/k norms, so fused qkv per KV group, fused gate/up and the tied head are all
crossed), optimizer shards laid out as megatron's distributed optimizer lays them out (the TP-local parameters
flattened into one buffer in reverse order, padded, split evenly over the DP ranks: a shard's `range` is its part
of the flat parameter, and some parameters straddle the two ranks).

`make test-extended` adds megatron-core's own DistributedOptimizer, built and stepped on CPU with its CUDA requests
redirected (`_CudaOnCpu`): its dp=2 checkpoints at tp=2, pp=2 and with bf16 weights convert exactly."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from models.megatron_map import hf_to_megatron
from parallel.megatron_checkpoint import ConversionError, native_states
from parallel.sharding import tp_slices
from tests.dist_utils import run_world

pytest.importorskip("megatron.core")

TP, DP, STEP = 2, 2, 3.0


def _cfg():
    from models.config import preset_config

    return preset_config("tiny-qwen3", num_hidden_layers=2)


def _megatron_body(rank, world):
    """This TP rank's checkpoint state of a megatron runner built from the seed-0 native model (no optimizer)."""
    from models import build_model
    from parallel.backends import build_runner
    from parallel.dims import ParallelDims, build_mesh

    dims = ParallelDims(tp=TP)
    runner = build_runner(build_model(_cfg(), seed=0), backend="megatron",
                          mesh=build_mesh(dims, list(range(world)), device_type="cpu"), dims=dims)
    return runner.checkpoint_state()


@pytest.fixture(scope="module")
def megatron_states():
    return run_world(_megatron_body, TP)


def _expected(names_shapes) -> dict[str, dict[str, torch.Tensor]]:
    """Known full HF-named masters and moments (tied head: the embedding's)."""
    g = torch.Generator().manual_seed(5)
    out = {k: {} for k in ("param", "exp_avg", "exp_avg_sq")}
    for n, shape in names_shapes:
        for k in out:
            t = torch.randn(shape, generator=g)
            out[k][n] = t.abs() if k == "exp_avg_sq" else t
    return out


def _dp_shards(mc_full: dict[str, dict[str, torch.Tensor]], order: list[str]) -> list[dict]:
    """Per DP rank: {name: {param, range, step, exp_avg, exp_avg_sq}}, megatron's bucket layout (params in reverse
    order in one flat buffer, padded to a multiple of DP, each rank an even contiguous part)."""
    offsets, at = {}, 0
    for n in reversed(order):
        offsets[n] = at
        at += mc_full["param"][n].numel()
    part = -(-at // DP)
    shards = []
    for d in range(DP):
        lo, hi, mine = d * part, (d + 1) * part, {}
        for n, start in offsets.items():
            a, b = max(lo, start) - start, min(hi, start + mc_full["param"][n].numel()) - start
            if b > a:
                mine[n] = {"range": [a, b], "step": torch.tensor(STEP),
                           **{k: mc_full[k][n].reshape(-1)[a:b].clone() for k in mc_full}}
        shards.append(mine)
    return shards


def _rank_states(megatron_states, expected, cfg) -> list[dict]:
    """The 4 ranks' (tp=2 x dp=2) megatron checkpoint states holding `expected`'s masters and moments."""
    states = []
    for st in megatron_states:
        lay = st["layout"]
        mc_full = {k: hf_to_megatron({n: t[tp_slices(n, t.shape, rank=lay["tp_rank"], world=TP)]
                                      for n, t in full.items()}, cfg, tp=TP, pp=1, pp_rank=0)
                   for k, full in expected.items()}
        # the mapping gives exactly the real model's parameter names and TP-local shapes
        assert {n: p.shape for n, p in st["params"].items()} == {n: t.shape for n, t in mc_full["param"].items()}
        shards = _dp_shards(mc_full, list(st["params"]))
        assert any(e["range"][0] > 0 for e in shards[1].values())  # a parameter straddles the two DP ranks
        for d in range(DP):
            states.append({"params": st["params"], "layout": {**lay, "dp": DP, "dp_rank": d},
                           "dist_optim": [shards[d]]})
    return states


def _native(seed):
    from models import build_model
    from models.document_attention import DocumentAttention
    from parallel.native_runner import LocalRunner

    runner = LocalRunner(build_model(_cfg(), seed=seed), attn_factory=DocumentAttention)
    return runner, runner.build_optimizer(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)


@pytest.mark.distributed
def test_megatron_tp2_dp2_state_converts_into_native_exactly(megatron_states):
    from parallel.reshard_state import reshard_runner_state

    cfg = _cfg()
    runner, opt = _native(seed=7)  # other weights: everything must come from the checkpoint
    expected = _expected([(n, p.shape) for n, p in runner.named_parameters()])
    expected = {k: {**v, "lm_head.weight": v["model.embed_tokens.weight"]} for k, v in expected.items()}
    hparams = [{k: v for k, v in g.items() if k != "params"} | {"lr": 4e-4} for g in opt.param_groups]
    states = native_states(_rank_states(megatron_states, expected, cfg), cfg, hparams=hparams)
    assert len(states) == TP
    runner.load_checkpoint_state(opt, reshard_runner_state(runner, opt, states))
    for n, p in runner.named_parameters():
        assert torch.equal(p.detach(), expected["param"][n]), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], expected[k][n]), (n, k)
        assert float(opt.state[p]["step"]) == STEP
    assert opt.param_groups[0]["lr"] == 4e-4 and opt.param_groups[0]["weight_decay"] == 0.01

    # saved before megatron's first step (no optimizer state): the parameters, which came from the seed-0 model
    fresh, fresh_opt = _native(seed=7)
    bare = native_states([{k: v for k, v in st.items() if k != "dist_optim"} for st in
                          _rank_states(megatron_states, expected, cfg)], cfg, hparams=hparams)
    fresh.load_checkpoint_state(fresh_opt, reshard_runner_state(fresh, fresh_opt, bare))
    seed0, _ = _native(seed=0)
    ref = dict(seed0.named_parameters())
    for n, p in fresh.named_parameters():
        assert torch.equal(p.detach(), ref[n].detach()), n
    assert not fresh_opt.state


@pytest.mark.distributed
def test_a_megatron_checkpoint_that_cannot_convert_is_refused(megatron_states):
    cfg = _cfg()
    names = [(n, p.shape) for n, p in _native(seed=7)[0].named_parameters()]
    expected = _expected(names)
    expected = {k: {**v, "lm_head.weight": v["model.embed_tokens.weight"]} for k, v in expected.items()}
    states = _rank_states(megatron_states, expected, cfg)
    with pytest.raises(ConversionError, match=r"in no saved optimizer shard"):
        native_states([s for s in states if s["layout"]["dp_rank"] == 0], cfg, hparams=[{}])
    old = [{**s, "dist_optim": [{n: {k: v for k, v in e.items() if k != "range"}
                                 for n, e in s["dist_optim"][0].items()}]} for s in states]
    with pytest.raises(ConversionError, match=r"before megatron checkpoints recorded .* flat range"):
        native_states(old, cfg, hparams=[{}])
    with pytest.raises(ConversionError, match=r"\(pp_rank, tp_rank\) shards \[\(0, 1\)\]"):
        native_states([s for s in states if s["layout"]["tp_rank"] == 0], cfg, hparams=[{}])


# ---------------------------------------------------------------- megatron's own distributed optimizer, on CPU
class _CudaOnCpu(TorchFunctionMode):
    """megatron's DistributedOptimizer and schedules ask for CUDA by name (device="cuda" buffers, a
    `torch.cuda.FloatTensor` type check); inside this mode those requests get the CPU (and a CPU tensor its CUDA type
    name), so the real optimizer builds and steps over gloo. A test device, never a way to train."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "cuda" in str(kwargs.get("device", "")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _trained_body(rank, world, tp, pp, dtype):
    """A megatron runner with megatron's real DDP + distributed optimizer trained 2 steps on the same micro-batches
    on every DP rank (so any dp gives the same numbers), then its checkpoint state."""
    import parallel.megatron_runner as runner_mod
    from models import build_model
    from models.config import preset_config
    from models.document_attention import DocumentAttention
    from parallel.backends import build_runner
    from parallel.dims import ParallelDims, build_mesh
    from parallel.runner import MicroBatch
    from parallel.vocab_parallel import vocab_parallel_token_logprobs

    runner_mod.require_cuda = lambda what: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    # tied heads at pp > 1 need CUDA in megatron-core itself: the untied tiny preset there
    cfg = _cfg() if pp == 1 else preset_config("tiny", num_hidden_layers=2)
    dims = ParallelDims(tp=tp, pp=pp, dp=world // (tp * pp))
    runner = build_runner(build_model(cfg, seed=0), backend="megatron", param_dtype=dtype, dims=dims,
                          mesh=build_mesh(dims, list(range(world)), device_type="cpu"), attn_factory=DocumentAttention)
    ids = torch.randint(3, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    mbs = [MicroBatch(ids[i:i + 1], torch.arange(16)[None]) for i in range(2)]

    def loss_fn(h, k):
        w, start = runner.head("lm_head")
        lp = vocab_parallel_token_logprobs(h.reshape(-1, h.shape[-1]), w, torch.roll(ids, -1, 1)[k],
                                           tp_group=runner.pgc.tp, vocab_start=start)[0]
        return -lp.sum() / ids.numel(), {}

    with _CudaOnCpu():
        opt = runner.build_optimizer(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01)
        for _ in range(2):
            runner.forward_backward(mbs, loss_fn=loss_fn)
            runner.optimizer_step(opt, max_norm=1.0)
        return runner.checkpoint_state(opt), cfg


def _converted(states, cfg) -> dict:
    from parallel.reshard_state import reshard_runner_state

    runner, opt = _native_of(cfg)
    hparams = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    runner.load_checkpoint_state(opt, reshard_runner_state(runner, opt, native_states(states, cfg, hparams=hparams)))
    return {n: [p.detach().clone(), *(opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")),
                float(opt.state[p]["step"])] for n, p in runner.named_parameters()}


def _native_of(cfg):
    from models import build_model
    from models.document_attention import DocumentAttention
    from parallel.native_runner import LocalRunner

    runner = LocalRunner(build_model(cfg, seed=7), attn_factory=DocumentAttention)
    return runner, runner.build_optimizer(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01)


@pytest.mark.extended
@pytest.mark.distributed
@pytest.mark.parametrize("tp,pp,dtype", [(2, 1, None), (1, 2, None), (2, 1, torch.bfloat16)])
def test_megatrons_own_distributed_optimizer_state_converts_exactly(tp, pp, dtype):
    """megatron-core's real DistributedOptimizer (run on CPU, _CudaOnCpu) at dp=2, where parameters straddle the two
    ranks' flat ranges: converted, its masters, moments and step equal the dp=1 run's converted ones exactly (fp32:
    the same arithmetic), and the masters are megatron's own parameters (fp32) or round to them (bf16: megatron's
    16-bit weights with fp32 norms, where the checkpoint's old by-position master lookup named other parameters)."""
    from models.megatron_map import megatron_to_hf
    from parallel.sharding import tp_shard_dim

    runs = {dp: run_world(_trained_body, tp * pp * dp, args=(tp, pp, dtype)) for dp in ((2,) if dtype else (1, 2))}
    cfg = runs[2][0][1]
    assert any(e["range"][0] > 0 for st, _ in runs[2] for e in st["dist_optim"][0].values())
    converted = {dp: _converted([st for st, _ in run], cfg) for dp, run in runs.items()}
    if 1 in converted:
        for n, (param, *rest) in converted[1].items():
            got = converted[2][n]
            assert torch.equal(param, got[0]) and all(torch.equal(a, b) for a, b in zip(rest[:2], got[1:3])), n
            assert rest[2] == got[3] == 2.0
    for st, _ in runs[2]:
        lay = st["layout"]
        for n, t in megatron_to_hf(st["params"], cfg, tp=tp, pp=pp, pp_rank=lay["pp_rank"]).items():
            full = converted[2][n if n in converted[2] else "model.embed_tokens.weight"][0]
            dim = tp_shard_dim(n)
            if dim is not None and tp > 1:
                full = full.narrow(dim, lay["tp_rank"] * t.shape[dim], t.shape[dim])
            assert torch.equal(full.to(t.dtype), t), n
