"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3 dense, Qwen3-MoE, Mistral) with Hugging Face parameter names.

Qwen3-MoE layers carry models/moe.py's SparseMoeBlock as `mlp`; a `routing` RouterTrace passed to the forward
(like `attn`) replays and records their expert choices. Dense models never see it.

Single-device definition; parallel/ applies TP/PP/FSDP to it. Every tensor-parallel
sensitive reshape uses -1 for the head count, so a DTensor-sharded q/k/v projection
(local heads = heads / tp) runs through the same code.

Attention is pluggable and explicit (docs/design.md, convention 7): `forward(..., attn=backend)` where
`backend(layer_idx, q, k, v) -> out` with q [B, Hq, T, D], k/v [B, Hkv, T, D] after
RoPE (Qwen3: after its per-head q/k RMSNorm, then RoPE) and out [B, Hq, T, D]. The default
is causal SDPA; models/document_attention.py's `DocumentAttention` handles packed rows; the rollout engine
passes its KV-cache backend.

Pipeline stages are made by setting `model.embed_tokens`, `model.norm` or `lm_head`
to None and deleting entries of the `model.layers` ModuleDict (keys stay the global
layer indices, so parameter names stay Hugging Face names).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.moe import GroupedExperts, RouterTrace, SparseMoeBlock


class AttentionBackend(Protocol):
    """attn(layer_idx, q, k, v) -> out over [B, H, T, D]. A backend whose `applies_rope` attribute is true
    (the engine's Triton decode kernel) takes q and k before RoPE and rotates them itself."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def causal_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over [B, H, T, D]; GQA handled by SDPA."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 and scale in the input dtype, as Hugging Face does (bit-compatible)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def compute_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies [D/2], with the llama3 long-context scaling when configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor = rs["factor"]
        low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_len = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rotary_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype):
    """[B, T] positions -> cos, sin of shape [B, 1, T, D] in `dtype` (computed in fp32)."""
    freqs = position_ids[..., None].float() * inv_freq.float().to(position_ids.device)  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        # Qwen3: one RMSNorm over head_dim shared by all q heads (and one by all k heads), applied before
        # RoPE; [D] weights, so tensor parallelism replicates them
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: the local head count under tensor parallelism
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:  # before RoPE, also when the attention backend rotates q/k itself
            q, k = self.q_norm(q), self.k_norm(k)
        if not getattr(attn, "applies_rope", False):
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.sparse = cfg.is_moe_layer(layer_idx)  # Qwen3-MoE: this layer's MLP is a mixture of experts
        self.mlp = SparseMoeBlock(cfg, layer_idx) if self.sparse else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend,
                routing: RouterTrace | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        if self.sparse and routing is not None:  # an MoE layer's forward with a trace (dense models pass none)
            return x + self.mlp(self.post_attention_layernorm(x), routing)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The trunk: embeddings, decoder layers, final norm. Any of them may be absent (PP)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", compute_inv_freq(cfg), persistent=False)

    def __setattr__(self, name, value):
        # RoPE frequencies stay fp32 whatever is assigned: a bf16 copy would put rounded angles into one
        # engine (e.g. the rollout's) and exact ones into the trainer, so PPO's on-policy ratio != 1
        if name == "inv_freq" and isinstance(value, torch.Tensor) and value.dtype != torch.float32:
            value = compute_inv_freq(self.config).to(value.device)
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        # .to(bf16) would round the RoPE frequencies (angle errors of tens of radians at position 4k) and
        # to_empty() would leave them uninitialised: recompute them in fp32 on the new device instead
        super()._apply(fn, recurse)
        self.inv_freq = compute_inv_freq(self.config).to(self.inv_freq.device)
        return self

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        attn: AttentionBackend | None = None,
        routing: RouterTrace | None = None,
    ) -> torch.Tensor:
        """x: token ids [B, T] (first stage) or hidden states [B, T, H] -> hidden [B, T, H]. routing: an MoE
        model's RouterTrace over the B * T tokens (replayed experts in, choices and load statistics out)."""
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        b, t = h.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(t, device=h.device).expand(b, t)
        if attn is None:
            attn = causal_attention
        cos, sin = rotary_cos_sin(self.inv_freq, position_ids, h.dtype)
        if routing is None:
            for layer in self.layers.values():
                h = layer(h, cos, sin, attn)
        else:
            for layer in self.layers.values():
                h = layer(h, cos, sin, attn, routing)
        return self.norm(h) if self.norm is not None else h


class LlamaForCausalLM(nn.Module):
    """`model(input_ids, position_ids=None) -> logits [B, T, V]`; HF names `model.*`, `lm_head.*`."""

    hf_architecture = "ForCausalLM"  # config.json architectures = [<Family>ForCausalLM]

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head's weight with the embedding when the config ties them (Qwen2-0.5B style); call
        again after anything that re-creates parameters (`to_empty`). No-op on a pipeline stage that lacks
        either module: there the stage that has lm_head holds its own copy (see models/hf_io.py)."""
        if self.config.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(self, input_ids, position_ids=None, *, attn=None, routing=None) -> torch.Tensor:
        if routing is None:
            return self.model(input_ids, position_ids, attn=attn)
        return self.model(input_ids, position_ids, attn=attn, routing=routing)

    def forward(self, input_ids, position_ids=None, *, attn=None, routing=None) -> torch.Tensor:
        h = self.hidden_states(input_ids, position_ids, attn=attn, routing=routing)
        return self.lm_head(h) if self.lm_head is not None else h


def init_weights(model: nn.Module, *, std: float = 0.02, seed: int | None = None) -> None:
    """Random initialisation like Hugging Face's `_init_weights` (normal(0, std), norms at 1)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for mod in model.modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            w = torch.empty(mod.weight.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            with torch.no_grad():
                mod.weight.copy_(w)
            if getattr(mod, "bias", None) is not None:
                with torch.no_grad():
                    mod.bias.zero_()
        elif isinstance(mod, GroupedExperts):
            for p in (mod.gate_up_proj, mod.down_proj):
                w = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
                with torch.no_grad():
                    p.copy_(w)
        elif isinstance(mod, RMSNorm):
            with torch.no_grad():
                mod.weight.fill_(1.0)
