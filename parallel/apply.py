"""`parallelize_model`: the one entry point that turns a single-device model into its 3-D layout.

    mesh = build_mesh(dims, ranks, device_type="cuda")          # dims ("pp", "dp", "tp")
    runner = parallelize_model(model, mesh=mesh, dims=dims, ac="selective", compile=True,
                               param_dtype=torch.bfloat16)      # pp == 1: a LocalRunner
    runner = parallelize_model(model, mesh=mesh, dims=ParallelDims(tp=2, pp=2, dp=2),
                               n_microbatches=8)                # pp > 1: a PipelineRunner
    # both are parallel.runner.ModelRunner: callers never branch on the layout

Order (as in torchtitan): pipeline split -> tensor parallel -> activation checkpointing
-> per-layer torch.compile -> FSDP2 (compile with ac="full" checkpoints around the compiled
layer body instead: see apply_compile_then_full_ac). TP is applied only when tp > 1 (at size 1 it is
pure DTensor dispatch overhead; `apply_tp` itself works on a size-1 mesh); FSDP is
applied when dp > 1 (or asked for). Mixed precision (`param_dtype`) is FSDP2's when it shards (fp32
sharded masters, bf16 compute copies) and megatron's layout when it does not (bf16 weights, fp32
main grads, fp32 masters in the optimizer: parallel/master_weights.py).

Loss code that wants hidden states instead of logits (chunked log-probs: no [N, V] fp32
tensor) calls `parallel.runner.forward_hidden(model, ids, pos)`, which goes through `nn.Module.__call__`
so FSDP's root hooks gather the embedding/head, then `head_shard(model)` for the local
vocab slice of the head to hand to parallel.vocab_parallel.vocab_parallel_token_logprobs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from models.lora import LoRASpec
from models.mixin import with_mixin
from parallel.dims import ParallelDims
from parallel.expert_parallel import ExpertParallel, apply_ep
from parallel.fsdp import apply_fsdp
from parallel.lora import apply_lora
from parallel.master_weights import attach_main_grads
from parallel.native_runner import LocalRunner
from parallel.pipeline import PipelineRunner, build_stages
from parallel.runner import ModelRunner
from parallel.tensor_parallel import apply_tp

AC_MODES = ("none", "full", "selective")


def _selective_policy():
    """Save matmul and attention outputs; recompute the cheap pointwise ops (norms, RoPE, SiLU)."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_flash_attention_forward"):
        if hasattr(aten, name):
            save.add(getattr(aten, name).default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _checkpointed_forward(forward: Callable, context_fn: Callable | None, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def apply_ac(model: nn.Module, mode: str = "full") -> nn.Module:
    """Activation checkpointing per decoder layer, in place; parameter names are unchanged.

    full: keep only each layer's input, recompute the layer in backward (~1/3 more FLOPs).
    selective: keep matmul/attention outputs, recompute pointwise ops (little extra compute).
    """
    if mode not in AC_MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; choose one of {AC_MODES}")
    if mode == "none":
        return model
    context_fn = None
    if mode == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy())
    for layer in model.model.layers.values():
        # a mixed-in class instead of a wrapper module keeps the Hugging Face names, and instead of an instance
        # forward keeps one compiled graph for every layer (models.mixin)
        layer._ac_context_fn = context_fn
        with_mixin(layer, Checkpointed)
    return model


class Checkpointed(nn.Module):
    """A decoder layer whose forward runs under activation checkpointing (apply_ac mixes it in; the layer's
    `_ac_context_fn`: selective AC's policy contexts, or None for full recompute)."""

    def forward(self, *args, **kwargs):
        return _checkpointed_forward(super().forward, self._ac_context_fn, *args, **kwargs)


def _allow_per_layer_recompiles(model: nn.Module) -> None:
    # the layers share their cache entries (their forwards are class attributes: models.mixin), a handful in
    # all (the first layer's input without a gradient, adapters switched off for the reference, grad mode); the
    # limit is raised anyway so that a guard that does differ per layer costs compile time, never drops the
    # later layers to eager at the default limit of 8
    lora = any(hasattr(m, "lora_A") for m in model.model.layers.modules())
    n = len(model.model.layers) * (2 if lora else 1) + 8
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), n))


