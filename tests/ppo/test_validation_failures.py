"""Validation counts its reward failures (val/reward/failed) and says so, instead of logging a plain
val/reward/mean of reward.default_score."""

from __future__ import annotations

import json
import logging

from tests.ppo.world import tiny_run, world_of_one


def test_validation_reward_failures_are_counted(tmp_path, caplog):
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": f"{i}+1=", "ground_truth": str(i + 1)}) + "\n" for i in range(4)))
    with world_of_one():
        t = tiny_run(tmp_path, f"data.val_files={val}", "rollout.val_n=1",
                     "reward.function=tests/launcher/fault_rewards.py:exits").trainer(tmp_path)
        with caplog.at_level(logging.WARNING, logger="hybridrl"):
            m = t.validate(0)
        t.roles.reward.close()
    assert m["val/reward/failed"] == 4.0 and m["val/reward/mean"] == 0.0
    assert any("failed on 4 of 4 samples" in r.getMessage() for r in caplog.records)
    assert any("SystemExit: 3" in r.getMessage() for r in caplog.records)  # the function's own error, named
