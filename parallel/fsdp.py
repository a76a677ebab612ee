"""Data parallelism with FSDP2: `apply_fsdp(model, dp_mesh, *, param_dtype=None, ...)`.

Each decoder layer is its own `fully_shard` unit (its parameters are all-gathered just
before the layer runs and freed after), then the root takes what is left (embeddings,
final norm, head). Composes with tensor parallelism when `dp_mesh` and the TP mesh are
slices of one DeviceMesh (FSDP then shards the TP-local shards, 2-D DTensors).

Mixed precision on GPU: fp32 sharded master parameters, `param_dtype=torch.bfloat16`
compute copies made by the all-gather, gradients reduce-scattered in `reduce_dtype`
(fp32). The root is not resharded after forward, so `lm_head.weight` stays the gathered
tensor until backward: loss code that applies the head outside `forward` (chunked
log-probs from hidden states) may read it, and FSDP's end-of-backward callback still
reduces its gradient.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(
    model: nn.Module,
    dp_mesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard `model` (a LlamaForCausalLM or a pipeline stage) over the 1-D `dp_mesh` in place.

    param_dtype None keeps the stored dtype for compute. ignored_params: left out of FSDP (an expert-parallel
    model's experts: parallel/expert_parallel.py). Returns the same module object
    (its class becomes an FSDPModule subclass; parameter names are unchanged).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    layers = list(model.model.layers.values())
    for i, layer in enumerate(layers):
        # the last layer is needed again first in backward: keeping it gathered saves one all-gather
        last = i == len(layers) - 1
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and not last,
                    ignored_params=ignored_params)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored_params)
    return model


def gradients_synced(model: nn.Module, enabled: bool) -> None:
    """Turn FSDP gradient reduce-scatter on/off (off while accumulating micro-batches)."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)


def register_sharded_parameters(model: nn.Module) -> None:
    """Reshard every FSDP unit of `model`, so that its sharded parameters are the registered ones.

    FSDP2 registers a unit's unsharded parameters while they are gathered (the root and the last layer stay
    gathered after a forward: reshard_after_forward=False) and its sharded ones again after backward. An
    optimizer built in between holds the unsharded tensors, which never get a gradient: it would skip those
    parameters at every step. The runner calls this before building an optimizer."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
