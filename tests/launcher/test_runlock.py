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
