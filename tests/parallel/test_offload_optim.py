"""HostOffloadAdamW equals torch.optim.AdamW: same parameters and moments after N steps of a tiny
Llama (fp32, two parameter groups, several staged chunks, a parameter without a gradient on one
step), across a state_dict round trip, and in the actor's FSDP layout (DTensor masters, bf16
compute) through the runner's clip-and-step; on a GPU (marked gpu) its moments are pinned host
memory, fused updates match fused AdamW bit for bit and the staging stays within two chunks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from models import build_model
from parallel.offload_optim import HostOffloadAdamW
from parallel.shard_adamw import ShardLocalAdamW


def _groups(model, wd: float):
    decay = [p for n, p in model.named_parameters() if n.endswith("proj.weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("proj.weight")]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def _train(model, opt, steps: int, *, seed: int, skip_head_at: int = -1):
    g = torch.Generator().manual_seed(seed)
    for s in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if s == skip_head_at:
            model.lm_head.weight.grad = None  # AdamW neither steps nor counts a parameter without a gradient
        opt.step()


def _pair(wd=0.1, lr=1e-2):
    ref = build_model("tiny", seed=3)
    off = copy.deepcopy(ref)
    plain = torch.optim.AdamW(_groups(ref, wd), lr=lr, betas=(0.9, 0.95), weight_decay=wd)
    # a small chunk: the step walks many staged chunks (a chunk closes at 64 KiB of moments)
    offload = HostOffloadAdamW(_groups(off, wd), lr=lr, betas=(0.9, 0.95), weight_decay=wd, chunk_bytes=64 << 10)
    return ref, plain, off, offload


def _assert_same(ref, plain, off, offload):
    for (n, a), b in zip(ref.named_parameters(), off.parameters()):
        assert torch.equal(a, b), n
        sa, sb = plain.state[a], offload.state[b]
        assert sa.keys() == sb.keys(), n
        for k in sa:
            assert torch.equal(sa[k].float(), sb[k].float().to(sa[k].device)), (n, k)


def test_update_equals_adamw_after_steps():
    ref, plain, off, offload = _pair()
    _train(ref, plain, 5, seed=1, skip_head_at=2)
    _train(off, offload, 5, seed=1, skip_head_at=2)
    assert len(offload._chunks(0, offload.param_groups[0])) > 3  # the streaming path really chunks
    _assert_same(ref, plain, off, offload)
    assert float(offload.state[off.lm_head.weight]["step"]) == 4.0  # one step skipped
    assert offload.host_bytes() == 8 * sum(p.numel() for p in off.parameters())
    assert all(s["exp_avg"].device.type == "cpu" for s in offload.state.values())
    # the parameters moved: not a vacuous equality
    assert not torch.equal(ref.lm_head.weight, build_model("tiny", seed=3).lm_head.weight)


def test_state_dict_round_trip_continues_identically():
    ref, plain, off, offload = _pair(wd=0.0)
    _train(ref, plain, 3, seed=2)
    _train(off, offload, 3, seed=2)
    resumed_model = copy.deepcopy(off)
    resumed = HostOffloadAdamW(_groups(resumed_model, 0.0), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    resumed.load_state_dict(copy.deepcopy(offload.state_dict()))
    assert all(s["exp_avg"].device.type == "cpu" for s in resumed.state.values())
    _train(ref, plain, 2, seed=9)
    _train(resumed_model, resumed, 2, seed=9)
    _assert_same(ref, plain, resumed_model, resumed)


def test_rejects_what_one_flat_host_buffer_cannot_hold():
    with pytest.raises(ValueError, match="one device"):
        HostOffloadAdamW([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, device="meta"))])
    with pytest.raises(ValueError, match="groups by dtype"):
        HostOffloadAdamW([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))])


@pytest.mark.gpu
def test_gpu_fused_matches_and_moments_stay_pinned():
    dev = torch.device("cuda")
    ref = build_model("tiny", seed=3).to(dev)
    off = copy.deepcopy(ref)
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    chunk = 64 << 10
    offload = HostOffloadAdamW(off.parameters(), lr=1e-2, weight_decay=0.1, chunk_bytes=chunk)
    g = torch.Generator().manual_seed(4)
    for _ in range(4):
        ids = torch.randint(0, 512, (2, 12), generator=g).to(dev)
        for m, o in ((ref, plain), (off, offload)):
            logits = m(ids)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, 512), ids[:, 1:].reshape(-1))
            o.zero_grad(set_to_none=True)
            loss.backward()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        offload.step()
        staged = torch.cuda.max_memory_allocated(dev) - base
        largest = max(8 * p.numel() for p in off.parameters())
        assert staged <= 2 * max(chunk, largest) + (1 << 20), staged  # two chunks in flight, not all moments
        plain.step()
    _assert_same(ref, plain, off, offload)
    assert offload.pinned
    assert all(s["exp_avg"].is_pinned() and s["exp_avg_sq"].is_pinned() for s in offload.state.values())


def _fsdp_actor_layout_matches_adamw(device: str, backend: str):
    """The actor's layout on one device (FSDP2: fp32 DTensor masters, bf16 compute, full AC):
    HostOffloadAdamW steps the DTensor shards through their local tensors exactly as AdamW does,
    through the runner's optimizer_step (global-norm clipping first)."""
    import torch.distributed as dist

    from parallel.apply import parallelize_model
    from parallel.dims import ParallelDims, build_mesh

    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        dims = ParallelDims(tp=1, pp=1, dp=1)
        mesh = build_mesh(dims, [0], device_type=device)
        runners = [parallelize_model(build_model("tiny", seed=3).to(device), mesh=mesh, dims=dims, ac="full",
                                     param_dtype=torch.bfloat16, fsdp=True) for _ in range(2)]
        # the reference: torch's path of the runner's optimizer (on CUDA the runner's own is the Triton update,
        # equal to fp32 rounding only: tests/parallel/test_triton_adamw.py)
        opts = [ShardLocalAdamW(runners[0].parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, kernel=False),
                runners[1].build_optimizer(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, stream_from_host=True)]
        assert isinstance(opts[1], HostOffloadAdamW) and not opts[1].kernel
        g = torch.Generator().manual_seed(4)
        for _ in range(3):
            ids = torch.randint(0, 512, (2, 12), generator=g).to(device)
            for r, o in zip(runners, opts):
                logits = r.module(ids)
                F.cross_entropy(logits[:, :-1].reshape(-1, 512).float(), ids[:, 1:].reshape(-1)).backward()
                r.optimizer_step(o, max_norm=1.0)
                o.zero_grad(set_to_none=True)
        pairs = list(zip(runners[0].named_parameters(), runners[1].named_parameters()))
        assert all(hasattr(b, "to_local") for _, (_, b) in pairs)  # really the FSDP (DTensor) layout
        for (n, a), (_, b) in pairs:
            assert torch.equal(a.to_local(), b.to_local()), n
        start = dict(build_model("tiny", seed=3).named_parameters())
        assert not torch.equal(pairs[0][1][1].to_local().cpu(), start[pairs[0][0][0]])  # the steps moved it
    finally:
        dist.destroy_process_group()


def test_fsdp_actor_layout_matches_adamw():
    _fsdp_actor_layout_matches_adamw("cpu", "gloo")


@pytest.mark.gpu
def test_gpu_fsdp_actor_layout_matches_fused_adamw():
    _fsdp_actor_layout_matches_adamw("cuda", "nccl")
