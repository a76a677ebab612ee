"""The run directory `runs/<experiment_name>/`: config.yaml, plan.json, metrics.jsonl, util.jsonl,
checkpoints/, logs/, heartbeat/, LOCK, attempts.jsonl, prompts.jsonl (the prompt ledger), PNG reports. Created
by rank 0 only; a finished run is never overwritten and a live one (launcher/runlock.py) is never touched.

    resume = resume_of_attempt(runs_dir, name, resume=cfg.trainer.resume)   # "auto" for a restarted attempt
    path, lock = prepare_run_dir(runs_dir, name, resume=resume, overwrite=False)

A fresh launch into a directory that holds a run refuses (continue it with trainer.resume=auto). An attempt
that torchrun restarted (--max-restarts) or Slurm requeued continues its own job's run by itself: its job id
(launcher.runlock.job_id) is the one the directory's attempts.jsonl recorded last.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from launcher.errors import UserError
from launcher.runlock import RunLock, RunLocked, job_id, live_lock, restart_count

ATTEMPTS = "attempts.jsonl"


def holds_run(path: Path) -> bool:
    """A trained step's metrics row or a checkpoint: a start-up that failed before its first step holds neither
    (a validation row at step 0 is no trained step), so its directory (kept for its logs) does not block the next
    launch."""
    ckpts = path / "checkpoints"
    if ckpts.is_dir() and any(p.name.startswith("step_") for p in ckpts.iterdir()):
        return True
    return any(step > 0 for step in _metric_steps(path / "metrics.jsonl"))


def _metric_steps(metrics: Path) -> list[int]:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return []
    steps = []
    for line in lines:
        try:
            steps.append(int(json.loads(line).get("step") or 0))
        except (ValueError, AttributeError, TypeError):
            continue  # a row torn by a crash
    return steps


def run_path(runs_dir: str, name: str) -> Path:
    """runs_dir/name, absolute and free of symlinks (resolved once at start-up: a reward function that changes
    the working directory cannot move the run). A symlink at runs_dir/name is refused."""
    if not name or "/" in name or name in (".", ".."):
        raise UserError(f"trainer.experiment_name={name!r} must be a plain directory name")
    path = Path(runs_dir).expanduser().resolve() / name
    if path.is_symlink():
        raise UserError(f"run directory {path} is a symlink (to {os.readlink(path)}); a run directory must be a "
                        f"real directory under trainer.runs_dir: remove the link or pick another "
                        f"trainer.experiment_name")
    return path


def last_attempt(path: Path) -> dict | None:
    """The newest record of attempts.jsonl (job, restart, host, pid, time), or None."""
    try:
        lines = [x for x in (path / ATTEMPTS).read_text().splitlines() if x.strip()]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def resume_of_attempt(runs_dir: str, name: str, *, resume: str) -> str:
    """trainer.resume as this attempt applies it: "auto" when the attempt was restarted (torchrun
    --max-restarts, a Slurm requeue) and the directory holds a run its own job started, so it continues from the
    newest intact checkpoint with no flag; the configured value otherwise (a fresh launch never continues a run
    by itself)."""
    path = run_path(runs_dir, name)
    if resume == "auto" or restart_count() == 0 or not holds_run(path):
        return resume
    mine, rec = job_id(), last_attempt(path) or {}
    if mine is not None and rec.get("job") == mine:
        return "auto"
    return resume


def prepare_run_dir(runs_dir: str, name: str, *, resume: str, overwrite: bool) -> tuple[Path, RunLock]:
    """Create (or reopen for resume) the run directory and take its lock; release the lock when the run
    ends. Never deletes anything: with `overwrite=true` a finished run is renamed aside to
    `<name>.old-<time>`; a live run (its lock held) is refused whatever the options. Returns the absolute,
    symlink-free path (run_path)."""
    path = run_path(runs_dir, name)
    if path.exists() and (live := live_lock(path)):
        raise RunLocked(live)
    if holds_run(path) and resume == "never":
        if not overwrite:
            raise UserError(f"run directory {path} already holds a run; continue it with trainer.resume=auto, "
                            f"pick another trainer.experiment_name, or set trainer.overwrite=true "
                            f"(the old directory is kept, renamed aside)")
        os.rename(path, path.with_name(f"{name}.old-{time.strftime('%Y%m%d-%H%M%S')}"))
    try:
        (path / "logs").mkdir(parents=True, exist_ok=True)
        (path / "checkpoints").mkdir(exist_ok=True)
        if resume == "never":
            _set_aside_rows_of_a_failed_start(path)
        lock = RunLock(path).acquire()  # O_EXCL: of two launches racing past the check above, one wins
        with open(path / ATTEMPTS, "a") as f:
            f.write(json.dumps({"job": job_id(), "restart": restart_count(), "host": lock.record["host"],
                                "pid": os.getpid(), "time": time.time()}) + "\n")
    except OSError as e:
        raise UserError(f"cannot write the run directory {path} ({type(e).__name__}: {e.strerror or e}); "
                        f"trainer.runs_dir={runs_dir!r} must be a writable directory") from None
    return path, lock


def _set_aside_rows_of_a_failed_start(path: Path) -> None:
    """A start that failed before step 1 may have left a step-0 validation row or a draw of prompts in the
    ledger: the fresh run writes its own, so the old ones move to <name>.superseded.jsonl (never two rows of one
    step)."""
    for name in ("metrics.jsonl", "prompts.jsonl"):
        rows = path / name
        if rows.exists() and rows.stat().st_size:
            with open(path / name.replace(".jsonl", ".superseded.jsonl"), "a") as f:
                f.write(rows.read_text())
            rows.unlink()


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
