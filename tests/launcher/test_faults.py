"""Faults an operator meets on a cluster, tried end to end through `torchrun launcher/main.py` on
gloo: kill -9 of a rank under --max-restarts, SIGTERM (preemption), SIGSTOP (a stalled rank),
reward functions that raise or hang, a second launch into a live run. The fault is injected by
tests/launcher/fault_rewards.py in the reward stage, i.e. mid-step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.dist_utils import repo_pythonpath

ROOT = Path(__file__).resolve().parents[2]
FAULTS = str(ROOT / "tests" / "launcher" / "fault_rewards.py")
TINY = ["trainer.progress_bar=false", "trainer.tensorboard=false", "monitor.enabled=false", "data.batch_size=2",
        "rollout.max_response_length=4", "data.task_size=64", "trainer.sft_warmup_steps=0",
        "trainer.save_every_minutes=0"]



def launch(tmp_path: Path, name: str, *overrides: str, nproc: int = 2, restarts: int = 0, fault: dict | None = None,
           timeout: int = 240):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo_pythonpath(), **(fault or {}))
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               f"--max-restarts={restarts}", "--monitor-interval=0.5"]
    else:  # a world of one without torchrun (exit codes come straight from main)
        cmd = [sys.executable]
    cmd += [str(ROOT / "launcher" / "main.py"), str(ROOT / "conf" / "grpo_tiny.yaml"), f"trainer.runs_dir={tmp_path}",
            f"trainer.experiment_name={name}", *TINY, *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _fault(tmp_path, kind, after, lines=0, rank=1):
    return {"FAULT": kind, "FAULT_RANK": str(rank), "FAULT_AFTER": str(after), "FAULT_AFTER_LINES": str(lines),
            "FAULT_MARKER": str(tmp_path / f"fired-{kind}")}


def _ok(res):
    assert res.returncode == 0, f"exit {res.returncode}\nSTDERR\n{res.stderr[-5000:]}"


def _same_run(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        for k in x:  # all but wall times, memory and the garbage collector's pauses
            if not k.startswith(("timing_s/", "perf/", "mem/", "host/")) and not k.endswith("_s"):
                assert x[k] == y[k], (x["step"], k, x[k], y[k])


@pytest.mark.distributed
@pytest.mark.slow(seconds=60)
def test_kill9_of_a_rank_restarts_and_equals_an_uninterrupted_run(tmp_path):
    """Over-provisioned partial rollouts on two generation replicas (rollout.batches_in_flight=2,
    trainer.max_staleness=1): each rank's checkpoint of step 2 holds its replica's groups in flight, the shared
    state the sampler past them; the restart trains each prompt once (the rows and the weights equal). The
    batches generated ahead (max_staleness without batches_in_flight) restart alike: tests/ppo/test_staleness.py."""
    # no trainer.resume=auto: the restarted attempt continues its own run by itself (a fresh launch would not)
    common = ["trainer.total_steps=4", "trainer.save_every=2", "trainer.max_staleness=1",
              "rollout.batches_in_flight=2", "rollout.max_response_length=8",
              f"reward.function={FAULTS}:task_reward_with_fault"]
    _ok(launch(tmp_path, "straight", *common))
    # rank 1 is killed in step 4's reward stage, after step 3's metrics row: the restart resumes from step_2,
    # re-runs step 3 (its first row is superseded, not duplicated) and step 4
    run = tmp_path / "killed"
    res = launch(tmp_path, "killed", *common, restarts=1, fault=_fault(tmp_path, "SIGKILL", run / "metrics.jsonl", 3))
    _ok(res)
    assert (tmp_path / "fired-SIGKILL").exists() and "exitcode: -9" in res.stderr
    assert "resumed from" in (run / "logs" / "rank_0.log").read_text()
    _same_run(rows(tmp_path / "straight"), rows(run))
    assert all(r["async/staleness_max"] <= 1 for r in rows(run))
    assert [r["step"] for r in map(json.loads, (run / "metrics.superseded.jsonl").read_text().splitlines())] == [3]
    # the prompt ledger: the dead attempt's draws after step_2 superseded, every draw once, the straight run's
    ledger = lambda d: [json.loads(x) for x in (d / "prompts.jsonl").read_text().splitlines()]  # noqa: E731
    assert ledger(run) == ledger(tmp_path / "straight")
    drawn = [(r["epoch"], row) for r in ledger(run) for row in r["rows"]]
    assert len(drawn) == len(set(drawn)) and [r["step"] for r in ledger(run)] == [1, 1, 2, 3, 4]  # 2 in flight
    a = load_file(tmp_path / "straight" / "checkpoints" / "step_4" / "actor" / "model.safetensors")
    b = load_file(run / "checkpoints" / "step_4" / "actor" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.mark.distributed
@pytest.mark.slow(seconds=65)
def test_sigterm_checkpoints_the_current_step_and_a_relaunch_continues(tmp_path):
    run = tmp_path / "pre"
    common = ["trainer.save_every=0", "trainer.resume=auto", f"reward.function={FAULTS}:task_reward_with_fault"]
    # the agent gets SIGTERM (Slurm, Ctrl-C) during step 2's reward stage and forwards it to the workers
    res = launch(tmp_path, "pre", "trainer.total_steps=6", *common,
                 fault=_fault(tmp_path, "SIGTERM_AGENT", run / "metrics.jsonl", 1))
    assert res.returncode != 0 and "stopped early (SIGTERM) with a checkpoint; exit 75" in res.stderr
    assert [r["step"] for r in rows(run)] == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2"]  # no periodic save: the stop's
    _ok(launch(tmp_path, "pre", "trainer.total_steps=3", *common))
    assert "resumed from" in (run / "logs" / "rank_0.log").read_text()
    assert [r["step"] for r in rows(run)] == [1, 2, 3]
    # the same run resumed by one process instead of two: resharded onto the new layout (ppo/run/relayout.py)
    _ok(launch(tmp_path, "pre", "trainer.total_steps=4", *common, nproc=0))
    assert ("resuming step 3 written at tp=1 pp=1 dp=2 (2 ranks) onto tp=1 pp=1 dp=1 (1 ranks)"
            in (run / "logs" / "rank_0.log").read_text())
    assert [r["step"] for r in rows(run)] == [1, 2, 3, 4]
    draws = [json.loads(x) for x in (run / "prompts.jsonl").read_text().splitlines()]
    drawn = [(r["epoch"], row) for r in draws for row in r["rows"]]
    assert len(drawn) == len(set(drawn)) and [r["step"] for r in draws] == [1, 2, 3, 4]  # no prompt twice


@pytest.mark.distributed
def test_sigstop_of_a_rank_makes_every_rank_exit_naming_it(tmp_path):
    run = tmp_path / "stall"
    t0 = time.monotonic()
    res = launch(tmp_path, "stall", "trainer.total_steps=50", "trainer.watchdog_timeout_s=3",
                 f"reward.function={FAULTS}:task_reward_with_fault",
                 fault=_fault(tmp_path, "SIGSTOP", run / "metrics.jsonl", 1))
    fired = (tmp_path / "fired-SIGSTOP").stat().st_mtime
    assert res.returncode != 0
    assert time.time() - fired < 3 + 10, "every rank (the stopped one too) exits soon after the timeout"
    assert "watchdog: rank(s) 1 stopped answering" in res.stderr and "stage 'reward' of step 2" in res.stderr
    assert "exitcode: 76" in res.stderr and time.monotonic() - t0 < 200


def test_reward_raising_on_every_sample_stops_with_a_clear_error(tmp_path):
    res = launch(tmp_path, "raises", "trainer.total_steps=3", f"reward.function={FAULTS}:always_raises", nproc=0)
    assert res.returncode == 2
    assert "step 1: the reward function" in res.stderr and "failed on 8 of 8 samples" in res.stderr
    assert "ValueError: cannot parse" in res.stderr and "Traceback" not in res.stderr
    assert "failed on 8 of 8 samples" in (tmp_path / "raises" / "logs" / "rank_0.log").read_text()  # the stop reason


def test_reward_calling_os_exit_or_sys_exit_is_a_counted_failure(tmp_path):
    """os._exit(0) / sys.exit(3) in the reward function ended the job silently with exit 0 (or killed the workers
    with no message): now each call is a failed sample, named, and the run trains on."""
    res = launch(tmp_path, "exits", "trainer.total_steps=2", f"reward.function={FAULTS}:exits_on_odd_samples", nproc=0)
    _ok(res)
    assert [(r["step"], r["reward/failed"]) for r in rows(tmp_path / "exits")] == [(1, 4), (2, 4)]
    log = (tmp_path / "exits" / "logs" / "rank_0.log").read_text()
    assert "WorkerDied: the reward function ended its worker process (exit code 0" in log
    assert "SystemExit: 3" in log and "exits_on_odd_samples failed" in log


def test_hanging_reward_is_timed_out_and_counted_and_timed_checkpoints(tmp_path):
    # (and a time-based checkpoint interval shorter than a step saves after every step)
    res = launch(tmp_path, "hangs", "trainer.total_steps=2", "reward.timeout_s=0.2", "trainer.save_every_minutes=1e-6",
                 "trainer.save_final=false", f"reward.function={FAULTS}:hangs_on_even_samples", nproc=0)
    _ok(res)
    assert sorted(p.name for p in (tmp_path / "hangs" / "checkpoints").iterdir()) == ["step_1", "step_2"]
    for r in rows(tmp_path / "hangs"):
        assert r["reward/failed"] == 4 and r["reward/failed_frac"] == 0.5
    log = (tmp_path / "hangs" / "logs" / "rank_0.log").read_text()
    assert log.count("RewardTimeout: reward function ran longer than reward.timeout_s=0.2 s") == 1


def test_second_launch_into_a_live_run_refuses(tmp_path):
    from launcher.runlock import RunLock

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                               "from launcher.runlock import RunLock; RunLock(sys.argv[2]).acquire(); "
                               "print('held', flush=True); time.sleep(60)", str(ROOT), str(tmp_path / "live")],
                              stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, SLURM_JOB_ID="", TORCHELASTIC_RUN_ID=""))
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / "live" / "metrics.jsonl").write_text('{"step": 1}\n')
        # overwrite=true would rename a finished run aside; a live one it refuses (resume=auto: test_runlock.py)
        res = launch(tmp_path, "live", "trainer.overwrite=true", nproc=0)
        assert res.returncode == 2 and "is in use by a live run" in res.stderr, res.stderr[-2000:]
        assert (tmp_path / "live" / "metrics.jsonl").read_text() == '{"step": 1}\n'
        assert not list(tmp_path.glob("live.old-*"))
    finally:
        holder.kill()
        holder.wait()
    assert RunLock(tmp_path / "live").holder() is not None  # the dead holder's lock stays until a launch takes it
