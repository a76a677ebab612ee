"""ShardLocalAdamW equals torch.optim.AdamW bit for bit: on plain tensors (two parameter groups, a
parameter without a gradient on one step, across a state_dict round trip) and on the actor's FSDP
layout (DTensor fp32 masters, bf16 compute), where its moments stay DTensors like AdamW's; on a GPU
(marked gpu) its torch path (kernel=False) matches AdamW(fused=True) on the same DTensors bit for bit, and
the runner's optimizer, the Triton update (parallel/triton_adamw.py), to fp32 rounding."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from models import build_model
from parallel.shard_adamw import ShardLocalAdamW


def _groups(model, wd: float):
    decay = [p for n, p in model.named_parameters() if n.endswith("proj.weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("proj.weight")]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def _loss(model, ids):
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def _train(model, opt, steps: int, *, seed: int, skip_head_at: int = -1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    for s in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g).to(device)
        opt.zero_grad(set_to_none=True)
        _loss(model, ids).backward()
        if s == skip_head_at:
            model.lm_head.weight.grad = None  # AdamW neither steps nor counts a parameter without a gradient
        opt.step()


def _assert_same(named_a, opt_a, named_b, opt_b):
    for (n, a), (_, b) in zip(named_a, named_b):
        assert torch.equal(a, b), n
        sa, sb = opt_a.state.get(a, {}), opt_b.state.get(b, {})
        assert sa.keys() == sb.keys(), n
        for k in sa:
            assert torch.equal(sa[k], sb[k]), (n, k)


def test_plain_tensors_equal_adamw_across_a_state_dict_round_trip():
    ref = build_model("tiny", seed=3)
    mine = copy.deepcopy(ref)
    plain = torch.optim.AdamW(_groups(ref, 0.1), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    local = ShardLocalAdamW(_groups(mine, 0.1), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    _train(ref, plain, 3, seed=1, skip_head_at=1)
    _train(mine, local, 3, seed=1, skip_head_at=1)
    _assert_same(ref.named_parameters(), plain, mine.named_parameters(), local)
    assert local.state[mine.lm_head.weight]["step"].item() == 2  # skipped once, like AdamW

    resumed_model = copy.deepcopy(mine)
    resumed = ShardLocalAdamW(_groups(resumed_model, 0.1), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    resumed.load_state_dict(copy.deepcopy(local.state_dict()))
    _train(ref, plain, 2, seed=2)
    _train(resumed_model, resumed, 2, seed=2)
    _assert_same(ref.named_parameters(), plain, resumed_model.named_parameters(), resumed)


def _fsdp_layout_matches_adamw(device: str, backend: str, *, kernel: bool = False):
    import torch.distributed as dist

    from parallel.apply import parallelize_model
    from parallel.dims import ParallelDims, build_mesh

    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        dims = ParallelDims(tp=1, pp=1, dp=1)
        mesh = build_mesh(dims, [0], device_type=device)
        runners = [parallelize_model(build_model("tiny", seed=3).to(device), mesh=mesh, dims=dims,
                                     param_dtype=torch.bfloat16, fsdp=True) for _ in range(2)]
        fused = device == "cuda"
        plain = torch.optim.AdamW(runners[0].parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=fused, foreach=False if not fused else None)
        local = runners[1].build_optimizer(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        assert isinstance(local, ShardLocalAdamW) and local.kernel == (device == "cuda")
        if not kernel:  # torch's path
            local = ShardLocalAdamW(runners[1].parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                                    kernel=False)
        same = torch.equal if not kernel else _close
        # the kernel rounds differently in the last bit, which can flip a bf16 compute weight and move the next
        # step's gradients: one step from the same state there, three on torch's path
        steps = 1 if kernel else 3
        _train(runners[0].module, plain, steps, seed=4, device=device)
        _train(runners[1].module, local, steps, seed=4, device=device)
        named = [list(r.module.named_parameters()) for r in runners]
        assert all(hasattr(p, "to_local") for _, p in named[1])  # really the FSDP (DTensor) layout
        for (n, a), (_, b) in zip(*named):
            assert same(a.to_local(), b.to_local()), n
            sa, sb = plain.state[a], local.state[b]
            assert sa.keys() == sb.keys() and hasattr(sb["exp_avg"], "to_local"), n
            for k in ("exp_avg", "exp_avg_sq"):
                assert same(sa[k].to_local(), sb[k].to_local()), (n, k)
            assert torch.equal(sa["step"].cpu(), sb["step"].cpu()), n
        start = dict(build_model("tiny", seed=3).named_parameters())
        n0, p0 = named[1][0]
        assert not torch.equal(p0.to_local().cpu(), start[n0])  # the steps moved it
    finally:
        dist.destroy_process_group()


def test_fsdp_layout_matches_adamw():
    _fsdp_layout_matches_adamw("cpu", "gloo")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [False, True])
def test_gpu_fsdp_layout_matches_fused_adamw(kernel):
    _fsdp_layout_matches_adamw("cuda", "nccl", kernel=kernel)
