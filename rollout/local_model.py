"""The engine's own copy of the model: a plain-tensor LlamaForCausalLM built with LOCAL sizes (heads,
intermediate and vocab divided by tp), tensor-parallel through explicit collectives on `tp_group`.

All-reduce after o_proj and down_proj (row parallel), a vocab-parallel embedding; the runner
all-gathers the local-vocab logits so every rank samples the same token (no DTensor: too slow and not
graph-capturable). Weights arrive by Hugging Face name as this rank's shard (parallel/sharding.py).
A mixture of experts' layers run their models/moe.py blocks as they are (stacked experts, grouped GEMMs;
rollout tp 1 only). q/k/v and gate/up run as one GEMM each (FusedQKVAttention / FusedGateUpMLP, the HF-named parameters
being views of the fused weight), reusing llama.py's RoPE; Qwen3's per-head q/k norms (replicated
under TP) run once over the fused q|k heads, before RoPE. With fold_norms the layers carry their RMSNorm
weights inside those fused weights and run no norm kernel (rollout/folded_norms.py).

    model = build_local_model(cfg, tp=2, tp_rank=r, tp_group=g, device="cuda", dtype=torch.bfloat16)
    groups = fuse_projections(model, device="cuda", dtype=torch.bfloat16, fold_norms=True)  # re-bind on reload
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.llama import MLP, Attention, LlamaForCausalLM, RMSNorm, apply_rotary, compute_inv_freq
from rollout.engine_lora import lora_delta
from rollout.folded_norms import FoldedDecoderLayer, fold_weight, foldable


class RowParallelLinear(nn.Linear):
    """Linear over this rank's slice of the input features; partial sums all-reduced over the TP group. A LoRA
    adapter (rollout/engine_lora.py: A split by input columns like W) adds its partial sum before the reduce."""

    lora: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, in_features: int, out_features: int, *, group):
        super().__init__(in_features, out_features, bias=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.lora is not None:
            y = y + lora_delta(x, self.lora)
        dist.all_reduce(y, group=self.group)
        return y


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + num_embeddings) of the table; other ids give 0, summed over TP."""

    def __init__(self, num_embeddings: int, dim: int, *, vocab_start: int, group):
        super().__init__(num_embeddings, dim)
        self.vocab_start, self.group = vocab_start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        dist.all_reduce(out, group=self.group)
        return out


