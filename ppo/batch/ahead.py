"""Batches generated ahead of the step that trains them, under a staleness bound K (trainer.max_staleness).

    ahead = BatchesAhead(max_staleness=2)
    exp = ahead.pop()                                       # the step's batch, or None: generate it now
    for index in ahead.to_generate(step=k, total_steps=T):  # after scoring batch k, before update k
        ahead.push(generate(index, version=k))
    metrics = staleness_metrics(exp, step=k, generated=[...], ahead=len(ahead))  # async/staleness_max, ...

A policy version is the number of steps the actor has trained: the weights that train step k are version k,
and a sample generated while step k runs (before its update) carries version k. Batch j is generated while
step j - K runs at the earliest (`to_generate` never runs further ahead), so a batch trained at step j is at
most K versions old: the bound is kept by pacing admission, never by dropping samples. K = 0 generates
nothing ahead (synchronous, on-policy); K = 1 is one step off: batch k+1 generated while batch k is scored.
The first step generates its own batch (version 0) and then fills the queue, so steps 1..K train batches of
version 0 and the version gap reaches K from step K on.

The queue is part of a checkpoint (ppo.run.state.TrainState.save): the sampler's position counts the batches
drawn ahead, so restoring both trains every prompt once, none twice and none skipped.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from ppo.batch.experience import Experience, Sample


class BatchesAhead:
    """The FIFO of batches generated ahead (at most max_staleness of them), oldest first."""

    def __init__(self, *, max_staleness: int, batches: list[Experience] | None = None):
        if max_staleness < 0:
            raise ValueError(f"max_staleness({max_staleness}) must be >= 0")
        self.max_staleness = max_staleness
        # (a checkpoint resumed with a smaller K still trains every batch it holds: exactly once comes first)
        self.batches: deque[Experience] = deque(batches or ())

    def __len__(self) -> int:
        return len(self.batches)

    def pop(self) -> Experience | None:
        """The oldest batch generated ahead (the current step's), or None when the step generates its own."""
        return self.batches.popleft() if self.batches else None

    def push(self, exp: Experience) -> None:
        self.batches.append(exp)

    def to_generate(self, *, step: int, total_steps: int) -> list[int]:
        """The indices of the batches to generate now, while step `step` runs before its update: up to
        max_staleness ahead of the step, none past the run's last step."""
        first = step + 1 + len(self.batches)
        return list(range(first, min(step + self.max_staleness, total_steps - 1) + 1))

    def state_dict(self) -> list[list[dict]]:
        """Plain containers (checkpoints load with torch.load(weights_only=True))."""
        return [[dataclasses.asdict(s) for s in exp.samples] for exp in self.batches]

    @classmethod
    def from_state(cls, state: list[list[dict]] | None, *, max_staleness: int) -> BatchesAhead:
        return cls(max_staleness=max_staleness,
                   batches=[Experience([Sample(**s) for s in batch]) for batch in state or ()])


def staleness_metrics(exp: Experience, *, step: int, generated: list[Experience], ahead: int) -> dict[str, float]:
    """A step's row (0-based `step`): the version gap of the batch it trains (async/staleness_mean and _max over
    its samples), the response tokens generated during the step (all by version `step`: the weights change only
    between steps) and the batches left generated ahead."""
    gaps = [step - s.version for s in exp.samples]
    return {"async/staleness_mean": sum(gaps) / len(gaps), "async/staleness_max": float(max(gaps)),
            "async/generated_tokens": float(sum(len(s.response_ids) for e in generated for s in e.samples)),
            "async/batches_ahead": float(ahead)}
