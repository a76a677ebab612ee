"""rollout/beside.py on the native engine (fp32, CPU): the groups in flight keep decoding on their own thread while
the caller computes, every token sampled meanwhile carries the version the engine holds (the trainer's log-prob of
that version to 1e-5), and an error on the thread reaches the caller."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from rollout import NativeEngine
from rollout.beside import DecodeBeside
from rollout.partial import PartialRollouts
from tests.rollout.test_engine import PROMPTS, config
from tests.rollout.test_partial import _check_against_trainer, _params, _versions


def _in_flight(models, caps=(3, 40, 5, 40)):
    engine = NativeEngine.from_model(copy.deepcopy(models[0]), config=config(max_num_seqs=8))
    rollouts = PartialRollouts(engine, version=0)
    for i, cap in enumerate(caps):
        rollouts.add_group(PROMPTS[i], _params(20 + i, max_tokens=cap))
    return engine, rollouts


def _busy_until(done, timeout_s: float = 60.0) -> int:
    """Matmuls on this thread (the trainer's stand-in) until done(); -> how many ran."""
    a, n, t0 = torch.randn(256, 256), 0, time.perf_counter()
    while not done():
        a = torch.tanh(a @ a.T / 16)
        n += 1
        assert time.perf_counter() - t0 < timeout_s, "the decoding beside made no progress"
    return n


def test_groups_in_flight_decode_while_the_caller_computes_and_keep_their_version():
    models = _versions()
    _, alone = _in_flight(models)  # the control: suspended right after the step's generation
    alone.run_until(groups=2)
    alone.suspend()
    engine, rollouts = _in_flight(models)
    first = rollouts.run_until(groups=2)
    assert [g[0].group for g in first] == [0, 2] and rollouts.in_flight() == 2
    beside = DecodeBeside(rollouts)
    assert engine.runner.may_capture is False  # no CUDA graph is captured beside training
    ran = _busy_until(lambda: beside.steps >= 5)
    report = beside.stop()
    assert ran > 0 and engine.runner.may_capture is True
    assert report["async/beside_steps"] >= 5 and report["async/beside_tokens"] >= 5 * 4  # 2 groups x 2 samples
    rollouts.suspend()

    def held(r):
        return sum(len(t.token_ids) for g in r.groups.values() for t in g.samples)

    assert report["async/beside_tokens"] == held(rollouts) - held(alone) > 0
    # the update between two steps: the samples continue under version 1, their KV recomputed
    rollouts.swap_weights(models[1].state_dict().items(), version=1)
    rest = rollouts.run_until(groups=2)
    assert sorted(g[0].group for g in rest) == [1, 3]
    for group in first + rest:
        for t in group:
            _check_against_trainer(t, models)
    assert all(set(t.versions) == {0, 1} for g in rest for t in g)


def test_it_stops_by_itself_when_nothing_is_left_and_hands_the_engine_back():
    models = _versions()
    engine, rollouts = _in_flight(models, caps=(3, 6))
    rollouts.run_until(groups=1)
    beside = DecodeBeside(rollouts)
    beside._thread.join(timeout=60)
    assert not beside._thread.is_alive() and not engine.has_unfinished()
    report = beside.stop()
    assert report["async/beside_tokens"] > 0
    assert [g[0].group for g in rollouts.run_until(groups=1)] == [1]  # complete and held: handed over first


def test_nothing_waiting_is_admitted_beside_and_the_thread_ends_with_the_running_rows():
    """Four groups of two samples through four slots: group 0 ends, the slots it frees take group 2 before the thread
    starts (admit_waiting), group 3 stays waiting while decoding runs beside (no prefill), the thread ends once the
    running rows are done, and afterwards it is admitted."""
    models = _versions()
    engine = NativeEngine.from_model(copy.deepcopy(models[0]), config=config(max_num_seqs=4))
    rollouts = PartialRollouts(engine, version=0)
    for i, cap in enumerate((3, 12, 12, 12)):
        rollouts.add_group(PROMPTS[i], _params(30 + i, max_tokens=cap))
    rollouts.run_until(groups=1)  # group 0 done, group 1 running, groups 2 and 3 waiting for slots
    assert engine.num_waiting() == 4
    beside = DecodeBeside(rollouts)
    prefills = engine.stats["prefill_steps"]
    assert engine.num_waiting() == 2  # group 2 went in first
    beside._thread.join(timeout=60)
    assert not beside._thread.is_alive() and engine.stats["prefill_steps"] == prefills
    assert engine.has_unfinished() and not engine.is_decoding()  # the waiting samples, untouched
    beside.stop()
    done = rollouts.run_until(groups=3)  # admitted now
    assert sorted(g[0].group for g in done) == [1, 2, 3] and engine.stats["prefill_steps"] > prefills
    for group in done:
        for t in group:
            _check_against_trainer(t, models)


def test_an_error_on_the_thread_is_raised_by_stop():
    models = _versions()
    engine, rollouts = _in_flight(models)
    rollouts.run_until(groups=2)

    def broken():
        raise ValueError("decode step failed")

    engine.step = broken
    beside = DecodeBeside(rollouts)
    with pytest.raises(RuntimeError, match="decoding beside the update failed: ValueError: decode step failed"):
        beside.stop()
    assert engine.runner.may_capture is True


def test_samples_waiting_for_a_slot_are_admitted_before_the_thread_starts():
    """A step whose quota is met by groups completed earlier hands them over at once, leaving its new groups waiting
    (nothing ran): they are prefilled before decoding starts beside, so the update's time is not lost to them."""
    models = _versions()
    engine, rollouts = _in_flight(models, caps=(3, 3, 3))
    assert [g[0].group for g in rollouts.run_until(groups=1)] == [0]  # 1 and 2 complete too, held
    for i, cap in ((3, 12), (4, 12)):
        rollouts.add_group(PROMPTS[i], _params(20 + i, max_tokens=cap))
    prefills = engine.stats["prefill_steps"]
    assert [g[0].group for g in rollouts.run_until(groups=2)] == [1, 2]  # met at once: 3 and 4 wait
    assert engine.stats["prefill_steps"] == prefills and not engine.is_decoding()
    beside = DecodeBeside(rollouts)
    assert engine.stats["prefill_steps"] > prefills and engine.num_waiting() == 0
    beside._thread.join(timeout=60)
    report = beside.stop()
    assert report["async/beside_tokens"] > 0 and not engine.has_unfinished()
    done = rollouts.run_until(groups=2)
    assert sorted(g[0].group for g in done) == [3, 4]
    for group in done:
        for t in group:
            _check_against_trainer(t, models)