class FusedQKVAttention(Attention):
    """models/llama.py's Attention with q/k/v as ONE GEMM: q_proj/k_proj/v_proj weights are views of
    `qkv_weight`, so HF-named loading fills it (bigger GEMMs run closer to peak at decode batch sizes).
    `qkv_lora`: the fused LoRA adapter of the targeted members (rollout/engine_lora.py), or None."""

    qkv_lora: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        return self.o_proj(self.heads(self.qkv(x), cos, sin, attn))

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """The fused q|k|v GEMM's output, its adapter added."""
        out = F.linear(x, self.qkv_weight, self.qkv_bias)
        return out if self.qkv_lora is None else out + lora_delta(x, self.qkv_lora)

    def heads(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn, **norm) -> torch.Tensor:
        """qkv [B, T, (Hq + 2 Hkv) D] (the fused GEMM's output) -> attention output [B, T, Hq D], before o_proj.
        `norm` (norm_x, eps) goes to a backend that applies the input norm's row scale itself (folded_norms)."""
        b, t, _ = qkv.shape
        nq, nk, _ = self.qkv_split
        # q and k are adjacent in the fused output: one RoPE over both heads (half the small kernels), or
        # none here when the attention kernel rotates them itself (the Triton decode kernel)
        qk = qkv[..., : nq + nk].view(b, t, -1, self.head_dim).transpose(1, 2)
        hq = nq // self.head_dim
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm before RoPE (also before the kernel's RoPE)
            qk = self._qk_norm(qk, hq)
        if not getattr(attn, "applies_rope", False):
            qk = apply_rotary(qk, cos, sin)
        v = qkv[..., nq + nk:].view(b, t, -1, self.head_dim).transpose(1, 2)
        out = attn(self.layer_idx, qk[:, :hq], qk[:, hq:], v, **norm)
        return out.transpose(1, 2).reshape(b, t, -1)

    def _qk_norm(self, qk: torch.Tensor, hq: int) -> torch.Tensor:
        """q_norm over the first hq heads of qk [B, Hq + Hkv, T, D], k_norm over the rest, as one normalise
        and one scale (llama.py's RMSNorm formula: fp32 normalise, scale in the input dtype)."""
        normed = F.rms_norm(qk.float(), (self.head_dim,), eps=self.q_norm.eps).to(qk.dtype)
        d, hk = self.head_dim, qk.shape[1] - hq
        scale = torch.cat((self.q_norm.weight.expand(hq, d), self.k_norm.weight.expand(hk, d)))
        return normed * scale[:, None, :]


class FusedRMSNorm(RMSNorm):
    """llama.py's RMSNorm (fp32 normalise, scale in the input dtype) through F.rms_norm: same formula,
    fewer kernels per norm in the eager/graphed decode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class FusedGateUpMLP(MLP):
    """models/llama.py's MLP with gate/up as one GEMM over `gate_up_weight` (views, as above), and its fused
    LoRA adapter `gate_up_lora` or None."""

    gate_up_lora: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.gate_up_weight)
        return out if self.gate_up_lora is None else out + lora_delta(x, self.gate_up_lora)


@dataclass(slots=True)
class FusedGroup:
    module: nn.Module
    attr: str  # the module attribute holding the fused tensor
    members: list[nn.Parameter]  # views of it, concatenated along dim 0
    shapes: list[tuple[int, ...]]
    norm: nn.Parameter | None = None  # an RMSNorm weight folded into the members' columns (folded_norms)

    def bind(self, *, device, dtype) -> None:
        """(Re)allocate the fused tensor and point every member parameter at its slice."""
        fused = torch.empty(sum(s[0] for s in self.shapes), *self.shapes[0][1:], device=device, dtype=dtype)
        start = 0
        for p, shape in zip(self.members, self.shapes):
            p.data = fused[start: start + shape[0]]
            start += shape[0]
        setattr(self.module, self.attr, fused)

    def fold(self, members: list[nn.Parameter]) -> None:
        """Fold the norm weight into `members` (as loaded, unfolded) in place."""
        for p in members:
            fold_weight(p.data, self.norm.data)

    def drop(self, *, device, dtype) -> None:
        for p in self.members:
            p.data = torch.empty(0, device=device, dtype=dtype)
        setattr(self.module, self.attr, None)


def fuse_projections(model: LlamaForCausalLM, *, device, dtype, fold_norms: bool = False) -> list[FusedGroup]:
    """Swap norms, attention and MLPs to the fused variants; returns the weight groups to (re)bind on load.
    fold_norms: layers that allow it (folded_norms.foldable) become FoldedDecoderLayers, their groups carrying
    the norm weight the loader folds in (EngineModelRunner.finish_loading)."""
    groups = []
    for mod in model.modules():
        if type(mod) is RMSNorm:
            mod.__class__ = FusedRMSNorm
    for layer in model.model.layers.values():
        a, m = layer.self_attn, layer.mlp
        fold = fold_norms and foldable(layer)
        if fold:
            layer.__class__ = FoldedDecoderLayer
        projs = (a.q_proj, a.k_proj, a.v_proj)
        a.__class__ = FusedQKVAttention
        a.qkv_split = [lin.out_features for lin in projs]
        a.qkv_bias = None
        members = [(a, "qkv_weight", [lin.weight for lin in projs], layer.input_layernorm.weight)]
        if not layer.sparse:  # a mixture of experts' gate and up projections are stacked already
            m.__class__ = FusedGateUpMLP
            members.append((m, "gate_up_weight", [m.gate_proj.weight, m.up_proj.weight],
                            layer.post_attention_layernorm.weight))
        if projs[0].bias is not None:
            members.append((a, "qkv_bias", [lin.bias for lin in projs], None))
        for mod, attr, params, norm in members:
            group = FusedGroup(mod, attr, params, [tuple(p.shape) for p in params], norm if fold else None)
            group.bind(device=device, dtype=dtype)
            groups.append(group)
    return groups


def build_local_model(cfg: ModelConfig, *, tp: int, tp_rank: int, tp_group, device, dtype) -> LlamaForCausalLM:
    """LlamaForCausalLM holding rank tp_rank's shards (uninitialised weights; load them by name)."""
    if cfg.is_moe and tp > 1:
        raise ValueError(f"rollout tp({tp}) > 1 with a mixture of experts: the native engine runs experts whole on "
                         "each rank; use rollout tp 1 (validation refuses this before launch)")
    for name, size in (("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads",
                       cfg.num_key_value_heads), ("intermediate_size", cfg.intermediate_size),
                       ("vocab_size", cfg.vocab_size)):
        if size % tp:
            raise ValueError(f"rollout tp({tp}) must divide {name}({size})")
    local = dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp,
                                num_key_value_heads=cfg.num_key_value_heads // tp,
                                intermediate_size=cfg.intermediate_size // tp,
                                vocab_size=cfg.vocab_size // tp, head_dim=cfg.head_dim)
    with torch.device("meta"):
        model = LlamaForCausalLM(local)
        if tp > 1:
            for layer in model.model.layers.values():
                layer.self_attn.o_proj = RowParallelLinear(local.num_attention_heads * cfg.head_dim,
                                                           cfg.hidden_size, group=tp_group)
                layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, cfg.hidden_size, group=tp_group)
            model.model.embed_tokens = VocabParallelEmbedding(local.vocab_size, cfg.hidden_size,
                                                              vocab_start=tp_rank * local.vocab_size, group=tp_group)
            if cfg.tie_word_embeddings:
                model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(dtype=dtype).to_empty(device=device)
    # the non-persistent RoPE buffer is garbage after to_empty; cast like build_model so logits match
    model.model.inv_freq = compute_inv_freq(cfg).to(device=device, dtype=dtype)
    return model.eval().requires_grad_(False)
