"""Hugging Face <-> megatron-core (local layer spec) weight names and layouts. Pure: no megatron import.

    local_hf = {name: t[tp_slices(name, t.shape, rank=r, world=tp)] for name, t in hf.items()}  # this rank's TP shards
    mc = hf_to_megatron(local_hf, cfg, tp=2, pp=2, pp_rank=1)     # megatron-core names of stage 1, TP-local tensors
    back = megatron_to_hf(mc, cfg, tp=2, pp=2, pp_rank=1)          # == local_hf restricted to stage 1 (exact)

Both directions work on TENSOR-PARALLEL-LOCAL tensors: a rank converts its own shards and never
sees another rank's. HF TP shards follow parallel/sharding.py (q/k/v/gate/up and the vocab on
dim 0, o/down on dim 1), which is how megatron-core splits its fused tensors too:

- linear_qkv [(nq + 2 ng) d / tp, H]: for each KV group of this rank, the q rows of its nq/ng heads,
  then its k row block, then its v row block (the rank's groups are its HF q/k/v shards' heads);
- linear_fc1 [2 F / tp, H]: [this rank's gate rows; this rank's up rows];
- linear_proj, linear_fc2: the HF o/down TP shards as they are; norms replicated (Qwen3's per-head
  q_norm / k_norm [head_dim] -> self_attention.q_layernorm / k_layernorm, on every TP rank);
- decoder layer j of stage s is HF layer s * L / pp + j (megatron's even split; L % pp == 0).

A mixture of experts' sparse layer (Qwen3-MoE; megatron-core's MoE layer with SequentialMLP experts, experts
whole on each rank: expert_tensor_parallel_size 1): the router `mlp.gate.weight` [E, H] -> `mlp.router.weight`
(replicated over TP); the stacked experts this rank holds, `mlp.experts.gate_up_proj` [E_local, 2I, H] and
`mlp.experts.down_proj` [E_local, H, I] (E_local = E / ep: the expert-parallel rank's slice, as the native backend
holds it), -> `mlp.experts.local_experts.<e>.linear_fc1.weight` [2I, H] (gate rows then up rows, megatron's
swiglu order) and `.linear_fc2.weight` [H, I] for local expert e (megatron numbers them from 0 on every
expert-parallel rank). The post-attention norm is `pre_mlp_layernorm` as in a dense layer. The layer itself is
models/megatron_moe.py.

Tied embeddings: at pp = 1 the one `embedding.word_embeddings.weight` serves both HF names; at pp > 1
the last stage's `output_layer.weight` is its own copy under `lm_head.weight` (as the native stages do).
Value / reward heads keep the HF name `score.weight` (replicated over TP, last stage).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from models.config import ModelConfig, ModelConfigError

HEADS = ("lm", "value", "score")  # causal LM (output_layer), critic (score [1, H]), reward model (score [L, H])

_LAYER_HF = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
# Qwen3's per-head q/k RMSNorms: [head_dim] weights, replicated over TP (megatron-core's qk_layernorm, which
# it applies to q/k per head after the QKV split and before our core attention's RoPE, as HF does)
_QK_NORM_HF = {
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}


def _unfused_layer_names(cfg: ModelConfig, layer: int | None = None) -> dict[str, str]:
    """{HF name within a layer: megatron-core name within a layer} of the tensors that map one to one (a sparse
    layer: its router instead of the dense down projection)."""
    names = {**_LAYER_HF, **_QK_NORM_HF} if cfg.qk_norm else dict(_LAYER_HF)
    if layer is not None and cfg.is_moe_layer(layer):
        del names["mlp.down_proj.weight"]
        names["mlp.gate.weight"] = "mlp.router.weight"
    return names


_EXPERTS_HF = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_EXPERT_MC = ("linear_fc1.weight", "linear_fc2.weight")


def _local_experts(t: torch.Tensor, cfg: ModelConfig, ep: int, name: str) -> int:
    if cfg.num_experts % ep or t.shape[0] != cfg.num_experts // ep:
        raise ValueError(f"{name}: {t.shape[0]} experts held, and ep({ep}) of num_experts({cfg.num_experts}) gives "
                         f"{cfg.num_experts / ep:g} per expert-parallel rank")
    return t.shape[0]


def stage_layers(cfg: ModelConfig, *, pp: int, pp_rank: int) -> range:
    """Global (HF) layer indices of pipeline stage pp_rank: megatron-core's even split."""
    n = cfg.num_hidden_layers
    if n % pp:
        raise ModelConfigError(f"megatron backend: pp({pp}) must divide num_hidden_layers({n})")
    per = n // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def _check_tp(cfg: ModelConfig, tp: int) -> None:
    for what, n in (("num_key_value_heads", cfg.num_key_value_heads), ("vocab_size", cfg.vocab_size),
                    ("intermediate_size", cfg.intermediate_size)):
        if n % tp:
            raise ModelConfigError(f"megatron backend: tp({tp}) must divide {what}({n})")


def hf_names(cfg: ModelConfig, *, pp: int, pp_rank: int, head: str = "lm") -> list[str]:
    """HF parameter names held by stage pp_rank (tied heads: both names at pp=1, as named_parameters
    (remove_duplicate=False) lists them)."""
    if head not in HEADS:
        raise ValueError(f"head {head!r}: choose one of {HEADS}")
    first, last = pp_rank == 0, pp_rank == pp - 1
    names = ["model.embed_tokens.weight"] if first else []
    for i in stage_layers(cfg, pp=pp, pp_rank=pp_rank):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight"]
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        if cfg.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.qk_norm:
            names += [p + hf for hf in _QK_NORM_HF]
        names += [p + "self_attn.o_proj.weight", p + "post_attention_layernorm.weight"]
        if cfg.is_moe_layer(i):
            names += [p + "mlp.gate.weight"] + [p + x for x in _EXPERTS_HF]
        else:
            names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    if last:
        names.append("model.norm.weight")
        names.append("lm_head.weight" if head == "lm" else "score.weight")
    return names


