"""One live run per directory: a second launch and overwrite=true refuse a live run; stale locks
(dead holder, an earlier attempt of the same job, not refreshed) are taken over; a start-up that
failed before its first step does not block the next launch."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from launcher.errors import UserError
from launcher.rundir import prepare_run_dir
from launcher.runlock import RunLock, RunLocked


@pytest.fixture
def other_process():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p.pid
    p.kill()
    p.wait()


def _hold(run_dir, pid, job=None):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "LOCK").write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "job": job,
                                              "started": time.time()}))


@pytest.mark.parametrize("overwrite", [False, True])
def test_live_run_is_refused_even_with_overwrite(tmp_path, other_process, monkeypatch, overwrite):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    run = tmp_path / "exp"
    _hold(run, other_process)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunLocked, match=f"in use by a live run .*pid {other_process}"):
        prepare_run_dir(str(tmp_path), "exp", resume="auto" if not overwrite else "never", overwrite=overwrite)
    assert (run / "metrics.jsonl").exists() and not list(tmp_path.glob("exp.old-*"))  # untouched


def test_second_acquire_refuses_and_release_frees(tmp_path):
    run, lock = prepare_run_dir(str(tmp_path), "exp", resume="never", overwrite=False)
    with pytest.raises(RunLocked):
        RunLock(run).acquire()
    lock.release()
    assert not (run / "LOCK").exists()
    RunLock(run).acquire().release()


def test_stale_locks_are_taken_over(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    _hold(tmp_path / "a", int(dead))  # holder gone
    RunLock(tmp_path / "a").acquire().release()
    _hold(tmp_path / "b", os.getppid(), job="job-a")  # an earlier attempt of this job (torchrun restart)
    RunLock(tmp_path / "b").acquire().release()
    _hold(tmp_path / "c", os.getppid(), job="job-other")
    (tmp_path / "c" / "LOCK").touch()
    os.utime(tmp_path / "c" / "LOCK", (time.time() - 3600, time.time() - 3600))  # not refreshed for an hour
    RunLock(tmp_path / "c", stale_after_s=600).acquire().release()
    _hold(tmp_path / "d", os.getppid(), job="job-other")  # live and fresh
    with pytest.raises(RunLocked):
        RunLock(tmp_path / "d").acquire()


def test_failed_start_does_not_block(tmp_path):
    run, lock = prepare_run_dir(str(tmp_path), "exp", resume="never", overwrite=False)
    (run / "config.yaml").write_text("x: 1\n")  # written before the failure; no step ran
    lock.release()
    run2, lock2 = prepare_run_dir(str(tmp_path), "exp", resume="never", overwrite=False)
    assert run2 == run
    (run / "checkpoints" / "step_1").mkdir()
    lock2.release()
    with pytest.raises(UserError, match="already holds a run"):
        prepare_run_dir(str(tmp_path), "exp", resume="never", overwrite=False)


def test_failed_start_with_a_step0_validation_row_does_not_block(tmp_path):
    run, lock = prepare_run_dir(str(tmp_path), "exp", resume="never", overwrite=False)
    (run / "metrics.jsonl").write_text('{"step": 0, "val/reward/mean": 0.0, "val/reward/failed": 8}\n')
    lock.release()  # the start failed after validation, before step 1
    run2, lock2 = prepare_run_dir(str(tmp_path), "exp", resume="never", overwrite=False)
    assert not (run / "metrics.jsonl").exists()  # the relaunch writes its own step-0 row: never two
    assert '"step": 0' in (run / "metrics.superseded.jsonl").read_text()
    lock2.release()


def _attempt(monkeypatch, *, run_id=None, restarts=None, slurm=None, slurm_restarts=None):
    for var, value in (("TORCHELASTIC_RUN_ID", run_id), ("TORCHELASTIC_RESTART_COUNT", restarts),
                       ("SLURM_JOB_ID", slurm), ("SLURM_RESTART_COUNT", slurm_restarts)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, str(value))


def _first_attempt_trained(tmp_path):
    run, lock = prepare_run_dir(str(tmp_path), "exp", resume="never", overwrite=False)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "checkpoints" / "step_1").mkdir()
    lock.release()
    return run


@pytest.mark.parametrize("launcher", ["torchrun-standalone", "torchrun-plain", "slurm-requeue"])
def test_a_restarted_attempt_continues_its_run_and_a_fresh_launch_refuses(tmp_path, monkeypatch, launcher):
    from launcher.rundir import resume_of_attempt

    first = {"torchrun-standalone": dict(run_id="uuid-1", restarts=0),
             "torchrun-plain": dict(run_id="none", restarts=0),
             "slurm-requeue": dict(slurm="77", slurm_restarts=0)}[launcher]
    again = {**first, **({"slurm_restarts": 1} if "slurm" in first else {"restarts": 1})}
    _attempt(monkeypatch, **first)
    _first_attempt_trained(tmp_path)
    assert resume_of_attempt(str(tmp_path), "exp", resume="never") == "never"  # restart count 0: a fresh launch
    _attempt(monkeypatch, **again)
    assert resume_of_attempt(str(tmp_path), "exp", resume="never") == "auto"
    assert resume_of_attempt(str(tmp_path), "exp", resume="/some/step_1") == "auto"  # never back to an old one
    run, lock = prepare_run_dir(str(tmp_path), "exp", resume="auto", overwrite=False)
    lock.release()
    assert [json.loads(x)["restart"] for x in (run / "attempts.jsonl").read_text().splitlines()] == [0, 1]
    # a restarted attempt of another job (another uuid, another agent, another Slurm job) does not continue it
    other = {"torchrun-standalone": dict(run_id="uuid-2", restarts=1),
             "torchrun-plain": dict(run_id="none", restarts=1), "slurm-requeue": dict(slurm="78", slurm_restarts=1)}
    _attempt(monkeypatch, **other[launcher])
    if launcher == "torchrun-plain":  # the same agent pid would be the same job: fake another agent
        monkeypatch.setattr(os, "getppid", lambda: 1)
    assert resume_of_attempt(str(tmp_path), "exp", resume="never") == "never"
    with pytest.raises(UserError, match="already holds a run"):
        prepare_run_dir(str(tmp_path), "exp", resume="never", overwrite=False)


def test_plain_torchrun_run_id_none_is_not_a_shared_job(tmp_path, monkeypatch, other_process):
    """torchrun without --rdzv-id gives every launch the run id "none": a second plain launch must not take
    over a live run's lock as its own earlier attempt."""
    _attempt(monkeypatch, run_id="none", restarts=0)
    monkeypatch.setattr(os, "getppid", lambda: other_process)
    _hold(tmp_path / "exp", other_process, job=f"torchrun-agent:{socket.gethostname()}:1")
    with pytest.raises(RunLocked):
        RunLock(tmp_path / "exp").acquire()


def test_run_dir_is_absolute_and_a_symlinked_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run, lock = prepare_run_dir("runs", "exp", resume="never", overwrite=False)
    lock.release()
    assert run == tmp_path / "runs" / "exp" and run.is_absolute()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "runs" / "linked").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UserError, match="is a symlink"):
        prepare_run_dir("runs", "linked", resume="never", overwrite=False)


def test_unwritable_runs_dir_is_a_user_error(tmp_path, monkeypatch):
    """A read-only runs_dir (simulated: root ignores permissions) and a runs_dir that is a file: exit 2."""
    (tmp_path / "afile").write_text("")
    with pytest.raises(UserError, match="trainer.runs_dir=.* must be a writable directory"):
        prepare_run_dir(str(tmp_path / "afile"), "exp", resume="never", overwrite=False)

    def read_only(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr("pathlib.Path.mkdir", read_only)
    with pytest.raises(UserError, match="Permission denied.*trainer.runs_dir"):
        prepare_run_dir(str(tmp_path), "exp", resume="never", overwrite=False)
