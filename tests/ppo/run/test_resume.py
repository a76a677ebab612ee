"""resume=auto never skips or overwrites a damaged checkpoint silently; checkpoints load as data
only; another world size is picked (resharded on load, ppo/run/relayout.py); re-run steps supersede their metrics
rows."""

import json
import logging
import os

import pytest
import torch

from launcher.report import metric_rows, read_jsonl
from ppo.run.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, sha256_file, verify_checkpoint
from ppo.run.resume import ResumeError, select_checkpoint, supersede_metrics


def _save(run_dir, step, world_size=1):
    return save_checkpoint(run_dir, step, rank=0, world_size=world_size, barrier=lambda: None,
                           per_rank_state={"w": torch.arange(1000.0) * step},
                           shared_state={"step": step}) if world_size == 1 else None


def _truncate(p):
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) // 2)


def _corrupt_same_size(p):
    with open(p, "r+b") as f:
        f.seek(os.path.getsize(p) - 200)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage,reason", [
    (_truncate, "rank_0.pt has .* bytes, the manifest says"),
    (os.remove, "rank_0.pt is missing"),
    (_corrupt_same_size, "SHA-256 mismatch"),
])
def test_damaged_newest_is_reported_moved_aside_and_policy_decides(tmp_path, caplog, damage, reason):
    _save(tmp_path, 2)
    newest = _save(tmp_path, 4)
    size_before = os.path.getsize(newest / "rank_0.pt")
    damage(newest / "rank_0.pt")
    if damage is _corrupt_same_size:
        assert os.path.getsize(newest / "rank_0.pt") == size_before  # only the checksum can tell
    with pytest.raises(ResumeError, match=reason) as err:
        select_checkpoint(tmp_path, policy="stop", rank=0, world_size=1)
    assert "on_damaged_checkpoint=fallback" in str(err.value) and "step_2" in str(err.value)
    aside = list((tmp_path / "checkpoints").glob("step_4.damaged-*"))
    assert len(aside) == 1 and not newest.exists()  # kept for inspection, not deleted, not overwritten
    # relaunch: the damaged copy is never picked again; a later save of step 4 cannot touch it
    newest = _save(tmp_path, 6)
    damage(newest / "rank_0.pt")
    with caplog.at_level(logging.WARNING, logger="hybridrl"):
        chosen = select_checkpoint(tmp_path, policy="fallback", rank=0, world_size=1)
    assert chosen == tmp_path / "checkpoints" / "step_2"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step_6 is damaged" in w and "moved aside" in w for w in warnings)
    assert any("resuming from" in w and "step_2" in w for w in warnings)
    _save(tmp_path, 4)
    assert aside[0].exists() and verify_checkpoint(aside[0]) is not None  # the damaged copy, still as it was


def test_deleted_manifest_and_nothing_left(tmp_path, caplog):
    only = _save(tmp_path, 3)
    (only / "COMPLETE").unlink()
    with pytest.raises(ResumeError, match="no COMPLETE manifest.*no older checkpoint exists"):
        select_checkpoint(tmp_path, policy="stop", rank=0, world_size=1)
    only = _save(tmp_path, 3)
    _truncate(only / "shared.pt")
    with caplog.at_level(logging.WARNING, logger="hybridrl"):
        assert select_checkpoint(tmp_path, policy="fallback", rank=0, world_size=1) is None
    assert any("no intact checkpoint remains" in r.getMessage() for r in caplog.records)
    assert len(list((tmp_path / "checkpoints").glob("step_3.damaged-*"))) == 2


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_crafted_pickle_is_refused_without_running_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _save(tmp_path, 1)
    torch.save({"w": _RunsCode()}, path / "rank_0.pt")
    manifest = json.loads((path / "COMPLETE").read_text())  # the attacker fixes the manifest too
    manifest["files"]["rank_0.pt"] = {"size": os.path.getsize(path / "rank_0.pt"),
                                      "sha256": sha256_file(path / "rank_0.pt")}
    (path / "COMPLETE").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="refusing to unpickle rank_0.pt"):
        load_checkpoint(path, rank=0)
    assert not (tmp_path / "PWNED").exists()


def test_another_world_size_is_no_damage(tmp_path):
    path = _save(tmp_path, 1)
    # picked as it is: ppo/run/relayout.py reshards it (tests/ppo/run/test_relayout.py)
    assert select_checkpoint(tmp_path, policy="stop", rank=0, world_size=2) == path


def test_rerun_steps_supersede_their_rows(tmp_path):
    rows = [{"step": 1, "v": 1}, {"step": 2, "v": 2}, {"step": 3, "v": 3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "v"')
    assert supersede_metrics(tmp_path, step=2, rank=0) == 2  # step 3 and the torn row
    assert read_jsonl(tmp_path / "metrics.jsonl") == rows[:2]
    assert len((tmp_path / "metrics.superseded.jsonl").read_text().splitlines()) == 2
    # a report over a file with duplicates (copied from an older version) keeps the last row per step
    dup = rows + [{"step": 3, "v": 30}, {"step": 2, "v": 20}]
    assert metric_rows(dup) == [{"step": 1, "v": 1}, {"step": 2, "v": 20}, {"step": 3, "v": 30}]
