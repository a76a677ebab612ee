"""The run directory `runs/<experiment_name>/`: config.yaml, plan.json, metrics.jsonl, util.jsonl,
checkpoints/, logs/, heartbeat/, LOCK, PNG reports. Created by rank 0 only; a finished run is never
overwritten and a live one (launcher/runlock.py) is never touched."""

from __future__ import annotations

import os
import time
from pathlib import Path

from launcher.errors import UserError
from launcher.runlock import RunLock, RunLocked, live_lock


def holds_run(path: Path) -> bool:
    """Metrics rows or a checkpoint: a start-up that failed before its first step holds neither, so its
    directory (kept for its logs) does not block the next launch."""
    metrics = path / "metrics.jsonl"
    if metrics.exists() and metrics.stat().st_size > 0:
        return True
    ckpts = path / "checkpoints"
    return ckpts.is_dir() and any(p.name.startswith("step_") for p in ckpts.iterdir())


def prepare_run_dir(runs_dir: str, name: str, *, resume: str, overwrite: bool) -> tuple[Path, RunLock]:
    """Create (or reopen for resume) the run directory and take its lock; release the lock when the run
    ends. Never deletes anything: with `overwrite=true` a finished run is renamed aside to
    `<name>.old-<time>`; a live run (its lock held) is refused whatever the options."""
    if not name or "/" in name or name in (".", ".."):
        raise UserError(f"trainer.experiment_name={name!r} must be a plain directory name")
    path = Path(runs_dir) / name
    if path.exists() and (live := live_lock(path)):
        raise RunLocked(live)
    if holds_run(path) and resume == "never":
        if not overwrite:
            raise UserError(f"run directory {path} already holds a run; continue it with trainer.resume=auto, "
                            f"pick another trainer.experiment_name, or set trainer.overwrite=true "
                            f"(the old directory is kept, renamed aside)")
        os.rename(path, path.with_name(f"{name}.old-{time.strftime('%Y%m%d-%H%M%S')}"))
    (path / "logs").mkdir(parents=True, exist_ok=True)
    (path / "checkpoints").mkdir(exist_ok=True)
    return path, RunLock(path).acquire()  # O_EXCL: of two launches racing past the check above, one wins


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
