"""BatchController on utilization traces (tests/ppo/traces/*.json) and OOM back-off with a fake OOM."""

import json
import logging
from pathlib import Path

import pytest
import torch

from ppo.control.controller import (
    BatchController,
    OOMBackoffExhausted,
    agree_feedback,
    is_cuda_oom,
    run_with_oom_backoff,
)
from tests.dist_utils import run_world

TRACES = Path(__file__).parents[1] / "traces"


def replay(name, ctl):
    steps = json.loads((TRACES / f"{name}.json").read_text())["steps"]
    return [ctl.decide(s["util_mean"], s["mem_frac"]) for s in steps]


def test_low_util_trace_grows_after_hysteresis(caplog):
    ctl = BatchController(rollout_tokens=10_000, micro_batch_tokens=2_000)
    with caplog.at_level(logging.DEBUG, logger="ppo.control.controller"):
        ds = replay("low_util_grow", ctl)
    assert len(caplog.records) == 10 and sum(r.levelno == logging.INFO for r in caplog.records) == 4
    assert [d.step for d in ds if d.action == "grow"] == [2, 4, 6, 8]  # every 2nd low step; none at util >= 0.6
    assert ds[0].action == "hold" and "for 1 step" in ds[0].reason
    assert ctl.rollout_tokens == int(int(int(int(10_000 * 1.2) * 1.2) * 1.2) * 1.2)
    assert ctl.micro_batch_tokens == int(int(int(int(2_000 * 1.2) * 1.2) * 1.2) * 1.2)
    assert len(ctl.history) == 10 and ctl.history[1]["action"] == "grow"


def test_memory_pressure_trace_shrinks_immediately_then_holds():
    ctl = BatchController(rollout_tokens=8192, micro_batch_tokens=4096, multiple_of=64)
    ds = replay("mem_pressure_shrink", ctl)
    assert [d.action for d in ds] == ["shrink", "shrink", "hold", "hold", "hold", "hold"]
    assert (ctl.rollout_tokens, ctl.micro_batch_tokens) == (2048, 1024)
    assert "high_mem" in ds[0].reason


def test_oscillating_trace_is_damped_by_hysteresis():
    ctl = BatchController(rollout_tokens=4096, micro_batch_tokens=1024)
    assert all(d.action == "hold" for d in replay("oscillating_hold", ctl))
    assert (ctl.rollout_tokens, ctl.micro_batch_tokens) == (4096, 1024)
    # the same trace without hysteresis would have grown 5 times: the test can fail
    eager = BatchController(rollout_tokens=4096, micro_batch_tokens=1024, hysteresis_steps=1)
    assert sum(d.action == "grow" for d in replay("oscillating_hold", eager)) == 5


def test_bounds_ceiling_and_headroom():
    ctl = BatchController(rollout_tokens=1000, micro_batch_tokens=100, max_rollout_tokens=1300,
                          max_micro_batch_tokens=150, hysteresis_steps=1)
    ctl.decide(0.1, 0.1)
    ctl.decide(0.1, 0.1)
    assert (ctl.rollout_tokens, ctl.micro_batch_tokens) == (1300, 144)  # rollout clamped to max
    assert ctl.decide(0.1, 0.75).action == "hold"  # 0.75 x 1.2 would pass high_mem 0.85
    assert "would pass high_mem" in ctl.history[-1]["reason"]
    assert ctl.decide(0.1, None).action == "hold"  # memory unknown: never grow blind
    assert ctl.decide(None, None).action == "hold"
    # after a shrink, growth stops one factor under the budget that hit the mark
    ctl.decide(0.9, 0.9)
    assert ctl.rollout_tokens == 650
    for _ in range(5):
        ctl.decide(0.1, 0.3)
    assert ctl.rollout_tokens == int(1300 / 1.2)
    with pytest.raises(ValueError, match="percent / 100"):
        ctl.decide(55.0, 0.5)


def test_min_bound_and_state_roundtrip():
    ctl = BatchController(rollout_tokens=1024, micro_batch_tokens=256, min_rollout_tokens=512,
                          min_micro_batch_tokens=200)
    for _ in range(3):
        ctl.decide(0.9, 0.95)
    assert (ctl.rollout_tokens, ctl.micro_batch_tokens) == (512, 200)
    assert ctl.history[-1]["action"] == "hold" and "min bounds" in ctl.history[-1]["reason"]
    assert ctl.decide(0.2, 0.3).action == ctl.decide(0.2, 0.3).action == "hold"  # 512 hit the mark: ceiling
    fresh = BatchController(rollout_tokens=1024, micro_batch_tokens=256)
    fresh.decide(0.2, 0.3)  # low streak 1 of 2: must survive the round trip
    other = BatchController(rollout_tokens=1, micro_batch_tokens=1, max_rollout_tokens=8192,
                            max_micro_batch_tokens=2048)
    other.load_state_dict(json.loads(json.dumps(fresh.state_dict())))  # JSON-safe: goes into checkpoints
    a, b = fresh.decide(0.2, 0.3), other.decide(0.2, 0.3)
    assert a == b and a.action == "grow" and a.rollout_tokens == 1228
    with pytest.raises(ValueError, match="min rollout_tokens"):
        BatchController(rollout_tokens=100, micro_batch_tokens=10, min_rollout_tokens=200, max_rollout_tokens=150)


