"""The torch-optimizer plumbing around megatron-core's distributed optimizer (parallel/megatron_runner.py)
that runs without megatron or a GPU: fused AdamW switch, master shards and Adam state keyed by name
(the one-sync grad norm is checked over gloo in tests/parallel/test_megatron.py's TP world).
(The distributed optimizer itself needs CUDA: tests/parallel/test_megatron_gpu.py.)"""

from types import SimpleNamespace

import pytest
import torch

from parallel.megatron_runner import (
    _load_master_shards,
    _master_shards,
    megatron_optimizers,
    use_fused_adamw,
)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (7, 33, 128)]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_fused_switch_equals_adamw_built_fused():
    """megatron builds AdamW with no fused/foreach flag; after use_fused_adamw it steps exactly like
    torch.optim.AdamW(fused=True) (the native backend's optimizer), step counter included."""
    a, b = _params(), _params()
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    switched = torch.optim.AdamW([{"params": a}], **kw)  # as megatron-core constructs it (param-group dicts)
    use_fused_adamw(switched)
    ref = torch.optim.AdamW(b, fused=True, **kw)
    assert all(g["fused"] and not g["foreach"] for g in switched.param_groups)
    for seed in range(3):
        _grads(a, seed)
        _grads(b, seed)
        switched.step()
        ref.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(switched.state[x]["exp_avg_sq"], ref.state[y]["exp_avg_sq"]) for x, y in zip(a, b))
    assert {float(s["step"]) for s in switched.state.values()} == {3.0}


def test_fused_switch_refuses_an_optimizer_with_state():
    params = _params()
    opt = torch.optim.AdamW(params, lr=1e-3)
    _grads(params, 0)
    opt.step()
    with pytest.raises(RuntimeError, match="before the optimizer's first step"):
        use_fused_adamw(opt)


class _FakeDistOpt:
    """What the checkpoint reads of a megatron DistributedOptimizer: its param-group index map, its torch
    optimizer over fp32 masters, its 16-bit / fp32 group lists and its buckets' param maps. `order` is the order of
    the groups and buckets, which differs between two builds of the same model; `half` names the 16-bit params, whose
    masters the torch param group lists after the fp32 params' (megatron's order), while the index map counts
    positions in bucket order."""

    def __init__(self, params: dict, order: list[str], half: tuple[str, ...] = ()):
        self.masters = {n: torch.nn.Parameter(params[n].detach().clone()) for n in order}
        fp32, from16 = [n for n in order if n not in half], [n for n in order if n in half]
        self.optimizer = torch.optim.AdamW([self.masters[n] for n in fp32 + from16], lr=1e-2, foreach=True)
        self.model_float16_groups = [[params[n] for n in from16]]
        self.shard_fp32_from_float16_groups = [[self.masters[n] for n in from16]]
        self.model_fp32_groups = [[params[n] for n in fp32]]
        self.shard_fp32_groups = [[self.masters[n] for n in fp32]]
        self.model_param_group_index_map = {params[n]: (0, i) for i, n in enumerate(order)}
        self.gbuf_ranges = [{torch.float32: [{"param_map": {params[n]: {"param": SimpleNamespace(
            start=0, end=params[n].numel())} for n in order}}]}]

    def train(self, seeds):
        for seed in seeds:
            g = torch.Generator().manual_seed(seed)
            for n in sorted(self.masters):
                self.masters[n].grad = torch.randn(self.masters[n].shape, generator=g)
            self.optimizer.step()


def _model_params():
    return {n: torch.nn.Parameter(torch.randn(k, generator=torch.Generator().manual_seed(k)))
            for n, k in zip(("w", "norm", "b"), (64, 4, 8))}


def _clone(entry: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}


def test_master_shards_and_adam_state_round_trip_by_name_whatever_the_order():
    a_params, b_params, ref_params = _model_params(), _model_params(), _model_params()
    half = ("w", "b")  # 16-bit weights, an fp32 norm: the torch param group lists norm first
    a = _FakeDistOpt(a_params, order=["w", "norm", "b"], half=half)
    b = _FakeDistOpt(b_params, order=["b", "norm", "w"], half=half)  # another build: another order
    ref = _FakeDistOpt(ref_params, order=["w", "norm", "b"], half=half)
    a.train([0, 1])
    ref.train([0, 1])
    saved = {n: _clone(st) for n, st in _master_shards(a, {p: n for n, p in a_params.items()}).items()}
    # each name holds its own master and the flat range it covers (the index map's position 0 is norm's master here)
    assert {n: (tuple(st["param"].shape), st["range"]) for n, st in saved.items()} == \
        {"w": ((64,), [0, 64]), "norm": ((4,), [0, 4]), "b": ((8,), [0, 8])}
    assert all(st["param"] is not None and torch.equal(st["param"], a.masters[n]) for n, st in saved.items())
    _load_master_shards(b, saved, names={p: n for n, p in b_params.items()})
    b.train([2, 3])
    ref.train([2, 3])
    for n in ref.masters:
        assert torch.equal(b.masters[n], ref.masters[n]), n
        st = b.optimizer.state[b.masters[n]]
        assert float(st["step"]) == 4.0 and torch.equal(st["exp_avg"], ref.optimizer.state[ref.masters[n]]["exp_avg"])
    assert len({id(st["step"]) for st in b.optimizer.state.values()}) == 3  # each parameter its own counter
    with pytest.raises(KeyError, match="another layout"):
        _load_master_shards(b, {"w": saved["w"]}, names={p: n for n, p in b_params.items()})
    wrong = dict(saved, w={**saved["w"], "param": torch.zeros(3)})
    with pytest.raises(KeyError, match="shape"):
        _load_master_shards(b, wrong, names={p: n for n, p in b_params.items()})


def test_a_checkpoint_from_before_shard_ranges_loads_back_through_its_own_lookup():
    """Written before the ranges (all fp32 here, so its by-position names were right): no range, the old lookup."""
    a_params, b_params = _model_params(), _model_params()
    a, b = _FakeDistOpt(a_params, order=["w", "norm", "b"]), _FakeDistOpt(b_params, order=["w", "norm", "b"])
    a.train([0])
    old = {n: {k: v for k, v in _clone(st).items() if k != "range"}
           for n, st in _master_shards(a, {p: n for n, p in a_params.items()}).items()}
    _load_master_shards(b, old, names={p: n for n, p in b_params.items()})
    for n in a.masters:
        assert torch.equal(b.masters[n], a.masters[n])
        assert torch.equal(b.optimizer.state[b.masters[n]]["exp_avg"], a.optimizer.state[a.masters[n]]["exp_avg"])


def test_megatron_optimizers_unwraps_the_chain_and_skips_stubs():
    class Dist:
        def __init__(self, optimizer, stub=False):
            self.optimizer, self.is_stub_optimizer = optimizer, stub

    real = Dist(torch.optim.AdamW(_params(), lr=1e-3))

    class Chained:
        chained_optimizers = [real, Dist(None, stub=True)]

    assert megatron_optimizers(Chained()) == [real]
    assert megatron_optimizers(real) == [real]

