"""Qwen3 dense specifics: config.json parsing of the published shape, presets, the per-head q/k norm's
parameters on disk and their round trip (logit parity with transformers is in test_hf_parity.py)."""

import json

import pytest
import torch

from models import (
    ModelConfig,
    ModelConfigError,
    build_model,
    load_pretrained,
    preset_config,
    save_pretrained,
    save_tensors,
)
from models.hf_io import tensor_shapes

# Qwen/Qwen3-0.6B's config.json as published (transformers 4.51 generation)
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def _tiny_qwen3(**overrides) -> ModelConfig:
    return preset_config("tiny-qwen3", **overrides)  # 4 heads x 32 != 64 hidden


def test_published_config_parses_to_the_preset():
    cfg = ModelConfig.from_hf(QWEN3_0_6B)
    preset = preset_config("qwen3-0.6b")
    for name in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                 "rms_norm_eps", "rope_theta", "rope_scaling", "attention_bias", "tie_word_embeddings",
                 "bos_token_id", "eos_token_id"):
        assert getattr(cfg, name) == getattr(preset, name), name
    assert cfg.qk_norm and cfg.head_dim * cfg.num_attention_heads == 2 * cfg.hidden_size
    # Qwen3-0.6B: 0.6B parameters, 0.44B without the (tied) embedding, as its model card says
    assert round(cfg.num_params() / 1e9, 1) == 0.6
    assert round(cfg.num_params(include_embedding=False) / 1e9, 2) == 0.44
    back = cfg.to_hf()
    assert back["architectures"] == ["Qwen3ForCausalLM"] and back["use_sliding_window"] is False
    assert ModelConfig.from_hf(back) == cfg


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"])
def test_presets_count_like_the_model(name):
    cfg = preset_config(name)
    with torch.device("meta"):
        from models.llama import LlamaForCausalLM

        model = LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())  # a tied head is one parameter
    assert n == cfg.num_params()
    assert round(n / 1e9, 1) == {"qwen3-0.6b": 0.6, "qwen3-1.7b": 1.7, "qwen3-8b": 8.2}[name]


def test_unsupported_qwen3_variants_are_rejected():
    with pytest.raises(ModelConfigError, match="Qwen3 use_sliding_window=true is not supported"):
        ModelConfig.from_hf({**QWEN3_0_6B, "use_sliding_window": True, "sliding_window": 4096})
    with pytest.raises(ModelConfigError, match="Qwen3 attention_bias=true is not supported"):
        ModelConfig.from_hf({**QWEN3_0_6B, "attention_bias": True})


@pytest.mark.parametrize("tied", [False, True])
def test_save_load_round_trip_keeps_qk_norms(tmp_path, tied):
    model = build_model(_tiny_qwen3(tie_word_embeddings=tied), seed=5)
    with torch.no_grad():  # norms start at 1: make the round trip prove their values travel
        for layer in model.model.layers.values():
            layer.self_attn.q_norm.weight.normal_(1.0, 0.1)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.1)
    save_pretrained(model, tmp_path / "m")
    shapes = tensor_shapes(tmp_path / "m")
    assert shapes["model.layers.3.self_attn.q_norm.weight"] == (32,)
    assert shapes["model.layers.3.self_attn.k_norm.weight"] == (32,)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4 * 32, 64)
    assert ("lm_head.weight" in shapes) == (not tied)
    with open(tmp_path / "m" / "config.json") as f:
        assert json.load(f)["model_type"] == "qwen3"
    back = load_pretrained(tmp_path / "m")
    for name, t in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    ids = torch.randint(0, 512, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids), back(ids))
    # a qwen3 checkpoint that lacks a norm is refused by name, not filled with ones
    tensors = {n: t for n, t in model.state_dict().items() if n != "model.layers.1.self_attn.k_norm.weight"}
    save_tensors(tensors, model.config, tmp_path / "partial")
    with pytest.raises(ModelConfigError, match=r"missing \['model.layers.1.self_attn.k_norm.weight'\]"):
        load_pretrained(tmp_path / "partial")


def test_qwen3_reward_model_scores_equal_transformers(tmp_path):
    """A Qwen3ForSequenceClassification checkpoint (reward model / critic trunk) scores like ours."""
    transformers = pytest.importorskip("transformers")
    from models import LlamaForSequenceClassification
    from tests.models.hf_fixtures import hf_config, randomize_

    cfg = hf_config("qwen3", num_labels=1, pad_token_id=0)
    hf = transformers.Qwen3ForSequenceClassification(cfg).float().eval()
    randomize_(hf, seed=9)
    hf.save_pretrained(str(tmp_path))
    rm = load_pretrained(tmp_path, model_cls=LlamaForSequenceClassification)
    ids = torch.randint(1, 128, (3, 10), generator=torch.Generator().manual_seed(2))
    ids[0, 6:] = ids[2, 3:] = 0  # right padding
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=(ids != 0).long()).logits.squeeze(-1)
        got = rm.sequence_scores(ids)
    assert ref.std() > 1e-3 and (got - ref).abs().max() <= 1e-4
    out = save_pretrained(rm, tmp_path / "ours")
    with open(out / "config.json") as f:
        assert json.load(f)["architectures"] == ["Qwen3ForSequenceClassification"]
