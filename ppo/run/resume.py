"""Which checkpoint a resumed run continues from, and what a resume does to metrics.jsonl.

    path = select_checkpoint(run_dir, policy="stop", rank=r, world_size=w)   # collective
    # another world size or layout: ppo/run/relayout.py
    supersede_metrics(run_dir, step=shared["step"], rank=r)

`resume=auto` never skips or overwrites a checkpoint silently. Newest first, every file of a
candidate is checked against the manifest's size and SHA-256 (the rank files spread over the resuming ranks,
rank 0 the rest). A damaged one is reported with its path and reason at
WARNING and renamed to `step_N.damaged-<time>` (kept for inspection, never pruned, never
picked again, never overwritten by a later save of step N). Then `policy` decides:
"stop" (the default) ends the run with a ResumeError naming the previous complete checkpoint;
"fallback" continues with it, logged at WARNING.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from ppo.batch.experience import all_gather_objects
from ppo.run.checkpoint import MANIFEST, step_dirs, verify_checkpoint

_log = logging.getLogger("hybridrl")

POLICIES = ("stop", "fallback")


class ResumeError(ValueError):
    """A resume that cannot go on as configured (damaged checkpoint under policy=stop, a state that cannot load at
    this layout or backend: ppo/run/relayout.py); the launcher exits with code 2."""


def _broadcast_from_0(obj, *, rank: int):
    return all_gather_objects(obj if rank == 0 else None)[0]


def _manifest(path: Path) -> dict | None:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def select_checkpoint(run_dir: str | os.PathLike, *, policy: str, rank: int, world_size: int) -> Path | None:
    """Collective over the world. The newest intact checkpoint, or None when there is none (and
    the policy allows starting without one). Raises ResumeError under policy="stop"."""
    if policy not in POLICIES:
        raise ResumeError(f"trainer.on_damaged_checkpoint={policy!r} is not one of {', '.join(POLICIES)}")
    candidates = _broadcast_from_0([str(p) for _, p in step_dirs(run_dir)][::-1], rank=rank)
    damaged: list[str] = []
    for i, cand in enumerate(candidates):
        path = Path(cand)
        m = _manifest(path)
        reason = None
        if m is None:
            reason = verify_checkpoint(path)  # the manifest's own problem
        else:
            # the rank files spread over this run's ranks (another world size resumes onto another layout)
            mine = [f"rank_{r}.pt" for r in range(rank, int(m.get("world_size", 0)), world_size)]
            if rank == 0:
                mine += [f for f in m["files"] if not f.startswith("rank_")]
            reason = verify_checkpoint(path, files=mine)
        reasons = [r for r in all_gather_objects(reason) if r is not None]
        if not reasons:
            if damaged and rank == 0:
                _log.warning("trainer.on_damaged_checkpoint=fallback: resuming from %s instead of the damaged %s",
                             path, ", ".join(damaged))
            return path
        aside = None
        if rank == 0:
            aside = _free_name(path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"))
            os.rename(path, aside)
            _log.warning("checkpoint %s is damaged: %s; moved aside to %s", path, "; ".join(sorted(set(reasons))),
                         aside)
        aside = _broadcast_from_0(aside, rank=rank)  # nobody looks at the next candidate before the rename
        damaged.append(str(path))
        if policy == "stop":
            older = candidates[i + 1:]
            hint = (f"set trainer.on_damaged_checkpoint=fallback to resume from the previous checkpoint "
                    f"({Path(older[0]).name}) or trainer.resume=<checkpoint dir>" if older
                    else "no older checkpoint exists; set trainer.on_damaged_checkpoint=fallback to start from "
                         "step 0 in this directory, or trainer.resume=never with another trainer.experiment_name")
            raise ResumeError(f"trainer.resume=auto: the newest checkpoint {path} is damaged "
                              f"({'; '.join(sorted(set(reasons)))}); it was moved aside to {aside.name} "
                              f"(never overwritten). Policy trainer.on_damaged_checkpoint=stop: {hint}")
    if damaged and rank == 0:
        _log.warning("trainer.on_damaged_checkpoint=fallback: no intact checkpoint remains (damaged: %s); "
                     "starting from step 0", ", ".join(damaged))
    return None


def _free_name(path: Path) -> Path:
    n, out = 1, path
    while out.exists():
        n += 1
        out = path.with_name(f"{path.name}-{n}")
    return out


def layout_of(plan) -> dict:
    """The device plan's layout as saved in a checkpoint: {role: [ranks, tp, pp, dp]}, and ep after them where it is
    > 1 (each rank's expert shards fit only that split)."""
    return {role: [list(g.ranks), g.dims.tp, g.dims.pp, g.dims.dp] + ([g.dims.ep] if g.dims.ep > 1 else [])
            for role, g in sorted(plan.groups.items())}


def supersede_metrics(run_dir: str | os.PathLike, *, step: int, rank: int, name: str = "metrics.jsonl") -> int:
    """Rank 0: rows of steps after `step` (written by the attempt that died before its next
    checkpoint) move from metrics.jsonl (or another per-step log `name`, e.g. the prompt ledger) to
    <stem>.superseded.jsonl, so the re-run steps appear once. Returns how many rows moved."""
    if rank != 0:
        return 0
    path = Path(run_dir) / name
    if not path.exists():
        return 0
    keep, moved = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row_step = json.loads(line).get("step")
        except ValueError:
            moved.append(line)  # a row torn by the crash
            continue
        (moved if row_step is not None and row_step > step else keep).append(line)
    if moved:
        aside = path.with_name(path.name.replace(".jsonl", ".superseded.jsonl"))
        with open(aside, "a") as f:
            f.write("\n".join(moved) + "\n")
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(x + "\n" for x in keep))
        os.replace(tmp, path)
        _log.info("resume at step %d: %d %s rows of later steps moved to %s", step, len(moved), name, aside)
    return len(moved)
