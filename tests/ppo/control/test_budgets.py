"""ppo/control/budgets.py: the token budgets' one owner, driven by a fake monitor (utilization as the NVML
monitor reports it, a fraction in [0, 1]) and by a fake CUDA OOM; and a decision reaching a real step's budgets."""

from __future__ import annotations

import json

import pytest
import torch

from ppo.control.budgets import MIN_BUDGET, TokenBudgets
from ppo.control.controller import ACTIONS, CAUSES, BatchController
from tests.ppo.world import tiny_run, world_of_one


class FakeMonitor:
    """GpuMonitor.step_summary's shape: gpu/util_mean is a fraction (0.9 = 90% busy)."""

    def __init__(self, util: float):
        self.util = util

    def step_summary(self) -> dict[str, float]:
        return {"gpu/util_mean": self.util}

    def set_stage(self, name: str) -> None:
        pass


def budgets(**ctl) -> tuple[TokenBudgets, list[int]]:
    rollout = []
    c = BatchController(rollout_tokens=8192, micro_batch_tokens=4096, hysteresis_steps=1, **ctl)
    return TokenBudgets({"actor": 4096, "ref": 8192}, controller=c, set_rollout_tokens=rollout.append), rollout


def drive(b: TokenBudgets, monitor: FakeMonitor, *, mem: float, steps: int = 3) -> list[dict[str, float]]:
    return [b.control(util_mean=monitor.step_summary()["gpu/util_mean"], mem_frac=mem) for _ in range(steps)]


def test_30_percent_utilization_grows_every_role_in_proportion():
    b, rollout = budgets()
    m = drive(b, FakeMonitor(0.30), mem=0.40, steps=1)[0]
    assert m["controller/action"] == ACTIONS["grow"] and CAUSES[int(m["controller/cause"])] == "grow"
    assert b["actor"] == int(4096 * 1.2) and b["ref"] == int(8192 * 1.2)
    assert rollout == [int(8192 * 1.2)] and m["controller/util_mean"] == 0.30


@pytest.mark.parametrize("util", [0.90, 0.99])
def test_busy_gpus_hold(util):
    """The bug this guards: a monitor fraction divided by 100 again read 90% as 0.9% and grew budgets."""
    b, rollout = budgets()
    for m in drive(b, FakeMonitor(util), mem=0.40):
        assert m["controller/action"] == ACTIONS["hold"] and CAUSES[int(m["controller/cause"])] == "util_ok"
    assert (b["actor"], b["ref"]) == (4096, 8192) and rollout == [8192] * 3


def test_near_the_memory_limit_shrinks_and_never_grows_past_it():
    b, _ = budgets(high_mem=0.85)
    m = b.control(util_mean=0.30, mem_frac=0.90)
    assert m["controller/action"] == ACTIONS["shrink"] and CAUSES[int(m["controller/cause"])] == "mem_high"
    assert (b["actor"], b["ref"]) == (2048, 4096)
    m = b.control(util_mean=0.30, mem_frac=0.80)  # 0.80 x 1.2 would pass 0.85: hold
    assert CAUSES[int(m["controller/cause"])] == "would_pass_high_mem" and b["actor"] == 2048


def test_oom_halves_the_roles_budget_and_the_controller_adopts_it():
    b, _ = budgets()
    seen = []

    def stage(budget: int) -> str:
        seen.append(budget)
        if budget > 1024:
            raise torch.cuda.OutOfMemoryError("fake")
        return "done"

    assert b.run("update_actor", "actor", stage) == "done"
    assert seen == [4096, 2048, 1024] and b["actor"] == 1024 and b.controller.micro_batch_tokens == 1024
    assert b["ref"] == 8192  # another role keeps its budget
    with pytest.raises(torch.cuda.OutOfMemoryError):  # an update past its first optimizer step is not rerun
        b.run("update_actor", "actor", lambda _: stage(4096), retry_safe=lambda: False)


def test_no_controller_no_metrics():
    b = TokenBudgets({"actor": 300})
    assert b.control(util_mean=0.1, mem_frac=0.1) == {} and b["actor"] == 300 and MIN_BUDGET == 256


@pytest.mark.distributed
@pytest.mark.parametrize("util,action,grow", [(0.30, "grow", 1.2), (0.90, "hold", 1.0)])
def test_a_decision_reaches_the_steps_budgets(tmp_path, util, action, grow):
    """End to end on CPU: the trainer's step-boundary control with a monitor reporting 30% utilization
    grows the micro-batch budget the next step's stages run with (90% holds it), and the decision is in
    metrics.jsonl."""
    with world_of_one():
        run = tiny_run(tmp_path, "controller.enabled=true", "controller.hysteresis_steps=1",
                       "trainer.total_steps=2")
        t = run.trainer(tmp_path)
        t.monitor = FakeMonitor(util)
        before = t.budgets["actor"]
        seen = []
        update = t.roles.update_actor
        t.roles.update_actor = lambda *a, max_tokens, **k: seen.append(max_tokens) or update(*a, max_tokens=max_tokens,
                                                                                              **k)
        # memory is unknown on CPU: the controller refuses to grow blind, so report it as a CUDA rank would
        t.memory_fraction = lambda: 0.40
        t.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["controller/action"] == ACTIONS[action] and rows[0]["controller/util_mean"] == pytest.approx(util)
    assert seen == [before, int(before * grow)]

