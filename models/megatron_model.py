"""megatron-core `GPTModel` for the Llama family and Qwen3-MoE, built from our `ModelConfig`, with our attention.

    gpt = build_megatron_model(cfg, pg_collection=pgc, pre_process=True, post_process=True, head="lm")
    h = megatron_hidden(gpt, input_ids, position_ids, attn=DocumentAttention(position_ids))  # [T, B, H]

The local layer spec (no Transformer Engine needed) with its core attention replaced by
`ProjectCoreAttention`: megatron-core computes the fused QKV projection (and, for Qwen3, its per-head
q/k layernorms), hands us q/k/v as [T, B, heads, D], and we apply our RoPE (Llama-3 scaling included,
fp32 frequencies: the same cos/sin the native model uses, so on-policy ratios stay exactly 1) and run
the attention backend of models/llama.py (causal SDPA, packed / shared-prompt documents, varlen flash).
megatron's own RoPE is off (`position_embedding_type="none"`): it is CUDA-only and hard-codes Llama-3's frequency
factors. Row metadata reaches every layer through `RowParams`, a PackedSeqParams in "sbhd" format
(so megatron never takes its THD paths).

Heads: "lm" keeps GPTModel's output layer (tied to the embedding when the config says so), "value"
and "score" drop it and add `score` = Linear(H, 1 | num_labels) replicated over TP (HF name
`score.weight`). We never call GPTModel.forward: `megatron_hidden` returns final-normed hidden
states so log-probs come from the chunked vocab-parallel path (no [T, V] logits).
The process groups arrive in `pg_collection`: this module never reads megatron's globals.
A Qwen3-MoE model's sparse layers are megatron-core's MoE layer (models/megatron_moe.py): `megatron_hidden(...,
routing=trace)` routes them through a models.moe.RouterTrace, as the native model's forward does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.llama import apply_rotary, causal_attention, compute_inv_freq, rotary_cos_sin
from models.megatron_map import HEADS, stage_layers
from models.megatron_moe import (
    decoder_block_spec,
    finish_moe_layers,
    host_token_dispatch,
    moe_config_fields,
    set_routing,
)

try:  # importing megatron-core is optional for the rest of the project
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    HAVE_MEGATRON = True
except ImportError:  # pragma: no cover - exercised only without the extra
    HAVE_MEGATRON = False
    PackedSeqParams = object
    MegatronModule = nn.Module


def require_megatron() -> None:
    if not HAVE_MEGATRON:
        raise ImportError("backend: megatron needs megatron-core: pip install -e .[megatron] (megatron-core==0.16.1)")


@dataclasses.dataclass
class RowParams(PackedSeqParams):
    """Per-forward row metadata every layer's core attention reads: RoPE tables and the attention backend.

    cos/sin [B, 1, T, D] (models.llama.rotary_cos_sin); attn(layer_idx, q, k, v) over [B, H, T, D]."""

    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    attn: Any = None


class ProjectCoreAttention(MegatronModule):
    """Core attention with our RoPE and attention backends: q [T, B, nq, D], k/v [T, B, ng, D] -> [T, B, nq D]."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 cp_comm_type=None, softmax_scale=None, pg_collection=None, **_: Any):
        super().__init__(config=config)
        self.layer_idx = layer_number - 1  # megatron numbers layers from 1, globally across stages

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params: RowParams | None = None):
        if not isinstance(packed_seq_params, RowParams):
            raise ValueError("ProjectCoreAttention needs RowParams (use models.megatron_model.megatron_hidden)")
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [B, H, T, D]
        attn = packed_seq_params.attn or causal_attention
        if not getattr(attn, "applies_rope", False):
            q = apply_rotary(q, packed_seq_params.cos, packed_seq_params.sin)
            k = apply_rotary(k, packed_seq_params.cos, packed_seq_params.sin)
        out = attn(self.layer_idx, q, k, v)  # [B, nq, T, D]
        t, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(t, b, -1)


def transformer_config(cfg: ModelConfig, *, params_dtype: torch.dtype = torch.float32, pp: int = 1, ep: int = 1,
                       **overrides: Any) -> TransformerConfig:
    """TransformerConfig of a Llama-family model (RMSNorm, SwiGLU, GQA, no linear biases but q/k/v's); a Qwen3-MoE
    model's MoE fields too (models.megatron_moe.moe_config_fields, ep: expert-parallel ranks)."""
    require_megatron()
    half = params_dtype in (torch.bfloat16, torch.float16)
    kw = dict(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim, ffn_hidden_size=cfg.intermediate_size,
        layernorm_epsilon=cfg.rms_norm_eps, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=bool(cfg.attention_bias), hidden_dropout=0.0, attention_dropout=0.0,
        # Qwen3: finalize_model_grads sums the q/k layernorm grads over TP by this flag (each TP rank only
        # sees its own heads' contribution to the replicated [head_dim] weights)
        qk_layernorm=cfg.qk_norm,
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype if pp > 1 else None, pipeline_model_parallel_size=pp,
        # variable packed lengths per micro-batch; a dense model must name the alltoall dispatcher for that
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        # CPU init gives the same weights on every TP layout and needs no CUDA RNG tracker (weights are
        # overwritten by a checkpoint anyway); perform_initialization sets the TP attributes grad norms need
        use_cpu_initialization=True, perform_initialization=True, sequence_parallel=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        deallocate_pipeline_outputs=False, autocast_dtype=params_dtype if half else None,
    )
    kw.update(moe_config_fields(cfg, ep=ep))
    kw.update(overrides)
    return TransformerConfig(**kw)


