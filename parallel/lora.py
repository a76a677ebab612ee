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

from models.lora import LoRASpec, adapters_disabled, add_adapters, freeze_base


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


def adapter_param_specs(base_specs, spec: LoRASpec) -> list:
    """parallel.reshard.ParamSpec of every adapter of `spec` on a model whose weights are `base_specs` (full
    shapes, the generation dtype's itemsize): "<module>.lora_A" [r, in] and "<module>.lora_B" [out, r] of each
    targeted projection (the reshard planner moves them like any weight; parallel/sharding.py splits them)."""
    from parallel.reshard import ParamSpec

    out = []
    for s in base_specs:
        module, _, leaf = s.name.rpartition(".")
        if leaf != "weight" or len(s.shape) != 2 or module.rsplit(".", 1)[-1] not in spec.modules:
            continue
        out.append(ParamSpec(f"{module}.lora_A", (spec.rank, s.shape[1]), s.itemsize))
        out.append(ParamSpec(f"{module}.lora_B", (s.shape[0], spec.rank), s.itemsize))
    return out


def load_adapters(runner, adapters: dict[str, torch.Tensor]) -> None:
    """Full adapter tensors {"<module>.lora_A": [r, in], ...} (e.g. models.lora.read_peft_adapter's) into
    `runner`'s adapters, each rank keeping its own slice of a DTensor; every adapter of the runner must be given
    (a pipeline stage takes the names it holds)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from models.lora import is_adapter_name

    mine = {n: p for n, p in runner.named_parameters() if is_adapter_name(n)}
    missing = sorted(set(mine) - set(adapters))
    if missing:
        raise ValueError(f"the adapter lacks {len(missing)} of this model's adapter tensors, e.g. {missing[0]}")
    with torch.no_grad():
        for n, p in mine.items():
            t = adapters[n].to(torch.float32)
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"adapter tensor {n} has shape {tuple(t.shape)}, the model's is {tuple(p.shape)}")
            if isinstance(p, DTensor):
                t = distribute_tensor(t.to(p.to_local().device), p.device_mesh, p.placements).to_local()
                p.to_local().copy_(t)
            else:
                p.copy_(t)


def merge_into_base(runner) -> None:
    """Fold every adapter into its base weight (W <- W + scale * B @ A) and restart it at B = 0: the model computes
    the same policy, whose base is now the trained one (a LoRA actor's SFT warm-up becomes its reference's
    weights). Collective over the runner's mesh like training_shards."""
    from torch.distributed.tensor import DTensor

    from models.lora import merged_weight

    with torch.no_grad():
        for mod in runner.lora_modules.values():
            w = merged_weight(mod)
            dst = mod.weight.to_local() if isinstance(mod.weight, DTensor) else mod.weight
            dst.copy_(w.to_local() if isinstance(w, DTensor) else w)
            (mod.lora_B.to_local() if isinstance(mod.lora_B, DTensor) else mod.lora_B).zero_()
    runner.base_version += 1  # an engine holding the old base must get the new one


class AdaptersOffRunner:
    """A LoRA runner seen as its base model: the reference of a LoRA actor, with no second copy of the weights.

    Its forward runs the actor's runner with every adapter off; it trains nothing (`parameters()` is empty) and
    everything else is the actor runner's (modules, heads, layout)."""

    def __init__(self, runner):
        self._runner = runner

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def forward(self, batches, *, reduce):
        with adapters_disabled(self._runner.modules):
            return self._runner.forward(batches, reduce=reduce)

    def forward_backward(self, batches, *, loss_fn):
        raise RuntimeError("the adapters-off reference of a LoRA actor is never trained")

    def parameters(self) -> list:
        return []
