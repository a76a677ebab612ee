"""Sharded checkpoint I/O for parallelized models: read only owned slices, gather for export.

    model = parallelize_model(build_model(cfg, init=False), mesh=mesh, dims=dims)
    load_sharded_weights(model, "/ckpt/llama")          # each rank reads its own slices
    sd = full_state_dict(model)                          # {HF name: full tensor}, collective

Works on any mix of plain parameters, TP DTensors, FSDP2 (also over TP: 2-D DTensors)
and pipeline stages (a stage simply has fewer names). The slice each rank reads is
derived from the parameter's own DTensor placements, so it is by construction the
layout the training code uses; parallel/sharding.py's table is asserted against the
TP plan in parallel/tensor_parallel.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def local_slices(p: torch.Tensor) -> tuple[slice, ...]:
    """Index into the full (global) tensor of the part this rank holds of parameter `p`."""
    if not isinstance(p, DTensor):
        return tuple(slice(None) for _ in p.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def _reshard_fsdp(model: nn.Module) -> None:
    """Put FSDP modules back to their sharded parameters (they may be gathered after a forward)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def load_sharded_weights(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> list[str]:
    """Fill this rank's shard of every parameter of `model` from a HF safetensors checkpoint.

    Reads only the owned slice of each tensor (models.hf_io.load_tensors with `slices`),
    casts to the parameter's dtype. Returns the names loaded. strict: every parameter must
    be in the checkpoint with the model's global shape.
    """
    from models.hf_io import load_tensors, tensor_shapes

    _reshard_fsdp(model)
    params = dict(model.named_parameters())
    on_disk = tensor_shapes(path)
    # a tied checkpoint has no lm_head.weight: load_tensors serves the embedding under that name
    names = [n for n in params if n in on_disk or (n == "lm_head.weight" and "model.embed_tokens.weight" in on_disk)]
    if strict:
        for n in names:
            if n in on_disk and tuple(on_disk[n]) != tuple(params[n].shape):
                raise ValueError(f"{n}: checkpoint shape {tuple(on_disk[n])} != model shape {tuple(params[n].shape)};"
                                 " the checkpoint is for another config")
        missing = [n for n in params if n not in names]
        if missing:
            raise ValueError(f"{len(missing)} parameter(s) not in checkpoint {path}: {missing[:8]}; "
                             "pass strict=False to keep their current values")
    wanted = {n: local_slices(params[n]) for n in names}
    tensors = load_tensors(path, names=names, slices=lambda name, shape: wanted[name], device="cpu")
    with torch.no_grad():
        for n in names:
            p = params[n]
            dst = p.to_local() if isinstance(p, DTensor) else p
            src = tensors[n]
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"{n}: read slice {tuple(src.shape)} but this rank holds {tuple(dst.shape)}")
            dst.copy_(src.to(dtype=dst.dtype))
    return names


def full_state_dict(model: nn.Module, *, device: str | torch.device = "cpu",
                    only: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """{HF name: full tensor} of this rank's module (a pipeline stage gives only its names); `only(name)`
    picks some of them (e.g. LoRA adapters).

    Collective over every mesh the parameters live on: all ranks of those meshes must call
    it, in the same order. Tied weights appear once (under the embedding's name).
    """
    _reshard_fsdp(model)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if only is not None and not only(name):
            continue
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().to(device)
    return out