def layer_spec(cfg: ModelConfig):
    """The local (Megatron-Core-only) layer spec with ProjectCoreAttention as its core attention.

    Qwen3 (cfg.qk_norm): q_layernorm / k_layernorm are torch.nn.RMSNorm([head_dim], eps=rms_norm_eps), run by
    SelfAttention.get_query_key_value_tensors on q [T, B, nq, D] / k [T, B, ng, D] right after the QKV split,
    so before ProjectCoreAttention rotates them: HF Qwen3's order (norm per head, then RoPE)."""
    require_megatron()
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=cfg.qk_norm)
    spec.submodules.self_attention.submodules.core_attention = ProjectCoreAttention
    return spec


def build_megatron_model(cfg: ModelConfig, *, pg_collection, pre_process: bool, post_process: bool,
                         head: str = "lm", params_dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu", seed: int = 0, **config_overrides: Any) -> nn.Module:
    """This rank's pipeline stage of `cfg` as a megatron-core GPTModel (parameters on `device`).

    pg_collection: megatron-core ProcessGroupCollection of the role's layout (tp, pp, cp, embd, ...).
    head: "lm" | "value" | "score" (see module docstring).
    """
    require_megatron()
    if head not in HEADS:
        raise ValueError(f"head {head!r}: choose one of {HEADS}")
    pp = pg_collection.pp.size()
    stage_layers(cfg, pp=pp, pp_rank=pg_collection.pp.rank())  # validates pp | num_layers
    if torch.device(device).type == "cuda" and "use_cpu_initialization" not in config_overrides:
        # initialise on the GPU (CPU init of 1B+ models is slow): megatron draws from its CUDA
        # RNG tracker, seeded per TP rank (a process singleton: only the seed offsets depend on the layout)
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        rng = torch.cuda.get_rng_state()  # it also reseeds the global CUDA generator: put that back afterwards
        model_parallel_cuda_manual_seed(seed, tp_rank=pg_collection.tp.rank(), ep_rank=0, etp_rank=0)
        config_overrides["use_cpu_initialization"] = False
    else:
        rng = None
    tconf = transformer_config(cfg, params_dtype=params_dtype, pp=pp, ep=pg_collection.ep.size(), **config_overrides)
    tied = head == "lm" and cfg.tie_word_embeddings
    if tied and pp > 1 and not torch.cuda.is_available():
        # GPTModel syncs the last stage's copy of a tied head with `.cuda()` + all-reduce at construction
        raise ValueError("megatron backend: a tied-embedding model at pp > 1 needs CUDA (megatron-core moves the "
                         "shared head to the GPU while building); use pp=1 on CPU")
    spec = layer_spec(cfg)
    if cfg.is_moe:  # a mixture of experts: per-layer specs, megatron's MoE layer in the sparse ones
        spec = decoder_block_spec(cfg, spec, pp=pp, pp_rank=pg_collection.pp.rank())
    with host_token_dispatch():
        gpt = GPTModel(config=tconf, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                       max_sequence_length=cfg.max_position_embeddings, pre_process=pre_process,
                       post_process=post_process, parallel_output=True, share_embeddings_and_output_weights=tied,
                       position_embedding_type="none", pg_collection=pg_collection)
    gpt.moe_routers = finish_moe_layers(gpt) if cfg.is_moe else []
    if head != "lm" and post_process:
        del gpt.output_layer  # the vocab head is replaced by a small score head
        gpt.output_layer = None
        width = 1 if head == "value" else cfg.num_labels
        gpt.score = nn.Linear(cfg.hidden_size, width, bias=False, dtype=params_dtype)
        nn.init.zeros_(gpt.score.weight)  # a zero value head: every value starts at 0 (models/heads.py)
    if rng is not None:
        torch.cuda.set_rng_state(rng)
    gpt.hf_config = cfg
    gpt.head_kind = head
    return gpt.to(device)


def row_params(gpt: nn.Module, position_ids: torch.Tensor, dtype: torch.dtype, *, attn=None) -> RowParams:
    """RowParams for [B, T] positions: fp32-computed cos/sin cast to the activation dtype."""
    inv_freq = compute_inv_freq(gpt.hf_config).to(position_ids.device)  # fp32 always (see LlamaModel)
    cos, sin = rotary_cos_sin(inv_freq, position_ids, dtype)
    return RowParams(qkv_format="sbhd", cos=cos, sin=sin, attn=attn)


def megatron_hidden(gpt: nn.Module, input_ids: torch.Tensor | None, position_ids: torch.Tensor, *,
                    attn=None, hidden_in: torch.Tensor | None = None, routing=None) -> torch.Tensor:
    """One pipeline stage: [B, T] ids (first stage) or the previous stage's [T, B, H] -> [T, B, H].

    The last stage returns final-normed hidden states (no head applied). Without `hidden_in` a later
    stage reads what megatron's schedule put there with `set_input_tensor`. routing: a mixture of experts'
    models.moe.RouterTrace for this forward's MoE layers (None: their own routing, nothing recorded).
    """
    set_routing(gpt, routing)
    if gpt.pre_process:
        x = gpt.embedding(input_ids=input_ids, position_ids=None)
    else:
        if hidden_in is not None:
            gpt.set_input_tensor(hidden_in)
        x = None
    dtype = gpt.config.params_dtype
    params = row_params(gpt, position_ids, dtype, attn=attn)
    return gpt.decoder(hidden_states=x, attention_mask=None, packed_seq_params=params)


def head_weight(gpt: nn.Module) -> torch.Tensor:
    """[V / tp, H] head rows of this rank (the shared embedding when tied at pp = 1), last stage only."""
    if gpt.output_layer is not None and not gpt.share_embeddings_and_output_weights:
        return gpt.output_layer.weight
    return gpt.shared_embedding_or_output_weight()


