"""Llama-family models with Hugging Face names: `from models import load_pretrained, build_model`."""

from models.build import build_model
from models.config import PRESETS, ModelConfig, ModelConfigError, preset_config
from models.document_attention import DocumentAttention
from models.heads import LlamaForSequenceClassification, LlamaForValue, last_token_index
from models.hf_io import (
    load_pretrained,
    load_tensors,
    load_weights,
    read_config,
    save_pretrained,
    save_tensors,
    tensor_shapes,
)
from models.llama import LlamaForCausalLM
from models.logprobs import compute_token_logprobs

__all__ = [
    "build_model", "ModelConfig", "ModelConfigError", "PRESETS", "preset_config", "LlamaForCausalLM",
    "DocumentAttention", "LlamaForValue", "LlamaForSequenceClassification", "last_token_index",
    "load_pretrained", "load_tensors", "load_weights", "read_config", "save_pretrained", "save_tensors",
    "tensor_shapes", "compute_token_logprobs",
]
