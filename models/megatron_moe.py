"""megatron-core's MoE layer for Qwen3-MoE's sparse layers: its router, alltoall token dispatcher and SequentialMLP
experts (the local spec: no Transformer Engine, no grouped-GEMM package), with routing through `models.moe.RouterTrace`.

    kw = moe_config_fields(cfg, ep=2)                    # TransformerConfig fields (num_moe_experts, ...)
    spec = decoder_block_spec(cfg, dense_layer_spec, pp=1, pp_rank=0)  # per-layer specs: dense or MoE
    with host_token_dispatch():                          # building on a machine without CUDA
        gpt = GPTModel(config, spec, ...)
    routers = finish_moe_layers(gpt)                     # CPU dispatch; the stage's TraceRouters
    set_routing(gpt, trace)                              # before each forward (models.megatron_model.megatron_hidden)

Routing equals the native `models.moe.SparseMoeBlock.route`: with norm_topk_prob megatron's top-k of the logits then a
softmax over them (`moe_router_pre_softmax=False`, moe_utils.topk_routing_with_score_function) is the renormalised top-k
of the full softmax; without it, the softmax then top-k (`moe_router_pre_softmax=True`). The router is `TraceRouter`,
megatron's TopKRouter with two changes: its gating is a plain linear in the activations' dtype (megatron's
RouterGatingLinearFunction reads `te_general_gemm`, a name bound only when Transformer Engine imports: a NameError
without it, moe_utils.py:1192; and `Router.gating` moves CPU weights to CUDA, router.py:88), and its top-k goes
through megatron's router-replay hook (`router_replay.get_replay_topk`) with the forward's RouterTrace instead of
megatron's process-wide `RouterReplay` list: it records the experts, counts mismatches against the engine's records
and replays them when asked, as the native layer does. megatron's own load-balancing loss stays off
(`moe_router_load_balancing_type="none"`): it is per layer and divided by top-k, another loss than Hugging Face's
(pooled over all layers); the trace keeps the statistics and the runner adds the Hugging Face loss, as the native
backend does (parallel.runner.add_router_loss).

CPU: MoEAlltoAllTokenDispatcher creates a `torch.cuda.Stream` when built (token_dispatcher.py:445) and copies its
split sizes to the host on it (`_maybe_dtoh_and_synchronize`, token_dispatcher.py:871): without CUDA the stream is a
placeholder and the splits, already on the host, are read directly (`HostSplits`). On CUDA megatron's own path runs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from models.config import ModelConfig
from models.megatron_map import stage_layers
from models.mixin import with_mixin
from models.moe import RouterTrace

try:
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
except ImportError:  # pragma: no cover - megatron-core is an optional extra
    TopKRouter = object


def moe_config_fields(cfg: ModelConfig, *, ep: int = 1) -> dict:
    """TransformerConfig fields of a Qwen3-MoE model (empty for a dense one)."""
    if not cfg.is_moe:
        return {}
    return dict(
        num_moe_experts=cfg.num_experts, moe_router_topk=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_layer_freq=[int(cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers)],
        # norm_topk_prob: softmax over the k largest logits == the full softmax's top-k renormalised
        moe_router_pre_softmax=not cfg.norm_topk_prob, moe_router_score_function="softmax",
        # the Hugging Face load-balancing loss is added by the runner from the trace (module docstring)
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, moe_permute_fusion=False,
        moe_router_fusion=False, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
    )


class _TraceTopK:
    """megatron's router-replay hook (`get_replay_topk`) backed by one forward's RouterTrace for one layer."""

    def __init__(self, trace: RouterTrace, layer: int):
        self.trace, self.layer = trace, layer

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        """scores [N, E] (logits; probabilities with pre-softmax) -> (their top-k values [N, k], expert ids [N, k])."""
        top, ids = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        trace = self.trace
        recorded = trace.recorded.get(self.layer) if trace.recorded else None
        if recorded is not None:
            trace._count_mismatch(ids, recorded)
            if trace.replay:  # the engine's experts, scored by this router
                ids = torch.where(recorded >= 0, recorded.to(ids.dtype), ids)
                top = scores.gather(1, ids)
        if trace.keep_choice:
            trace.chosen[self.layer] = ids.to(torch.int32)
        return top, ids


class TraceRouter(TopKRouter):
    """megatron's TopKRouter with a plain-linear gating and the forward's RouterTrace (see module docstring).

    `trace` is set by set_routing before each forward (None: megatron's routing alone, nothing recorded)."""

    trace: RouterTrace | None = None

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return F.linear(input.to(dtype), self.weight.to(dtype))

    def routing(self, logits: torch.Tensor, padding_mask=None):
        """logits [T, B, E] -> (probs [T B, E] zero off the chosen experts, routing_map [T B, E] bool)."""
        logits = logits.reshape(-1, self.config.num_moe_experts)
        trace, layer = self.trace, self.layer_number - 1  # megatron numbers layers from 1, across stages
        probs, routing_map = topk_routing_with_score_function(
            logits, self.topk, use_pre_softmax=self.config.moe_router_pre_softmax, score_function="softmax",
            router_replay=_TraceTopK(trace, layer) if trace is not None else None)
        if trace is not None:  # the load-balancing statistics, as models.moe.SparseMoeBlock.route keeps them
            full = torch.softmax(logits, dim=-1, dtype=torch.float32)
            trace.aux_stats[layer] = (routing_map.sum(0).float(), full.sum(0), logits.shape[0])
            if trace.keep_logits:
                trace.logits[layer] = logits
        return probs, routing_map


class _HostStream:
    """Placeholder for the dispatcher's device-to-host stream on a machine without CUDA."""


class HostSplits:
    """Mixin for MoEAlltoAllTokenDispatcher: without CUDA its split sizes are host tensors already, read directly."""

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if torch.cuda.is_available():
            return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)
        if self.drop_and_pad or point != self.cuda_dtoh_point:
            return tokens_per_expert
        # as numpy arrays, as megatron's own copy leaves them (maybe_move_tensor_to_cpu converts CUDA tensors only)
        splits = (self.input_splits, self.output_splits, self.output_splits_tp)
        self.input_splits, self.output_splits, self.output_splits_tp = (
            t.numpy() if torch.is_tensor(t) else t for t in splits)
        return tokens_per_expert


