"""A megatron checkpoint (tp=2, dp=2) converted for the native backend (parallel/megatron_checkpoint.py) and resharded
into a native runner: fp32 masters, Adam moments and the step land exactly on the known full tensors they were made
from. The rank states are in the exact checkpoint format: parameters from a real megatron-core GPTModel built on
CPU (tp=2 over gloo; tied Qwen3 with q/k norms, so fused qkv per KV group, fused gate/up and the tied head are all
crossed), optimizer shards laid out as megatron's distributed optimizer lays them out (the TP-local parameters
flattened into one buffer in reverse order, padded, split evenly over the DP ranks: a shard's `range` is its part
of the flat parameter, and some parameters straddle the two ranks)."""

from __future__ import annotations

import pytest
import torch

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
    from models.llama import DocumentAttention
    from parallel.runner import LocalRunner

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
