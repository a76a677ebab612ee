"""Safetensors checkpoint I/O: round trips, shards, slices, tied heads, and actionable errors."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import (
    ModelConfig,
    ModelConfigError,
    build_model,
    load_pretrained,
    load_tensors,
    load_weights,
    preset_config,
    read_config,
    save_pretrained,
    save_tensors,
    tensor_shapes,
)
from models.llama import LlamaForCausalLM
from parallel.sharding import pp_stage_layers, tp_slices


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_bit_exact(tmp_path, dtype):
    model = build_model("tiny", dtype=dtype, seed=3)
    save_pretrained(model, tmp_path / "m")
    assert sorted(os.listdir(tmp_path / "m")) == ["config.json", "model.safetensors"]
    back = load_pretrained(tmp_path / "m", dtype=dtype)
    _same_state(model, back)
    assert read_config(tmp_path / "m") == model.config
    ids = torch.randint(0, 512, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(ids), back(ids))


def test_sharded_save_loads(tmp_path):
    model = build_model("tiny", seed=4)
    save_pretrained(model, tmp_path / "m", max_shard_size_bytes=200_000)
    files = sorted(os.listdir(tmp_path / "m"))
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files and "model.safetensors" not in files
    with open(tmp_path / "m" / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(model.state_dict())
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in model.state_dict().values())
    _same_state(model, load_pretrained(tmp_path / "m"))
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32)
    ids = torch.randint(0, 512, (1, 6))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max() <= 1e-4


def test_save_dtype_casts(tmp_path):
    model = build_model("tiny")
    save_pretrained(model, tmp_path / "m", dtype=torch.bfloat16)
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    with open(tmp_path / "m" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"


def test_load_tensors_reads_exact_slices(tmp_path):
    model = build_model("tiny", seed=5)
    save_pretrained(model, tmp_path / "m", max_shard_size_bytes=100_000)
    full = model.state_dict()
    names = ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight",
             "model.embed_tokens.weight", "model.norm.weight"]
    for rank in range(2):
        got = load_tensors(tmp_path / "m", names=names,
                           slices=lambda n, shape, r=rank: tp_slices(n, shape, rank=r, world=2))
        assert sorted(got) == sorted(names)
        for n in names:
            assert torch.equal(got[n], full[n][tp_slices(n, tuple(full[n].shape), rank=rank, world=2)]), n
    odd = load_tensors(tmp_path / "m", names=["model.layers.0.mlp.up_proj.weight"],
                       slices=lambda n, shape: (slice(3, 17), slice(5, 9)), dtype=torch.float64)
    w = odd["model.layers.0.mlp.up_proj.weight"]
    assert w.dtype == torch.float64 and torch.equal(w, full["model.layers.0.mlp.up_proj.weight"][3:17, 5:9].double())
    assert tensor_shapes(tmp_path / "m")["model.layers.0.mlp.up_proj.weight"] == (176, 64)


def test_tied_checkpoint_has_no_lm_head_and_pp_last_stage_gets_a_copy(tmp_path):
    cfg = preset_config("tiny", model_type="qwen2", tie_word_embeddings=True)
    model = build_model(cfg, seed=6)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_pretrained(model, tmp_path / "m")
    assert "lm_head.weight" not in tensor_shapes(tmp_path / "m")
    back = load_pretrained(tmp_path / "m")
    assert back.lm_head.weight is back.model.embed_tokens.weight
    _same_state(model, back)
    # last pipeline stage of pp=2: no embedding, its own lm_head filled from the checkpoint's embedding
    with torch.device("meta"):
        stage = LlamaForCausalLM(cfg)
    keep = pp_stage_layers(cfg.num_hidden_layers, pp=2, stage=1)
    for i in [k for k in stage.model.layers if int(k) not in keep]:
        del stage.model.layers[i]
    stage.model.embed_tokens = None
    stage.to_empty(device="cpu")
    load_weights(stage, tmp_path / "m")
    assert torch.equal(stage.lm_head.weight, model.model.embed_tokens.weight)
    assert torch.equal(stage.model.layers["3"].mlp.up_proj.weight, model.model.layers["3"].mlp.up_proj.weight)
    got = load_tensors(tmp_path / "m", names=["lm_head.weight"], slices=lambda n, s: (slice(0, 256), slice(None)))
    assert torch.equal(got["lm_head.weight"], model.model.embed_tokens.weight[:256])


def test_untied_checkpoint_without_lm_head_is_missing(tmp_path):
    model = build_model("tiny")
    save_pretrained(model, tmp_path / "m")
    state = load_file(tmp_path / "m" / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelConfigError, match=r"missing \['lm_head.weight'\]"):
        load_pretrained(tmp_path / "m")
    with pytest.raises(ModelConfigError, match="lm_head.weight"):
        load_tensors(tmp_path / "m", names=["lm_head.weight"])
    partial = load_pretrained(tmp_path / "m", strict=False)  # random head, everything else loaded
    assert partial.lm_head.weight.std() > 0.01
    assert torch.equal(partial.model.norm.weight, model.model.norm.weight)


def test_unexpected_tensor_is_named(tmp_path):
    model = build_model("tiny")
    save_pretrained(model, tmp_path / "m")
    state = load_file(tmp_path / "m" / "model.safetensors")
    state["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2)
    save_file(state, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelConfigError, match=r"unexpected \['model.layers.9.mlp.up_proj.weight'\]"):
        load_pretrained(tmp_path / "m")


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    save_pretrained(build_model("tiny"), tmp_path / "m")
    with open(tmp_path / "m" / "config.json") as f:
        cfg = json.load(f)
    cfg["intermediate_size"] = 128
    with open(tmp_path / "m" / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ModelConfigError, match=r"model.layers.0.mlp.gate_proj.weight: checkpoint shape "
                                               r"\[176, 64\] != model shape \[128, 64\]"):
        load_pretrained(tmp_path / "m")


def test_config_errors_are_actionable(tmp_path):
    with pytest.raises(ModelConfigError, match="no config.json"):
        read_config(tmp_path)
    with pytest.raises(ModelConfigError, match="sliding_window=4096 < max_position_embeddings=32768"):
        ModelConfig.from_hf({"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768,
                             "hidden_size": 64, "num_attention_heads": 4})
    with pytest.raises(ModelConfigError, match="use_sliding_window"):
        ModelConfig.from_hf({"model_type": "qwen2", "use_sliding_window": True})
    with pytest.raises(ModelConfigError, match="hidden_act"):
        ModelConfig.from_hf({"model_type": "llama", "hidden_act": "gelu"})
    with pytest.raises(ModelConfigError, match="rope_scaling type 'yarn'"):
        ModelConfig.from_hf({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})


def test_rope_config_both_generations():
    v4 = ModelConfig.from_hf({"rope_theta": 5e5, "rope_scaling": {"type": "llama3", "factor": 8.0,
                                                                  "original_max_position_embeddings": 8192}})
    v5 = ModelConfig.from_hf({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5,
                                                  "original_max_position_embeddings": 8192}})
    assert v4.rope_theta == v5.rope_theta == 5e5 and v4.rope_scaling == v5.rope_scaling
    assert v4.rope_scaling["rope_type"] == "llama3"
    d = v5.to_hf()
    assert d["rope_parameters"]["rope_theta"] == 5e5 and d["rope_scaling"]["rope_type"] == "llama3"
    assert ModelConfig.from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}).rope_scaling is None


def test_save_is_atomic_and_replaces(tmp_path):
    a, b = build_model("tiny", seed=1), build_model("tiny", seed=2)
    save_pretrained(a, tmp_path / "m")
    with pytest.raises(FileNotFoundError):
        save_pretrained(b, tmp_path / "m", extra_files=[tmp_path / "no_such_tokenizer.json"])
    _same_state(a, load_pretrained(tmp_path / "m"))  # the failed save left the old one intact
    assert sorted(os.listdir(tmp_path)) == ["m"]  # and no temporary directory behind
    (tmp_path / "tok.json").write_text("{}")
    save_pretrained(b, tmp_path / "m", extra_files=[tmp_path / "tok.json"])
    _same_state(b, load_pretrained(tmp_path / "m"))
    assert (tmp_path / "m" / "tok.json").exists()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a model directory"):
        save_pretrained(a, tmp_path / "other")


def test_save_rejects_pipeline_stage(tmp_path):
    model = build_model("tiny")
    del model.model.layers["0"]
    with pytest.raises(ModelConfigError, match="needs the whole model"):
        save_pretrained(model, tmp_path / "m")


def test_save_tensors_merged_pipeline_stages_of_tied_model(tmp_path):
    cfg = preset_config("tiny", model_type="qwen2", tie_word_embeddings=True)
    model = build_model(cfg, seed=10)
    merged = {n: t.detach().clone() for n, t in model.state_dict().items()}  # stage 0 + last stage's head copy
    assert "lm_head.weight" in merged
    save_tensors(merged, cfg, tmp_path / "m")
    assert "lm_head.weight" not in tensor_shapes(tmp_path / "m")
    _same_state(model, load_pretrained(tmp_path / "m"))
    merged["lm_head.weight"] += 1e-3
    with pytest.raises(ModelConfigError, match="all-reduce the tied weight's gradient"):
        save_tensors(merged, cfg, tmp_path / "m2")
    assert not (tmp_path / "m2").exists()


@pytest.mark.parametrize("text,needle", [('{"hidden_size": 32,', "is not valid JSON"),
                                         ("[1]", "holds a JSON list, not an object")])
def test_malformed_config_json_is_a_model_config_error_naming_the_file(tmp_path, text, needle):
    from models.config import ModelConfigError
    from models.hf_io import read_config

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ModelConfigError, match=f"{tmp_path}/config.json {needle}"):
        read_config(tmp_path)