class FakeOOM(RuntimeError):
    pass


def test_oom_backoff_halves_and_reruns_on_full_input():
    samples = list(range(37))
    seen = []

    def stage(budget):
        if budget > 100:
            raise FakeOOM("CUDA out of memory. Tried to allocate 2.00 GiB")
        # micro-batch the full input with this budget (tokens == samples here)
        out = [samples[i:i + budget] for i in range(0, len(samples), budget)]
        seen.append(budget)
        return sum(len(c) for c in out)

    calls = []
    ctl = BatchController(rollout_tokens=4096, micro_batch_tokens=512)
    result, final = run_with_oom_backoff(
        stage, budget=512, min_budget=16, is_oom=lambda e: isinstance(e, FakeOOM),
        on_oom=lambda old, new: (calls.append((old, new)), ctl.record_oom(failed=old, new=new)))
    assert (result, final) == (37, 64)  # no sample lost
    assert calls == [(512, 256), (256, 128), (128, 64)] and seen == [64]
    assert ctl.micro_batch_tokens == 64 and ctl.ceiling["micro_batch_tokens"] == 128
    assert [h["action"] for h in ctl.history] == ["oom"] * 3
    ctl.decide(0.5, 0.95)  # a later memory shrink keeps the lower OOM ceiling
    assert ctl.micro_batch_tokens == 32 and ctl.ceiling["micro_batch_tokens"] == 64


def test_oom_backoff_gives_up_with_clear_message():
    def stage(budget):
        raise FakeOOM("out of memory")

    with pytest.raises(OOMBackoffExhausted, match=r"gen ran out of memory at budgets 64 -> 32 -> 16 tokens") as ei:
        run_with_oom_backoff(stage, budget=64, min_budget=16, max_retries=5, name="gen",
                             is_oom=lambda e: isinstance(e, FakeOOM))
    assert isinstance(ei.value.__cause__, FakeOOM)
    with pytest.raises(OOMBackoffExhausted, match="max_retries 1"):
        run_with_oom_backoff(stage, budget=64, min_budget=1, max_retries=1, is_oom=lambda e: isinstance(e, FakeOOM))


def test_non_oom_errors_pass_through_and_default_predicate():
    def stage(budget):
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        run_with_oom_backoff(stage, budget=8, min_budget=1)
    assert is_cuda_oom(torch.cuda.OutOfMemoryError("x")) and not is_cuda_oom(RuntimeError("x"))

    def real_type_oom(budget):
        if budget > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return budget

    assert run_with_oom_backoff(real_type_oom, budget=16, min_budget=1) == (4, 4)


def _agree_body(rank, world_size):
    readings = [(0.4, 0.5), (None, 0.8), (0.6, None)]
    util, mem = agree_feedback(*readings[rank])
    nothing = agree_feedback(None, None)
    ctl = BatchController(rollout_tokens=1000, micro_batch_tokens=100, hysteresis_steps=1)
    return util, mem, nothing, ctl.decide(util, mem).action


@pytest.mark.distributed
def test_agree_feedback_gives_every_rank_the_same_inputs():
    out = run_world(_agree_body, 3)
    assert all(o == out[0] for o in out)
    util, mem, nothing, action = out[0]
    assert util == pytest.approx(0.5) and mem == pytest.approx(0.8) and nothing == (None, None)
    assert action == "hold"  # 0.8 x 1.2 would pass high_mem on the fullest GPU
    assert agree_feedback(0.3, 0.2) == (0.3, 0.2)  # no process group: identity


@pytest.mark.gpu
def test_real_cuda_oom_backoff_on_gpu():
    total = torch.cuda.get_device_properties(0).total_memory
    before = torch.cuda.memory_allocated(0)

    def stage(budget_gib):  # asks for budget_gib GiB; the first tries exceed any GPU
        x = torch.empty(budget_gib * 2**30, dtype=torch.uint8, device="cuda")
        x[-1] = 1  # touch it so the allocation is real
        return int(x.numel())

    n, final = run_with_oom_backoff(stage, budget=4096, min_budget=1, max_retries=8, name="oom_probe")
    # halved until it fit: fits, and within 4x of the device (one halving of slack for the CUDA context)
    assert final * 2**30 <= total < 4 * final * 2**30
    assert n == final * 2**30
    torch.cuda.empty_cache()
    # nothing leaked across the failed attempts (earlier tests' caches may be freed meanwhile: <=, not ==)
    assert torch.cuda.memory_allocated(0) <= before
