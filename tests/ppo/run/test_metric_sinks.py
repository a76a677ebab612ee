"""After a restart, TensorBoard and W&B show each step once: the rows an earlier attempt logged after its last
checkpoint are replaced by the re-run steps' (as metrics.jsonl's are superseded, ppo/run/resume.py)."""

from __future__ import annotations

import sys
import types

from launcher.config.load import load_config
from tests.ppo.world import train_state


def _attempt(run_dir, steps, *, resumed_at: int, value: float, **overrides):
    cfg = load_config(None, ["data.batch_size=4", "trainer.progress_bar=false",
                             *(f"{k}={v}" for k, v in overrides.items())])
    state = train_state(cfg, run_dir)
    state.resumed_at = resumed_at
    for s in steps:
        state.log_metrics({"step": s, "reward/mean": value + s})
    state.close()


def test_tensorboard_rows_of_superseded_steps_are_purged(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _attempt(tmp_path, [1, 2, 3, 4], resumed_at=0, value=0.0, **{"trainer.tensorboard": "true"})
    # died after step 4's row, its last checkpoint step_2: the restart re-runs 3 and 4, then 5
    _attempt(tmp_path, [3, 4, 5], resumed_at=2, value=100.0, **{"trainer.tensorboard": "true"})
    ev = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    got = [(e.step, e.value) for e in ev.Scalars("reward/mean")]
    assert got == [(1, 1.0), (2, 2.0), (3, 103.0), (4, 104.0), (5, 105.0)]


def test_wandb_attempts_share_one_run_rewound_to_the_resume_step(tmp_path, monkeypatch):
    """wandb is not installed here: a stand-in module records what wandb.init and wandb.log receive."""
    calls = []
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or types.SimpleNamespace(
        finish=lambda: None), log=lambda row, step: calls.append(("log", step)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    flags = {"trainer.tensorboard": "false", "trainer.wandb": "true"}
    _attempt(tmp_path, [1, 2, 3], resumed_at=0, value=0.0, **flags)
    _attempt(tmp_path, [3, 4], resumed_at=2, value=0.0, **flags)
    first, second = calls[0][1], calls[4][1]
    run_id = (tmp_path / "wandb_id").read_text().strip()
    assert (first["id"], first["resume"]) == (run_id, "allow") and "resume_from" not in first
    assert second["resume_from"] == f"{run_id}?_step=2" and "id" not in second
    assert [c[1] for c in calls if c[0] == "log"] == [1, 2, 3, 3, 4]
