"""A runner's checkpoint state written at tp=2 pp=2 (4 ranks) loads at tp=2 (2 ranks) and at dp=4 (FSDP, 4 ranks):
parameters and AdamW's moments land as the single-process run's, and the next step's losses and weights equal the
single-process run's second step (the straight run from the same state, same micro-batches)."""

from __future__ import annotations

import pytest
import torch

from models import build_model
from models.document_attention import DocumentAttention
from parallel.native_runner import LocalRunner
from parallel.reshard_state import TIED, ReshardError, assemble
from parallel.runner import MicroBatch
from tests.dist_utils import run_world


def _batches() -> list[MicroBatch]:
    g = torch.Generator().manual_seed(3)
    out = []
    for docs in ([5, 4], [7]):
        ids = torch.randint(1, 512, (1, sum(docs)), generator=g)
        out.append(MicroBatch(ids, torch.cat([torch.arange(n) for n in docs])[None]))
    return out


def _train_step(runner, opt) -> list[float]:
    """One clipped AdamW step of a loss on the final hidden states (the trunk; a tp-sharded head would need a
    vocab-parallel loss); the micro-batch losses (last stage, else [])."""
    def loss_fn(h, k):
        loss = h.float().square().mean() / (k + 1)
        return loss, {"loss": float(loss.detach())}

    metrics = runner.forward_backward(_batches(), loss_fn=loss_fn)
    runner.optimizer_step(opt, max_norm=0.5)
    opt.zero_grad()
    return [m["loss"] for m in metrics]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _snapshot(runner, opt) -> dict:
    params = dict(runner.named_parameters())
    return {"params": {n: _full(p) for n, p in params.items()},
            "exp_avg": {n: _full(opt.state[p]["exp_avg"]) for n, p in params.items() if p in opt.state}}


def _runner(rank, world, dims, *, seed):
    from parallel.apply import parallelize_model
    from parallel.dims import build_mesh

    mesh = build_mesh(dims, list(range(world)), device_type="cpu")
    runner = parallelize_model(build_model("tiny", seed=seed), mesh=mesh, dims=dims,
                               n_microbatches=len(_batches()) if dims.pp > 1 else None, attn_factory=DocumentAttention)
    return runner, runner.build_optimizer(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)


def _save_body(rank, world, out):
    from parallel.dims import ParallelDims

    runner, opt = _runner(rank, world, ParallelDims(tp=2, pp=2), seed=0)
    _train_step(runner, opt)
    torch.save(runner.checkpoint_state(opt), f"{out}/rank_{rank}.pt")


def _resume_body(rank, world, dims, out):
    from parallel.reshard_state import reshard_runner_state

    saved = [torch.load(f"{out}/rank_{r}.pt", weights_only=True, mmap=True) for r in range(4)]
    runner, opt = _runner(rank, world, dims, seed=7)  # other weights: everything must come from the checkpoint
    runner.load_checkpoint_state(opt, reshard_runner_state(runner, opt, saved))
    loaded = _snapshot(runner, opt)
    losses = _train_step(runner, opt)
    return {"loaded": loaded, "losses": losses, "after": _snapshot(runner, opt)["params"]}


def _reference(out: str) -> dict:
    """The straight run from the same state: one process loads the checkpoint whole, then trains a step."""
    from parallel.reshard_state import reshard_runner_state

    saved = [torch.load(f"{out}/rank_{r}.pt", weights_only=True) for r in range(4)]
    runner = LocalRunner(build_model("tiny", seed=7), attn_factory=DocumentAttention)
    opt = runner.build_optimizer(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    runner.load_checkpoint_state(opt, reshard_runner_state(runner, opt, saved))
    loaded = _snapshot(runner, opt)
    # whole means whole: every saved rank's shard is the region of the full tensor its chunk index names
    for st in saved:
        for n, (shape, offsets) in st["slices"].items():
            full = loaded["params"][TIED.get(n, n) if n not in loaded["params"] else n]
            chunk = st["params"][n]
            assert list(full.shape) == shape
            assert torch.equal(full[tuple(slice(o, o + k) for o, k in zip(offsets, chunk.shape))], chunk), n
    losses = _train_step(runner, opt)
    return {"loaded": loaded, "losses": losses, "after": _snapshot(runner, opt)["params"]}


def _same(got: dict, want: dict, **tol) -> None:
    """Tensors by name equal (a tied weight's head copy compared with the embedding it copies)."""
    assert {TIED.get(n, n) if n not in want else n for n in got} <= set(want) and got
    for n, t in got.items():
        torch.testing.assert_close(t, want[n if n in want else TIED[n]], msg=n, **tol)


@pytest.mark.distributed
def test_tp2_pp2_state_resumes_at_tp2_and_at_dp4(tmp_path):
    from parallel.dims import ParallelDims

    run_world(_save_body, 4, args=(str(tmp_path),))
    ref = _reference(str(tmp_path))
    for world, dims in ((2, ParallelDims(tp=2)), (4, ParallelDims(dp=4))):
        res = run_world(_resume_body, world, args=(dims, str(tmp_path)))
        for r in res:
            _same(r["loaded"]["params"], ref["loaded"]["params"], rtol=0, atol=0)  # copies: exact
            _same(r["loaded"]["exp_avg"], ref["loaded"]["exp_avg"], rtol=0, atol=0)
            assert len(r["loaded"]["exp_avg"]) == len(ref["loaded"]["exp_avg"])
            if r["losses"]:  # the last stage's micro-batch losses
                torch.testing.assert_close(r["losses"], ref["losses"], rtol=1e-5, atol=1e-7)
            # an AdamW step moves a weight by up to lr (1e-3); where a gradient is near zero, the reduction order's
            # noise in it moves that step by a few 1e-6 (seen: 2.5e-6 on one element of 11,264, torch 2.13 CPU): 1% of
            # a step is the bound, far below what a misplaced shard or moment would give
            _same(r["after"], ref["after"], rtol=1e-4, atol=1e-5)


def test_assemble_reads_overlapping_chunks_and_names_a_gap():
    full = torch.arange(24.0).reshape(4, 6)
    chunks = [([0, 0], full[:2, :3]), ([0, 3], full[:2, 3:]), ([2, 0], full[2:, :]), ([2, 0], full[2:, :])]
    got = assemble("w", shape=[4, 6], region=(slice(1, 3), slice(2, 5)), chunks=chunks, dtype=torch.float32)
    assert torch.equal(got, full[1:3, 2:5])
    with pytest.raises(ReshardError, match=r"w: 3 of 6 elements"):
        assemble("w", shape=[4, 6], region=(slice(1, 3), slice(2, 5)), chunks=chunks[:2],
                 dtype=torch.float32)