def apply_compile(model: nn.Module, *, dynamic: bool | None = None) -> nn.Module:
    """torch.compile each decoder layer in place (the layers share one compiled graph when their guards allow).
    dynamic=True compiles shape-generic graphs up front (packed RL micro-batches change length every call:
    with the default, the second length recompiles); None lets Dynamo decide."""
    _allow_per_layer_recompiles(model)
    for layer in model.model.layers.values():
        layer.compile(fullgraph=False, dynamic=dynamic)
    return model


def apply_compile_then_full_ac(model: nn.Module, *, dynamic: bool | None = None) -> nn.Module:
    """Full activation checkpointing *around* each compiled layer body (compile + ac="full").

    Checkpointing inside a compiled layer fails for DTensor TP layers in torch 2.13 (the
    checkpoint saves a DeviceMesh); compiling the body and checkpointing the call works for all
    layouts and recomputes exactly the same thing.
    """
    _allow_per_layer_recompiles(model)
    for layer in model.model.layers.values():
        body = torch.compile(layer.forward, dynamic=dynamic)  # the class forward, bound to this layer
        layer.forward = functools.partial(_checkpointed_forward, body, None)
    return model


def _should_fsdp(dims: ParallelDims, fsdp: bool | None) -> bool:
    return fsdp if fsdp is not None else dims.dp > 1


def _apply_local(model: nn.Module, *, mesh, dims: ParallelDims, ac: str, compile: bool, dynamic: bool | None,
                 param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                 loss_parallel: bool, fsdp: bool | None, lora: LoRASpec | None = None,
                 lora_seed: int = 0, expert_mesh=None) -> tuple[nn.Module, ExpertParallel | None]:
    sharded = _should_fsdp(dims, fsdp)
    if param_dtype is not None and (not sharded or lora is not None):
        # (a LoRA base is frozen: stored in the compute dtype under FSDP too, with no fp32 sharded masters)
        # mixed precision with nothing to shard: 16-bit weights, fp32 main grads and masters in the optimizer
        # (parallel/master_weights.py); the RoPE frequencies stay fp32 (LlamaModel._apply)
        if reduce_dtype not in (None, torch.float32):
            raise ValueError(f"reduce_dtype={reduce_dtype} without FSDP: main grads accumulate in fp32")
        model.to(param_dtype)
    ep = None
    if dims.ep > 1:  # before FSDP, which leaves the experts to it
        if expert_mesh is None:
            raise ValueError(f"ep({dims.ep}) > 1 needs expert_mesh (parallel.dims.build_expert_mesh)")
        ep = apply_ep(model, expert_mesh)
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], loss_parallel=loss_parallel)
    if lora is not None:  # after TP (adapters placed like their base weights), before AC, compile and FSDP
        apply_lora(model, lora, seed=lora_seed)
    if compile and ac == "full":
        apply_compile_then_full_ac(model, dynamic=dynamic)
    else:
        apply_ac(model, ac)
        if compile:
            apply_compile(model, dynamic=dynamic)
    if sharded:
        # on a dp mesh of one, resharding after forward frees nothing worth a second cast-copy in backward
        apply_fsdp(model, mesh["dp"], param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   reshard_after_forward=dims.dp > 1, ignored_params=set(ep.params) if ep else None)
    elif param_dtype is not None:
        attach_main_grads(model)  # after TP: its gradient-placement hooks run first
    return model, ep


