"""`build_model`: a random-initialised model from a preset name or a `ModelConfig`."""

from __future__ import annotations

import torch

from models.config import ModelConfig, preset_config
from models.llama import LlamaForCausalLM, init_weights


def build_model(
    config: ModelConfig | str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int | None = 0,
    init: bool = True,
) -> LlamaForCausalLM:
    """Causal LM of the given preset or config. `init=False` leaves weights uninitialised (meta-free
    fast path for benchmarks that overwrite them)."""
    cfg = preset_config(config) if isinstance(config, str) else config
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    if init:
        init_weights(model, seed=seed)
    return model.to(dtype=dtype)
