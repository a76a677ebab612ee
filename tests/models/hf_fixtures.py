"""Tiny random Hugging Face models saved to disk, shared by the tests/models parity tests."""

from __future__ import annotations

import torch

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def hf_config(kind: str, **overrides):
    import transformers

    kw = {**SMALL, **overrides}
    if kind == "llama":
        return transformers.LlamaConfig(**kw)
    if kind == "llama3":
        return transformers.LlamaConfig(rope_theta=500.0, rope_scaling=dict(LLAMA3_ROPE), **kw)
    if kind == "qwen2":
        return transformers.Qwen2Config(tie_word_embeddings=True, **kw)
    if kind == "mistral":
        return transformers.MistralConfig(sliding_window=None, **kw)
    if kind in ("qwen3", "qwen3-tied"):
        # head_dim 32 with 4 heads of a 64-wide model: num_heads * head_dim != hidden_size, as in Qwen3-0.6B
        return transformers.Qwen3Config(head_dim=32, rope_theta=1000.0, tie_word_embeddings=kind == "qwen3-tied",
                                        **kw)
    raise ValueError(kind)


def randomize_(model: torch.nn.Module, *, seed: int) -> None:
    """HF inits norms to 1 and biases to 0, which would hide bugs in either: perturb everything."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.08 * noise)


def hf_causal_lm(kind: str, *, seed: int = 0, **overrides):
    import transformers

    cfg = hf_config(kind, **overrides)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    randomize_(model, seed=seed)
    return model


def save_hf(model, path) -> str:
    model.save_pretrained(str(path))
    return str(path)


def random_ids(b: int, t: int, *, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))
