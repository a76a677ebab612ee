"""bench/heavy_tail.py on CPU (the mechanics, not the speed): the heavy-tailed workload runs through bench.placement,
and --runs-dir keeps the run directory with its per-step async metrics."""

from __future__ import annotations

import json

from bench.heavy_tail import main


def test_decoding_beside_runs_on_the_heavy_tail_and_keeps_its_metrics(tmp_path):
    row = main(["--modes", "colocated-partial-beside", "--steps", "3", "--max-tokens", "64", "--prompts", "64",
                "--config", "conf/grpo_tiny.yaml", "--nproc", "1", "--runs-dir", str(tmp_path),
                "trainer.device=cpu", "model.dtype=float32"])
    run = row["rows"][0]
    assert run["ok"] and run["staleness_max"] <= 1 and row["heavy_tail"]["max_cap"] == 64
    metrics = [json.loads(line) for line in (tmp_path / "colocated-partial-beside" / "metrics.jsonl").open()]
    assert len(metrics) == 3 and all("async/beside_steps" in m for m in metrics)
