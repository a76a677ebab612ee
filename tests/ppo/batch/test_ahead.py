"""ppo/batch/ahead.py without a model: the schedule of batches generated ahead keeps the version gap within K,
generates every batch of the run once and in order, and survives a checkpoint's plain containers."""

from __future__ import annotations

import pytest
import torch

from ppo.batch.ahead import BatchesAhead, staleness_metrics
from ppo.batch.experience import Experience, Sample


def _batch(index: int, version: int) -> Experience:
    return Experience([Sample(uid=u, prompt_index=u, prompt_ids=[index, u], response_ids=[1] * (u + 1),
                              behaviour_logprobs=[-0.5] * (u + 1), finish_reason="stop", version=version)
                       for u in range(2)])


def _simulate(k: int, total: int, *, restart_after: tuple[int, ...] = ()) -> list[tuple[int, int, int]]:
    """The trainer's use of the queue over `total` steps -> [(step, batch index, version of its samples)];
    restart_after: steps after which the queue goes through state_dict / from_state (a resume)."""
    ahead, trained = BatchesAhead(max_staleness=k), []
    for step in range(total):
        exp = ahead.pop() or _batch(step, step)  # the first step (or K = 0) generates its own batch now
        for index in ahead.to_generate(step=step, total_steps=total):
            ahead.push(_batch(index, step))
        trained.append((step, exp.samples[0].prompt_ids[0], exp.samples[0].version))
        if step in restart_after:
            state = ahead.state_dict()
            torch.save(state, "/dev/null")  # plain containers only (weights_only loads)
            ahead = BatchesAhead.from_state(state, max_staleness=k)
    return trained


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_the_version_gap_stays_within_k_and_every_batch_is_trained_once(k):
    trained = _simulate(k, 9)
    assert [b for _, b, _ in trained] == list(range(9))  # each batch once, in the sampler's order
    gaps = [s - v for s, _, v in trained]
    assert max(gaps) <= k
    # pacing, not dropping: the gap climbs to K and sits there (steps 1..K train batches of version 0)
    assert gaps == [min(s, k) for s in range(9)]
    assert _simulate(k, 9, restart_after=(1, 2, 5)) == trained  # three restarts in a row change nothing


def test_nothing_is_generated_past_the_last_step():
    ahead = BatchesAhead(max_staleness=3)
    assert ahead.to_generate(step=0, total_steps=3) == [1, 2]
    assert BatchesAhead(max_staleness=0).to_generate(step=0, total_steps=9) == []
    with pytest.raises(ValueError, match="max_staleness"):
        BatchesAhead(max_staleness=-1)


def test_staleness_metrics():
    exp = Experience(_batch(5, 3).samples + [Sample(uid=9, prompt_index=9, prompt_ids=[5], response_ids=[1],
                                                    behaviour_logprobs=[0.0], finish_reason="stop", version=5)])
    m = staleness_metrics(exp, step=5, generated=[_batch(6, 5), _batch(7, 5)], ahead=2)
    assert m == {"async/staleness_mean": 4 / 3, "async/staleness_max": 2.0, "async/generated_tokens": 6.0,
                 "async/batches_ahead": 2.0}
