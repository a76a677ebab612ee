"""The torch-optimizer plumbing around megatron-core's distributed optimizer (parallel/megatron_runner.py)
that runs without megatron or a GPU: fused AdamW switch, name-keyed master shards, un-shared Adam steps
(the one-sync grad norm is checked over gloo in tests/parallel/test_megatron.py's TP world).
(The distributed optimizer itself needs CUDA: tests/parallel/test_megatron_gpu.py.)"""

import pytest
import torch

from parallel.megatron_runner import (
    _load_master_shards,
    _master_shards,
    _unshare_steps,
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


def test_unshare_steps_gives_each_state_its_own_counter():
    """megatron's load_state_dict puts one step tensor into every state: foreach AdamW would bump it once per
    parameter. After _unshare_steps two more steps count 2 for every parameter and match an unloaded run."""
    a, b = _params(), _params()
    kw = dict(lr=1e-2, foreach=True)
    opt, ref = torch.optim.AdamW(a, **kw), torch.optim.AdamW(b, **kw)
    for seed in range(2):
        _grads(a, seed)
        _grads(b, seed)
        opt.step()
        ref.step()
    saved = opt.state_dict()
    shared = torch.tensor(2.0)
    for s in saved["state"].values():  # the layout megatron's DistributedOptimizer.load_state_dict builds
        s["step"] = shared
    opt.load_state_dict(saved)
    assert len({id(s["step"]) for s in opt.state.values()}) == 1  # torch keeps it shared (not fused)
    _unshare_steps(opt)
    assert len({id(s["step"]) for s in opt.state.values()}) == len(a)
    for seed in (5, 6):
        _grads(a, seed)
        _grads(b, seed)
        opt.step()
        ref.step()
    assert {float(s["step"]) for s in opt.state.values()} == {4.0}
    assert all(torch.equal(x, y) for x, y in zip(a, b))


class _FakeDistOpt:
    """The two megatron DistributedOptimizer hooks the checkpoint uses, over per-parameter master/Adam tensors;
    `order` is the bucket order of its param map (it differs between two builds of the same model)."""

    def __init__(self, params: dict, order: list[str], seed: int):
        g = torch.Generator().manual_seed(seed)
        self.states = {p: {"param": torch.randn(p.numel(), generator=g), "exp_avg": torch.randn(p.numel(), generator=g)}
                       for p in params.values()}
        self.gbuf_ranges = [{torch.float32: [{"param_map": {params[n]: None for n in order}}]}]

    def _get_main_param_and_optimizer_states(self, p):
        return self.states[p]

    def _set_main_param_and_optimizer_states(self, p, tensors):
        for k, v in self.states[p].items():
            v.copy_(tensors[k])


def test_master_shards_round_trip_by_name_whatever_the_bucket_order():
    names = ["w", "norm", "b"]
    a_params = {n: torch.nn.Parameter(torch.zeros(k)) for n, k in zip(names, (64, 4, 8))}
    b_params = {n: torch.nn.Parameter(torch.zeros(k)) for n, k in zip(names, (64, 4, 8))}
    a = _FakeDistOpt(a_params, order=names, seed=0)
    b = _FakeDistOpt(b_params, order=names[::-1], seed=1)  # another build: another bucket order
    saved = {n: {k: v.clone() for k, v in st.items()}
             for n, st in _master_shards(a, {p: n for n, p in a_params.items()}).items()}
    _load_master_shards(b, saved, names={p: n for n, p in b_params.items()})
    for n in names:
        for k in ("param", "exp_avg"):
            assert torch.equal(b.states[b_params[n]][k], a.states[a_params[n]][k]), (n, k)
    with pytest.raises(KeyError, match="another layout"):
        _load_master_shards(b, {"w": saved["w"]}, names={p: n for n, p in b_params.items()})


def test_megatron_optimizers_unwraps_the_chain_and_skips_stubs():
    class Dist:
        def __init__(self, optimizer, stub=False):
            self.optimizer, self.is_stub_optimizer = optimizer, stub

    real = Dist(torch.optim.AdamW(_params(), lr=1e-3))

    class Chained:
        chained_optimizers = [real, Dist(None, stub=True)]

    assert megatron_optimizers(Chained()) == [real]
    assert megatron_optimizers(real) == [real]

