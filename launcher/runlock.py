"""One live run per run directory: `runs/<name>/LOCK`, held by rank 0 of the live run.

    lock = RunLock(run_dir).acquire()     # raises RunLocked naming the holder when it is live
    lock.refresh()                        # the watchdog thread calls this every few seconds
    lock.release()

The lock file holds the holder's host, pid, job id and start time; it is created with
O_EXCL. A lock is stale (and taken over, with a warning) when its holder is on this host and
its pid is gone, when it belongs to an earlier attempt of this same job (a torchrun restart or
a Slurm requeue: same TORCHELASTIC_RUN_ID / SLURM_JOB_ID), or when nobody refreshed it for
`stale_after_s` (a holder on another host that died without releasing it).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from launcher.errors import UserError

LOCK_NAME = "LOCK"

_log = logging.getLogger("hybridrl")


class RunLocked(UserError):
    """A live run holds the directory."""


def job_id() -> str | None:
    """The id shared by every attempt of this job: the Slurm job (kept by a requeue), torchrun's run id
    (--rdzv-id, a fresh uuid under --standalone), or, when torchrun runs without one (its default id "none",
    shared by every plain torchrun), the torchrun agent itself: the parent of every attempt it restarts."""
    if slurm := os.environ.get("SLURM_JOB_ID"):
        return slurm
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return run_id
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        return f"torchrun-agent:{socket.gethostname()}:{os.getppid()}"
    return None


def restart_count() -> int:
    """How often this job was restarted before this attempt: torchrun's restarts (--max-restarts) plus Slurm's
    requeues. 0 for a fresh launch."""
    total = 0
    for var in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        try:
            total += int(os.environ.get(var) or 0)
        except ValueError:
            pass
    return total


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    def __init__(self, run_dir: str | os.PathLike, *, stale_after_s: float = 600.0):
        self.path = Path(run_dir) / LOCK_NAME
        self.stale_after_s = stale_after_s
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "started": time.time()}
        self.held = False

    def holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # half-written or garbage: judged by its age only

    def stale_reason(self, rec: dict) -> str | None:
        """Why the lock `rec` no longer protects a live run, or None when it may."""
        mine = self.record
        if rec.get("job") and rec.get("job") == mine["job"]:
            return f"it belongs to an earlier attempt of this job ({rec['job']})"
        if rec.get("host") == mine["host"] and isinstance(rec.get("pid"), int) and not _pid_alive(rec["pid"]):
            return f"its holder (pid {rec['pid']} on this host) is gone"
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return "it disappeared"
        if age > self.stale_after_s:
            return f"nobody refreshed it for {age:.0f} s (more than {self.stale_after_s:g} s)"
        return None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                rec = self.holder()
                if rec is None:
                    continue  # released meanwhile
                reason = self.stale_reason(rec)
                if reason is None:
                    raise RunLocked(self.describe_live(rec)) from None
                _log.warning("run directory %s: taking over a stale lock (%s): %s", self.path.parent, reason, rec)
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.record, f)
            self.held = True
            return self
        raise RunLocked(f"run directory {self.path.parent}: could not take {self.path} (another launch is "
                        f"racing for it)")

    def describe_live(self, rec: dict) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.get("started", 0)))
        return (f"run directory {self.path.parent} is in use by a live run (host {rec.get('host')}, pid "
                f"{rec.get('pid')}, job {rec.get('job')}, since {since}); a second run with this "
                f"trainer.experiment_name would interleave its metrics and checkpoints. Pick another "
                f"trainer.experiment_name, or stop the live run first (trainer.overwrite=true does not touch a "
                f"live run). If that run is dead, delete {self.path}")

    def refresh(self) -> None:
        if self.held:
            os.utime(self.path)

    def release(self) -> None:
        if self.held and (self.holder() or {}).get("pid") == self.record["pid"]:
            self.path.unlink(missing_ok=True)
        self.held = False


def live_lock(run_dir: str | os.PathLike) -> str | None:
    """The message for a live lock on `run_dir`, or None (no lock, or a stale one)."""
    lock = RunLock(run_dir)
    rec = lock.holder()
    if rec is None or lock.stale_reason(rec) is not None:
        return None
    return lock.describe_live(rec)
