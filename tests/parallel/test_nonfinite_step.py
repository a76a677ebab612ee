"""A NaN in one rank's gradient shard skips the optimizer step on every rank (parallel/runner.py): the grad norm is
reduced over the model's dp / tp / pp groups, so under FSDP (dp = 2) and TP = 2 both ranks see it
non-finite and leave their weights and optimizer state as they were; the next clean step trains on both."""

from __future__ import annotations

import math

import pytest
import torch

from models import build_model
from models.document_attention import DocumentAttention
from tests.dist_utils import run_world
from tests.parallel.test_runner import _batches


def _local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _body(rank, world):
    from parallel.apply import parallelize_model
    from parallel.dims import ParallelDims, build_mesh
    from parallel.master_weights import grad_of

    out = {}
    for name, dims in (("fsdp2", ParallelDims(dp=2)), ("tp2", ParallelDims(tp=2))):
        runner = parallelize_model(build_model("tiny", seed=0), mesh=build_mesh(dims, list(range(world)),
                                   device_type="cpu"), dims=dims, n_microbatches=4, attn_factory=DocumentAttention)
        batches = _batches()[:1]  # one packed micro-batch: the norm, not the schedule, is under test
        opt = runner.build_optimizer(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)

        def loss_fn(h, k):  # any layout: the last stage's hidden states
            return h.float().square().mean(), {}

        norms, moved = [], []
        for poison in (True, False):
            before = {n: _local(p) for n, p in runner.named_parameters()}
            opt.zero_grad(set_to_none=True)
            runner.forward_backward(batches, loss_fn=loss_fn)
            if poison and rank == 1:  # one element of rank 1's own shard
                g = next(grad_of(p) for p in runner.parameters() if grad_of(p) is not None)
                (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("nan")
            norms.append(runner.optimizer_step(opt, max_norm=1.0))
            moved.append(any(not torch.equal(_local(p), before[n]) for n, p in runner.named_parameters()))
        out[name] = (norms, moved, all(torch.isfinite(_local(p)).all() for p in runner.parameters()))
    return out


@pytest.mark.distributed
def test_a_nan_in_one_ranks_gradient_skips_the_step_on_every_rank():
    for rank, res in enumerate(run_world(_body, 2)):
        for name, (norms, moved, finite) in res.items():
            assert math.isnan(norms[0]) and math.isfinite(norms[1]), (rank, name, norms)
            assert moved == [False, True] and finite, (rank, name, moved)
