"""LoRA adapters in a parallel layout: `apply_lora(model, spec, seed=...)`, after tensor parallelism and before
activation checkpointing, compile and FSDP (parallel/apply.py).

Adapters are sharded consistently with their base weight, so an adapted projection needs no collective of its
own: a column-parallel base W [out/tp, in] (Shard(0)) gets a replicated A [r, in] and B [out/tp, r] (Shard(0));
a row-parallel W [out, in/tp] (Shard(1)) gets A [r, in/tp] (Shard(1)) and a replicated B [out, r], whose
partial product joins the base's partial sum before the one all-reduce RowwiseParallel already does. A
replicated adapter's gradient is a partial sum over the TP ranks, reduced once by the same hook the
replicated norms use. FSDP then shards adapters like every other parameter.

The base is frozen in its stored dtype: its parameters leave the optimizer (and so have no fp32 masters,
main grads or moments); the adapters stay fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from models.lora import LoRASpec, add_adapters, freeze_base


def _place(mod: nn.Linear, a: torch.Tensor, b: torch.Tensor) -> tuple[nn.Parameter, nn.Parameter]:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from parallel.tensor_parallel import _reduce_partial_grad

    w = mod.weight
    if not isinstance(w, DTensor):
        return nn.Parameter(a), nn.Parameter(b)
    (placement,) = w.placements  # TP comes before FSDP: a 1-D mesh here
    if placement == Shard(0):  # column parallel
        pa, pb = Replicate(), Shard(0)
    elif placement == Shard(1):  # row parallel
        pa, pb = Shard(1), Replicate()
    else:
        raise ValueError(f"LoRA on a linear layer whose weight is placed {w.placements}: expected Shard(0) or Shard(1)")
    params = []
    for t, pl in ((a, pa), (b, pb)):
        p = nn.Parameter(distribute_tensor(t, w.device_mesh, [pl]))
        if pl == Replicate():
            p.register_post_accumulate_grad_hook(_reduce_partial_grad)
        params.append(p)
    return params[0], params[1]


def apply_lora(model: nn.Module, spec: LoRASpec, *, seed: int = 0) -> list[str]:
    """Adapters on `model`'s targeted projections (plain or tensor-parallel), the rest frozen; in place.
    Returns the adapted module names."""
    names = add_adapters(model, spec, seed=seed, place=_place)
    freeze_base(model)
    return names
