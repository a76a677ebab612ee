"""The one place a rollout engine is chosen: `build_rollout_engine(kind, ...)`.

    engine = build_rollout_engine("native", model_config, config=RolloutConfig(...), tp_group=g,
                                  device=dev, dtype=torch.bfloat16, eos_token_ids=[2])

`ENGINES` lists the kinds this function builds, the values `rollout.engine` may take (the launcher's
schema lists the same, and refuses any other before launch); a new backend is one more branch here and
one more name in ENGINES.
"""

from __future__ import annotations

import torch

from models.config import ModelConfig
from rollout.base import RolloutConfig, RolloutEngine
from rollout.vllm_support import VLLMOptions

ENGINES = ("native", "vllm")


def build_rollout_engine(kind: str, model_config: ModelConfig, *, config: RolloutConfig, tp_group=None,
                         device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                         eos_token_ids: list[int] | None = None, vllm: VLLMOptions | None = None,
                         lora=None) -> RolloutEngine:
    """A sleeping-capable engine of `kind` whose generation TP group is `tp_group`. vllm: the settings only
    the vLLM engine reads (rollout/vllm_engine.py); required for kind "vllm". lora: a models.lora.LoRASpec whose
    adapters the engine applies itself (actor.lora.sync=adapters: native in its GEMMs, vLLM by its LoRA loading)."""
    if kind == "native":
        from rollout.engine import NativeEngine

        return NativeEngine(model_config, config=config, tp_group=tp_group, device=device, dtype=dtype,
                            eos_token_ids=eos_token_ids, lora=lora)
    if kind == "vllm":
        from rollout.vllm_engine import VLLMEngine

        if vllm is None:
            raise ValueError("rollout engine 'vllm' needs its VLLMOptions (log-prob mode, eager, bucket size)")
        return VLLMEngine(model_config, config=config, tp_group=tp_group, device=device, dtype=dtype,
                          eos_token_ids=eos_token_ids, logprobs_mode=vllm.logprobs_mode,
                          enforce_eager=vllm.enforce_eager, bucket_bytes=vllm.bucket_bytes, idle_tp=vllm.idle_tp,
                          lora=lora)
    raise ValueError(f"rollout engine {kind!r}: not one of {', '.join(ENGINES)}")
