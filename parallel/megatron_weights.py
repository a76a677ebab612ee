"""Weights of a megatron-core stage under Hugging Face names: load from a checkpoint, expose for reshard/export.

    load_megatron_weights(gpt, pgc, "ckpt_dir")      # each rank reads only its own slices
    shards = megatron_hf_shards(gpt, pgc)             # {HF name: this rank's TP shard}, views of the params
    full = gather_hf_state(gpt, pgc)                  # {HF name: full tensor} of this stage (TP all-gather)

The layout conversion itself is models/megatron_map.py (pure); this module adds the TP coordinates
(parallel/sharding.py's `tp_slices`, shared with the native TP plan, the rollout engine and the
reshard planner: all of them agree on what "rank r's shard" of an HF tensor is).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from models.megatron_map import hf_names, hf_to_megatron, megatron_to_hf
from parallel.sharding import tp_shard_dim, tp_slices


def layout_of(pgc) -> dict[str, int]:
    return dict(tp=pgc.tp.size(), tp_rank=pgc.tp.rank(), pp=pgc.pp.size(), pp_rank=pgc.pp.rank(),
                ep=pgc.ep.size(), ep_rank=pgc.ep.rank())


def _is_expert(name: str) -> bool:
    """A mixture of experts' stacked expert tensor (experts along dim 0; models/moe.py GroupedExperts)."""
    return ".mlp.experts." in name


def local_slices(name: str, shape: tuple[int, ...], *, lay: dict[str, int]) -> tuple[slice, ...]:
    """This rank's slice of a full HF tensor: its TP shard, or of a stacked expert tensor the expert-parallel
    rank's num_experts / ep experts whole (megatron's expert_tensor_parallel_size is 1)."""
    if _is_expert(name):
        per = shape[0] // lay["ep"]
        return (slice(lay["ep_rank"] * per, (lay["ep_rank"] + 1) * per),) + (slice(None),) * (len(shape) - 1)
    return tp_slices(name, shape, rank=lay["tp_rank"], world=lay["tp"])


def _params(gpt: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in gpt.named_parameters()}


def megatron_hf_shards(gpt: nn.Module, pgc) -> dict[str, torch.Tensor]:
    """{HF name: this rank's TP shard} of the stage, detached views of the parameters where the layout
    allows (unfused tensors, gate/up, k/v; q when the rank holds one KV group), copies otherwise."""
    lay = layout_of(pgc)
    mc = {n: p.detach() for n, p in _params(gpt).items()}
    return megatron_to_hf(mc, gpt.hf_config, tp=lay["tp"], pp=lay["pp"], pp_rank=lay["pp_rank"],
                          head=gpt.head_kind, ep=lay["ep"])


def _read_local(source: str | os.PathLike | Mapping[str, torch.Tensor], names: list[str], *,
                lay: dict[str, int]) -> dict[str, torch.Tensor]:
    """This rank's slices (local_slices) of `names` from a safetensors directory (only those are read) or a dict."""
    if isinstance(source, Mapping):
        return {n: source[n][local_slices(n, tuple(source[n].shape), lay=lay)] for n in names}
    from models.hf_io import load_tensors

    return load_tensors(source, names=names, slices=lambda n, shape: local_slices(n, shape, lay=lay))