def hf_to_megatron(local: Mapping[str, torch.Tensor], cfg: ModelConfig, *, tp: int, pp: int, pp_rank: int,
                   head: str = "lm", ep: int = 1) -> dict[str, torch.Tensor]:
    """This rank's HF TP shards (names of stage pp_rank; a mixture of experts' stacked experts: this
    expert-parallel rank's E / ep of them) -> {megatron-core name: local tensor}.

    Unfused tensors come back as the very same tensors, each expert's as a view of the stacked one; fused ones
    (qkv, fc1) are new.
    """
    _check_tp(cfg, tp)
    # at pp = 1 a tied head is the embedding itself; at pp > 1 the last stage reads its own copy
    tied_here = cfg.tie_word_embeddings and pp == 1
    missing = [n for n in hf_names(cfg, pp=pp, pp_rank=pp_rank, head=head)
               if n not in local and not (n == "lm_head.weight" and tied_here)]
    if missing:
        raise KeyError(f"stage {pp_rank} of {pp} needs HF tensors {missing[:4]} (+{max(len(missing) - 4, 0)} more)")
    first, last = pp_rank == 0, pp_rank == pp - 1
    ng = cfg.num_key_value_heads // tp
    out: dict[str, torch.Tensor] = {}
    if first:
        out["embedding.word_embeddings.weight"] = local["model.embed_tokens.weight"]
    for j, i in enumerate(stage_layers(cfg, pp=pp, pp_rank=pp_rank)):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{j}."
        for hf, mc in _unfused_layer_names(cfg, i).items():
            out[dst + mc] = local[src + hf]
        kinds = ("weight", "bias") if cfg.attention_bias else ("weight",)
        for kind in kinds:
            q, k, v = (local[src + f"self_attn.{x}_proj.{kind}"] for x in "qkv")
            groups = [t.reshape(ng, -1, *t.shape[1:]) for t in (q, k, v)]  # [ng, rows of one group, (H)]
            out[dst + f"self_attention.linear_qkv.{kind}"] = torch.cat(groups, dim=1).reshape(-1, *q.shape[1:])
        if cfg.is_moe_layer(i):
            for hf, mc in zip(_EXPERTS_HF, _EXPERT_MC):
                stacked = local[src + hf]
                for e in range(_local_experts(stacked, cfg, ep, src + hf)):
                    out[dst + f"mlp.experts.local_experts.{e}.{mc}"] = stacked[e]
            continue
        gate, up = local[src + "mlp.gate_proj.weight"], local[src + "mlp.up_proj.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
    if last:
        out["decoder.final_layernorm.weight"] = local["model.norm.weight"]
        if head != "lm":
            out["score.weight"] = local["score.weight"]
        elif not tied_here:
            out["output_layer.weight"] = local["lm_head.weight"]
    return out


def megatron_to_hf(mc: Mapping[str, torch.Tensor], cfg: ModelConfig, *, tp: int, pp: int, pp_rank: int,
                   head: str = "lm", ep: int = 1) -> dict[str, torch.Tensor]:
    """{megatron-core name: local tensor} of stage pp_rank -> this rank's HF TP shards.

    Unfused tensors are returned as the same tensors; q/k/v, gate/up are views of the fused tensor
    (q is a view only when the rank holds one KV group; else a copy); a sparse layer's local experts are stacked
    into this expert-parallel rank's E / ep rows (new tensors). Exact inverse of hf_to_megatron.
    """
    _check_tp(cfg, tp)
    first, last = pp_rank == 0, pp_rank == pp - 1
    ng = cfg.num_key_value_heads // tp
    rep, d = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
    out: dict[str, torch.Tensor] = {}
    if first:
        out["model.embed_tokens.weight"] = mc["embedding.word_embeddings.weight"]
    for j, i in enumerate(stage_layers(cfg, pp=pp, pp_rank=pp_rank)):
        src, dst = f"decoder.layers.{j}.", f"model.layers.{i}."
        for hf, name in _unfused_layer_names(cfg, i).items():
            out[dst + hf] = mc[src + name]
        kinds = ("weight", "bias") if cfg.attention_bias else ("weight",)
        for kind in kinds:
            fused = mc[src + f"self_attention.linear_qkv.{kind}"]
            g = fused.view(ng, (rep + 2) * d, *fused.shape[1:])
            q, k, v = g[:, : rep * d], g[:, rep * d: (rep + 1) * d], g[:, (rep + 1) * d:]
            for name, t in (("q", q), ("k", k), ("v", v)):
                out[dst + f"self_attn.{name}_proj.{kind}"] = t.reshape(-1, *fused.shape[1:])  # view iff ng == 1
        if cfg.is_moe_layer(i):
            for hf, name in zip(_EXPERTS_HF, _EXPERT_MC):
                experts = [mc[src + f"mlp.experts.local_experts.{e}.{name}"] for e in range(cfg.num_experts // ep)]
                out[dst + hf] = torch.stack(experts)
            continue
        fc1 = mc[src + "mlp.linear_fc1.weight"]
        f = fc1.shape[0] // 2
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = fc1[:f], fc1[f:]
    if last:
        out["model.norm.weight"] = mc["decoder.final_layernorm.weight"]
        if head != "lm":
            out["score.weight"] = mc["score.weight"]
        elif "output_layer.weight" in mc:
            out["lm_head.weight"] = mc["output_layer.weight"]
        else:  # tied at pp = 1: the embedding serves as the head
            out["lm_head.weight"] = mc["embedding.word_embeddings.weight"]
    return out