def parallelize_model(
    model: nn.Module,
    *,
    mesh,
    dims: ParallelDims,
    ac: str = "none",
    compile: bool = False,
    dynamic: bool | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    loss_parallel: bool = False,
    fsdp: bool | None = None,
    n_microbatches: int | None = None,
    pp_schedule: str = "1f1b",
    stages_per_rank: int = 1,
    attn_factory: Callable | None = None,
    lora: LoRASpec | None = None,
    lora_seed: int = 0,
    expert_mesh=None,
) -> ModelRunner:
    """Apply PP/TP/AC/compile/FSDP to `model` for this rank's coordinate in `mesh`.

    mesh: DeviceMesh with dims ("pp", "dp", "tp") of sizes (dims.pp, dims.dp, dims.tp), as
    parallel.dims.build_mesh returns. pp == 1 returns a LocalRunner over `model` (modified in
    place; `runner.module`); pp > 1 a PipelineRunner over this rank's stage(s), whose stages
    return hidden states (see parallel/pipeline.py). `attn_factory(position_ids)` picks the
    attention backend of the runner's forward passes (e.g. DocumentAttention for packed rows).
    param_dtype (e.g. bf16 for an fp32 model) asks for mixed precision: with FSDP, its fp32 sharded parameters
    and param_dtype compute copies; without (dp = 1), the model is cast to param_dtype with fp32 main grads, and
    the runner's optimizer keeps the fp32 masters (parallel/master_weights.py). fsdp None: on when dp > 1.
    dynamic: torch.compile's (see apply_compile). lora: LoRA adapters on the targeted projections, the base
    frozen in its compute dtype (parallel/lora.py); lora_seed: their A's initialisation (the same on every rank).
    expert_mesh: the ("edp", "ep") DeviceMesh of parallel.dims.build_expert_mesh when dims.ep > 1: each rank keeps
    num_experts / ep experts and the tokens travel to them by all-to-all (parallel/expert_parallel.py).
    """
    got = tuple(mesh.mesh_dim_names or ())
    if got != ("pp", "dp", "tp") or tuple(mesh.shape) != (dims.pp, dims.dp, dims.tp):
        raise ValueError(f"mesh dims {got} of shape {tuple(mesh.shape)} do not match ParallelDims "
                         f"(pp={dims.pp}, dp={dims.dp}, tp={dims.tp}); build it with parallel.dims.build_mesh")
    cfg = model.config
    dims.validate_model(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                        num_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size,
                        intermediate_size=cfg.intermediate_size, stages_per_rank=stages_per_rank,
                        num_experts=cfg.num_experts if cfg.is_moe else 0)
    local = dict(mesh=mesh, dims=dims, ac=ac, compile=compile, dynamic=dynamic, param_dtype=param_dtype,
                 reduce_dtype=reduce_dtype, loss_parallel=loss_parallel, fsdp=fsdp, lora=lora, lora_seed=lora_seed,
                 expert_mesh=expert_mesh)
    if dims.pp == 1:
        model, ep = _apply_local(model, **local)
        return LocalRunner(model, mesh=mesh, attn_factory=attn_factory, expert_parallel=ep, dp=dims.dp)
    if n_microbatches is None:
        raise ValueError(f"pp({dims.pp}) > 1 needs n_microbatches (at least pp x stages_per_rank)")
    # activations between stages are in the compute dtype: FSDP's param_dtype, else the stored one
    act_dtype = param_dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
    stages = build_stages(model, pp=dims.pp, pp_rank=mesh.get_local_rank("pp"),
                          stages_per_rank=stages_per_rank, attn_factory=attn_factory)
    stages = [(s, _apply_local(m, **local)[0]) for s, m in stages]  # ep = 1 with pp > 1 (ParallelDims)
    if stages_per_rank > 1 and pp_schedule == "1f1b":
        pp_schedule = "interleaved_1f1b"
    return PipelineRunner(stages, pp_group=mesh.get_group("pp"), num_stages=dims.pp * stages_per_rank,
                          n_microbatches=n_microbatches, schedule=pp_schedule, activation_dtype=act_dtype,
                          mesh=mesh)


def head_shard(model: nn.Module) -> tuple[torch.Tensor, int]:
    """(local head weight [V_local, H], vocab_start) to pass to vocab_parallel_token_logprobs.

    Call after a forward (FSDP leaves the root gathered until backward); under TP the
    local rows are this rank's vocab slice.
    """
    from torch.distributed.tensor import DTensor

    from parallel.loading import local_slices

    w = model.lm_head.weight
    if not isinstance(w, DTensor):
        return w, 0
    names = w.device_mesh.mesh_dim_names or ()
    if any(n != "tp" and w.device_mesh.size(i) > 1 for i, n in enumerate(names)):
        raise RuntimeError(f"lm_head.weight is still sharded over mesh dims {names}: run forward_hidden(model, ...) "
                           "first so FSDP gathers the root parameters")
    return w.to_local(), local_slices(w)[0].start or 0