@contextlib.contextmanager
def host_token_dispatch():
    """Build MoE layers on a machine without CUDA: the alltoall dispatcher's device-to-host stream (a class attribute
    megatron creates on first use) is a placeholder for the block. No effect where CUDA is available."""
    if torch.cuda.is_available() or MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is not None:
        yield
        return
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _HostStream()
    try:
        yield
    finally:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None


def finish_moe_layers(gpt) -> list[TraceRouter]:
    """After building: each alltoall dispatcher reads host splits without CUDA (HostSplits). Returns the routers."""
    routers = []
    for m in gpt.modules():
        if isinstance(m, MoELayer):
            if isinstance(m.token_dispatcher, MoEAlltoAllTokenDispatcher) and not isinstance(m.token_dispatcher,
                                                                                             HostSplits):
                with_mixin(m.token_dispatcher, HostSplits)
            if not isinstance(m.router, TraceRouter):
                raise TypeError(f"MoE layer {m.layer_number}: router {type(m.router).__name__}, expected TraceRouter")
            routers.append(m.router)
    return routers


def is_moe_layer(layer) -> bool:
    """A megatron TransformerLayer whose MLP is megatron-core's MoE layer."""
    return isinstance(getattr(layer, "mlp", None), MoELayer)


def set_routing(gpt, trace: RouterTrace | None) -> None:
    """The RouterTrace every MoE layer of the stage uses in the next forward (None: none). It stays set until the
    next call: megatron's full recompute at pp = 1 re-runs a micro-batch's layers in its backward, before the next
    micro-batch's forward."""
    for router in getattr(gpt, "moe_routers", ()):
        router.trace = trace


def decoder_block_spec(cfg: ModelConfig, dense_spec, *, pp: int, pp_rank: int):
    """TransformerBlockSubmodules of stage pp_rank: the dense layer spec, or for each sparse layer (Hugging Face's
    rule, ModelConfig.is_moe_layer) the same spec with megatron's MoE layer (local experts: SequentialMLP) routed by
    TraceRouter."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    moe_spec = copy.deepcopy(dense_spec)
    moe_mlp = get_gpt_layer_local_spec(num_experts=cfg.num_experts, moe_grouped_gemm=False, normalization="RMSNorm",
                                       qk_layernorm=cfg.qk_norm).submodules.mlp
    moe_mlp.submodules.router = TraceRouter
    moe_spec.submodules.mlp = moe_mlp
    layers = [moe_spec if cfg.is_moe_layer(i) else dense_spec for i in stage_layers(cfg, pp=pp, pp_rank=pp_rank)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=LayerNormImpl)
