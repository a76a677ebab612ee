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
