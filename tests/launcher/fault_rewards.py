"""Reward functions that inject one fault into an end-to-end run (tests only).

The fault fires once, in the reward stage (mid-step), on one rank, as soon as a file exists
(e.g. the run's checkpoint `step_2`) with at least FAULT_AFTER_LINES lines, so a test can place
it after a checkpoint or a metrics row without racing:

    FAULT=SIGKILL FAULT_RANK=1 FAULT_AFTER=<run>/metrics.jsonl FAULT_AFTER_LINES=3 FAULT_MARKER=<tmp>/fired
    reward.function=tests/launcher/fault_rewards.py:task_reward_with_fault

Scores are the synthetic task's own (`builtin:task:add:1`), so a faulted run can be compared
with an uninterrupted one.
"""

from __future__ import annotations

import os
import signal
import time

from ppo.data.tasks import task_reward_fn

_task = task_reward_fn("add:1")


def _fire() -> None:
    env = os.environ
    fault, marker = env.get("FAULT"), env.get("FAULT_MARKER")
    if not fault or env.get("RANK") != env.get("FAULT_RANK", "1") or not marker or os.path.exists(marker):
        return
    after = env.get("FAULT_AFTER", "")
    if not os.path.exists(after):
        return
    lines = int(env.get("FAULT_AFTER_LINES", "0"))
    if lines and (os.path.isdir(after) or len(open(after).read().splitlines()) < lines):
        return
    open(marker, "w").close()
    # a user reward function runs in the rank's reward worker process (ppo/data/reward_worker.py): the fault is
    # the rank's, so it goes to the worker's parent
    rank_pid = os.getppid() if os.environ.get("HYBRIDRL_REWARD_WORKER") else os.getpid()
    if fault == "SIGTERM_AGENT":  # what Slurm / Ctrl-C does to torchrun: the agent forwards it to the workers
        os.kill(_parent_of(rank_pid), signal.SIGTERM)
        time.sleep(0.5)  # let the signal arrive while this stage is still running
    else:
        os.kill(rank_pid, getattr(signal, fault))


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def task_reward_with_fault(response, ground_truth, **extra):
    _fire()
    return _task(response, ground_truth)


def always_raises(response, ground_truth, **extra):
    raise ValueError(f"cannot parse {response!r}")


def hangs_on_even_samples(response, ground_truth, sample_id=0):
    if sample_id % 2 == 0:
        time.sleep(3600)
    return _task(response, ground_truth)


def length_parity(response, ground_truth, **extra):
    """A score with signal from the first step (the untrained tiny model rarely answers right)."""
    return float(len(response) % 2)


def exits(response, ground_truth, **extra):
    """sys.exit in a reward function: a failed sample, never the end of the rank."""
    raise SystemExit(3)


def exits_on_odd_samples(response, ground_truth, sample_id=0):
    """os._exit(0) on every fourth sample, sys.exit(3) on the other odd ones; the task's score elsewhere."""
    if sample_id % 4 == 1:
        os._exit(0)
    if sample_id % 2 == 1:
        raise SystemExit(3)
    return _task(response, ground_truth)
