"""The run directory `runs/<experiment_name>/`: config.yaml, plan.json, metrics.jsonl, util.jsonl,
checkpoints/, logs/, PNG reports. Created by rank 0 only; a finished run is never overwritten."""

from __future__ import annotations

import os
import time
from pathlib import Path

from launcher.errors import UserError


def prepare_run_dir(runs_dir: str, name: str, *, resume: str, overwrite: bool) -> Path:
    """Create (or reopen for resume) the run directory. Never deletes anything: with
    `overwrite=true` an existing directory is renamed aside to `<name>.old-<time>`."""
    if not name or "/" in name or name in (".", ".."):
        raise UserError(f"trainer.experiment_name={name!r} must be a plain directory name")
    path = Path(runs_dir) / name
    has_run = path.exists() and any((path / f).exists() for f in ("metrics.jsonl", "checkpoints"))
    if has_run and resume == "never":
        if not overwrite:
            raise UserError(f"run directory {path} already holds a run; continue it with trainer.resume=auto, "
                            f"pick another trainer.experiment_name, or set trainer.overwrite=true "
                            f"(the old directory is kept, renamed aside)")
        os.rename(path, path.with_name(f"{name}.old-{time.strftime('%Y%m%d-%H%M%S')}"))
    (path / "logs").mkdir(parents=True, exist_ok=True)
    (path / "checkpoints").mkdir(exist_ok=True)
    return path


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
