"""The one factory of training backends: `<role>.backend` picks which runner a worker drives.

    runner = build_runner(model, backend="megatron", mesh=mesh, dims=dims, param_dtype=torch.bfloat16,
                          attn_factory=DocumentAttention)

`model` is the role's Hugging Face-named module, already holding its initial weights (random init
or a checkpoint: the same source for every backend, so a native reference and a megatron actor
start equal). native: parallelize_model applies TP/PP/FSDP to it in place. megatron: this rank's
megatron-core GPTModel stage is built from its config and filled from its tensors (each rank copies
only its own TP slices), and the HF module is dropped by the caller. Both return a
parallel.runner.ModelRunner; callers never branch on the backend.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from parallel.apply import parallelize_model
from parallel.runner import ModelRunner

BACKENDS = ("native", "megatron")


def head_kind(model: nn.Module) -> str:
    """megatron head of an HF-style module: lm (causal LM), value (critic), score (reward model)."""
    from models.heads import LlamaForSequenceClassification, LlamaForValue

    if isinstance(model, LlamaForValue):
        return "value"
    if isinstance(model, LlamaForSequenceClassification):
        return "score"
    return "lm"


def compile_megatron_layers(gpt: nn.Module, *, dynamic: bool | None = None, backend: str = "inductor") -> None:
    """torch.compile each megatron-core TransformerLayer of the stage in place, as the native backend compiles
    its decoder layers: the norms, our RoPE, SwiGLU and the casts between the GEMMs fuse into a few kernels
    (eager megatron launches ~2x the native compiled step's elementwise kernels). Graph breaks fall back to
    eager; the layers share one graph where their guards allow. dynamic: as parallel.apply.apply_compile."""
    from models.megatron_moe import is_moe_layer

    # a mixture of experts' sparse layers stay eager: megatron's token dispatcher syncs split sizes to the host and
    # the router reads the forward's RouterTrace, an object dynamo would guard on per micro-batch
    layers = [layer for layer in gpt.decoder.layers if not is_moe_layer(layer)]
    for knob in ("recompile_limit", "cache_size_limit"):  # one cache entry per layer may be needed
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), len(layers) + 8))
    for layer in layers:
        layer.compile(fullgraph=False, dynamic=dynamic, backend=backend)


def build_megatron_runner(model: nn.Module, *, mesh, dims, ac: str = "none", param_dtype: torch.dtype | None = None,
                          attn_factory: Callable | None = None, frozen: bool = False, compile: bool = False,
                          dynamic: bool | None = None) -> ModelRunner:
    """megatron-core stage of `model` for this rank's coordinate in `mesh` ("pp", "dp", "tp")."""
    from models.megatron_model import build_megatron_model
    from parallel.megatron_groups import build_process_groups
    from parallel.megatron_runner import MegatronRunner
    from parallel.megatron_weights import load_megatron_weights

    cfg = model.config
    dims.validate_model(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                        num_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size,
                        num_experts=cfg.num_experts if cfg.is_moe else 0)
    first = next(model.parameters())
    dtype = param_dtype or first.dtype  # half params: megatron keeps the fp32 masters in its optimizer
    pgc = build_process_groups(mesh, ep=dims.ep)
    pp_idx = mesh.get_local_rank("pp")
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform",
                 "recompute_num_layers": 1} if ac == "full" else {}
    gpt = build_megatron_model(cfg, pg_collection=pgc, pre_process=pp_idx == 0, post_process=pp_idx == dims.pp - 1,
                               head=head_kind(model), params_dtype=dtype, device=first.device, **recompute)
    load_megatron_weights(gpt, pgc, {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)})
    if compile:
        compile_megatron_layers(gpt, dynamic=dynamic)
    return MegatronRunner(gpt, pgc, mesh=mesh, attn_factory=attn_factory)


def build_runner(model: nn.Module, *, backend: str = "native", mesh, dims, ac: str = "none", compile: bool = False,
                 dynamic: bool | None = None, param_dtype: torch.dtype | None = None, n_microbatches: int | None = None,
                 pp_schedule: str = "1f1b", stages_per_rank: int = 1,
                 attn_factory: Callable | None = None, frozen: bool = False, fsdp: bool | None = None,
                 lora=None, lora_seed: int = 0, expert_mesh=None) -> ModelRunner:
    """The runner of `model` on `backend`. Settings a backend cannot honour are refused before launch
    (launcher.config.validation._validate_megatron_role), never ignored here. frozen: a model that is never trained
    (native: stored in param_dtype with no fp32 master; megatron already keeps its 16-bit params and has no
    optimizer for it). fsdp: native only, parallelize_model's (None: FSDP2 when dp > 1). lora: a models.lora.LoRASpec
    (native only; parallel/lora.py), lora_seed its adapters' initialisation. expert_mesh: native only, an
    expert-parallel layout's (parallel.dims.build_expert_mesh)."""
    if backend == "native":
        if frozen and param_dtype is not None:
            # never trained (reference, reward model): stored in the compute dtype with no fp32 master copy.
            # FSDP's mixed precision would cast the masters to that dtype for every forward anyway, so the
            # outputs are the same and half the bytes stay free (a 7B reference: 13.5 GB instead of 27 + 13.5)
            model.to(param_dtype)  # the RoPE frequencies stay fp32 (LlamaModel._apply)
            param_dtype = None
        return parallelize_model(model, mesh=mesh, dims=dims, ac=ac, compile=compile, dynamic=dynamic,
                                 param_dtype=param_dtype, n_microbatches=n_microbatches, pp_schedule=pp_schedule,
                                 stages_per_rank=stages_per_rank, attn_factory=attn_factory, fsdp=fsdp,
                                 lora=lora, lora_seed=lora_seed, expert_mesh=expert_mesh)
    if backend == "megatron":
        if lora is not None:  # refused before launch (launcher.config.validation._validate_lora)
            raise ValueError("the megatron backend has no LoRA adapters; use backend native")
        if fsdp:
            raise ValueError("fsdp=True: the megatron backend shards with its own DDP and distributed optimizer")
        if (compile and ac == "full") or stages_per_rank != 1 or ac == "selective":
            raise ValueError(f"megatron backend: compile={compile} with ac={ac!r}, stages_per_rank={stages_per_rank} "
                             "are not supported (use 1 stage per rank, ac none|full, compile only with ac none)")
        return build_megatron_runner(model, mesh=mesh, dims=dims, ac=ac, param_dtype=param_dtype,
                                     attn_factory=attn_factory, compile=compile, dynamic=dynamic)
    raise ValueError(f"unknown training backend {backend!r}; choose one of {BACKENDS}")