@torch.no_grad()
def load_megatron_weights(gpt: nn.Module, pgc, source: str | os.PathLike | Mapping[str, torch.Tensor], *,
                          strict: bool = True) -> list[str]:
    """Fill this rank's megatron-core parameters from HF tensors (a checkpoint dir or a full state dict).

    strict=False keeps parameters the source lacks (a critic's score head from an actor checkpoint).
    Returns the megatron names loaded."""
    lay = layout_of(pgc)
    cfg, head = gpt.hf_config, gpt.head_kind
    wanted = hf_names(cfg, pp=lay["pp"], pp_rank=lay["pp_rank"], head=head)
    if cfg.tie_word_embeddings and lay["pp"] == 1 and head == "lm":
        wanted.remove("lm_head.weight")  # the embedding is the head
    available = set(source) if isinstance(source, Mapping) else set(_checkpoint_names(source))
    if cfg.tie_word_embeddings and "lm_head.weight" not in available and "model.embed_tokens.weight" in available:
        available.add("lm_head.weight")  # load_tensors serves the embedding under the head's name
        if isinstance(source, Mapping):
            source = {**source, "lm_head.weight": source["model.embed_tokens.weight"]}
    missing = [n for n in wanted if n not in available]
    if missing and strict:
        raise KeyError(f"{len(missing)} tensor(s) missing from the checkpoint: {missing[:6]}")
    local = _read_local(source, [n for n in wanted if n in available], lay=lay)
    params = _params(gpt)
    for n in missing:  # keep the current values (strict=False): hand the current shard back in
        local[n] = megatron_hf_shards(gpt, pgc)[n]
    mc = hf_to_megatron(local, cfg, tp=lay["tp"], pp=lay["pp"], pp_rank=lay["pp_rank"], head=head, ep=lay["ep"])
    if set(mc) != set(params):
        raise KeyError(f"megatron names differ: only mapped {sorted(set(mc) - set(params))[:4]}, "
                       f"only in the model {sorted(set(params) - set(mc))[:4]}")
    for n, p in params.items():
        if tuple(mc[n].shape) != tuple(p.shape):
            raise ValueError(f"{n}: mapped shape {tuple(mc[n].shape)} != parameter shape {tuple(p.shape)}")
        p.copy_(mc[n].to(p.dtype))
    return list(params)


def _checkpoint_names(path) -> list[str]:
    from models.hf_io import checkpoint_index

    return list(checkpoint_index(path))


def gather_hf_state(gpt: nn.Module, pgc, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """{HF name: full tensor} of this stage: the TP shards all-gathered over the TP group, a mixture of experts'
    stacked experts over the expert-parallel group (collective)."""
    tp, ep = pgc.tp.size(), pgc.ep.size()
    out = {}
    for name, shard in megatron_hf_shards(gpt, pgc).items():
        if ep > 1 and _is_expert(name):
            parts = [torch.empty_like(shard) for _ in range(ep)]
            dist.all_gather(parts, shard.contiguous(), group=pgc.ep)
            out[name] = torch.cat(parts, dim=0).to(device)
            continue
        dim = tp_shard_dim(name)
        if tp == 1 or dim is None:
            out[name] = shard.detach().to(device).clone()
            continue
        parts = [torch.empty_like(shard) for _ in range(tp)]
        dist.all_gather(parts, shard.contiguous(), group=pgc.tp)
        out[name] = torch.cat(parts, dim=dim).to(device)
    return out


def megatron_reshard_shards(gpt: nn.Module, pgc) -> dict[str, torch.Tensor]:
    """Training shards in the reshard planner's convention (parallel/reshard.py `train_box`): this rank's TP
    shard, of which DP replica d offers rows chunk d (torch.chunk split of dim 0). megatron keeps the
    full TP shard on every DP replica, so each replica hands out a disjoint row view and the replicas
    together cover the tensor exactly once, as FSDP's shards do for the native backend. At ep > 1 a stacked
    expert tensor is offered whole (the expert-parallel rank's experts: `expert_rows`, as the native backend's)."""
    from parallel.reshard import fsdp_rows

    dp, dp_rank, ep = pgc.dp.size(), pgc.dp.rank(), pgc.ep.size()
    out = {}
    for name, t in megatron_hf_shards(gpt, pgc).items():
        if ep > 1 and _is_expert(name):
            out[name] = t
            continue
        lo, hi = fsdp_rows(t.shape[0], dp=dp, dp_rank=dp_rank)
        out[name] = t[lo:hi]
    return out
