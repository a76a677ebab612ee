"""The torch-optimizer plumbing around megatron-core's distributed optimizer (parallel/megatron_runner.py)
that runs without megatron or a GPU: fused AdamW switch, checkpoint padding flags, un-shared Adam steps
(the one-sync grad norm is checked over gloo in tests/parallel/test_megatron.py's TP world).
(The distributed optimizer itself needs CUDA: tests/parallel/test_megatron_gpu.py.)"""

import pytest
import torch

from parallel.megatron_runner import (
    _unshare_steps,
    _with_padding_flags,
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


def test_padding_flags_added_without_touching_the_saved_state():
    entry = {"param": torch.zeros(2), "exp_avg": torch.zeros(2), "gbuf_local_start": 0, "gbuf_local_end": 2}
    saved = {"per_bucket_numel": [2], "per_bucket_numel_unpadded": [2], 0: {torch.float32: [[entry]]}}
    out = _with_padding_flags(saved)
    assert out[0][torch.float32][0][0]["padding"] is False and out[0][torch.float32][0][0]["param"] is entry["param"]
    assert "padding" not in entry and out["per_bucket_numel"] == [2]


def test_megatron_optimizers_unwraps_the_chain_and_skips_stubs():
    class Dist:
        def __init__(self, optimizer, stub=False):
            self.optimizer, self.is_stub_optimizer = optimizer, stub

    real = Dist(torch.optim.AdamW(_params(), lr=1e-3))

    class Chained:
        chained_optimizers = [real, Dist(None, stub=True)]

    assert megatron_optimizers(Chained()) == [real]
    assert megatron_optimizers(real) == [real]

