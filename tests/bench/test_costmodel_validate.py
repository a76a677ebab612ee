"""bench.costmodel_validate: the GSM8K recipe's runs, made on the GPU machine's fixture, are rebuilt on a local one."""

from __future__ import annotations

import json

import pytest

from bench.costmodel_validate import NeedsFixture, local_overrides


def test_the_gpu_machines_recipe_fixture_becomes_the_local_one(tmp_path):
    fixture = tmp_path / "fx"
    (fixture / "model").mkdir(parents=True)
    (fixture / "model" / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                                "pad_token_id": 0}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (fixture / "model" / name).write_text("{}")
    run = ["model.path=/tmp/recipe_qwen3-0.6b/model", "data.train_files=[/tmp/recipe_qwen3-0.6b/data/train.parquet]",
           "trainer.total_steps=5"]
    with pytest.raises(NeedsFixture, match="qwen3-0.6b"):
        local_overrides(run, None, tmp_path)
    model, data, steps = local_overrides(run, fixture, tmp_path / "shapes")
    shape = json.loads((tmp_path / "shapes" / "qwen3-0.6b" / "config.json").read_text())
    assert model == f"model.path={tmp_path / 'shapes' / 'qwen3-0.6b'}" and shape["num_hidden_layers"] == 28
    assert shape["eos_token_id"] == 2 and (tmp_path / "shapes" / "qwen3-0.6b" / "tokenizer.json").is_file()
    assert data == f"data.train_files=[{fixture / 'data' / 'train.parquet'}]" and steps == "trainer.total_steps=5"


def test_every_committed_placement_run_is_validated_or_excluded_with_its_reason(tmp_path):
    """The validation runs over today's results directory (it once stopped at a run made on the GPU machine's
    fixture): each bench.placement record is predicted, or listed as excluded with why."""
    from bench.costmodel_validate import RESULTS, main

    out = main(["--out", str(tmp_path / "v.json")])
    placement = {p.name for p in RESULTS.glob("*.json")
                 if (json.loads(p.read_text()).get("result") or {}).get("bench") == "placement"}
    seen = {r["file"] for r in out["records"]} | {e["file"] for e in out["excluded"]}
    assert seen == placement and out["summary"]["runs"] == len(out["records"]) > 0
    assert all("--recipe-fixture" in e["why"] for e in out["excluded"] if e["file"].startswith("recipe_"))
    # decode runs at 256 rows of the calibration's machine only (another GPU's run is not its to predict)
    assert out["summary"]["decode_runs"] == len(out["decode"]) > 0
    assert all("h100" not in r["file"] for r in out["decode"])
