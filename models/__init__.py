"""Llama-family models with Hugging Face names: `from models import load_pretrained, build_model`."""

from models.build import build_model
from models.config import PRESETS, ModelConfig, ModelConfigError, preset_config
from models.llama import LlamaForCausalLM

__all__ = ["build_model", "ModelConfig", "ModelConfigError", "PRESETS", "preset_config", "LlamaForCausalLM"]
