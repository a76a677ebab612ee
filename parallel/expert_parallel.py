"""Expert parallelism of a mixture of experts (models/moe.py) in the native backend.

    ep_mesh = build_expert_mesh(dims, ranks, device_type="cuda")      # ("edp", "ep"), parallel/dims.py
    ep = apply_ep(model, ep_mesh)                                     # before FSDP: ep.params are left out of it
    ...forward/backward...
    ep.reduce_gradients(dp=dims.dp)                                   # once, after the last micro-batch

Each rank of an expert-parallel group of `ep` ranks holds num_experts / ep experts whole: every stacked expert
tensor (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) becomes a DTensor on the
("edp", "ep") mesh, placements (Replicate(), Shard(0)), so export (full_tensor), checkpoints (local shards), the
gradient norm and the optimizer treat it like any other parameter and its Hugging Face name is unchanged.

Forward of one MoE layer on N local tokens: the router runs on the token's own rank (so routing replay and the
load-balancing statistics are exactly those of ep = 1), then the N x k (token, expert) rows, sorted by expert,
go to their experts' ranks by one all_to_all_single with split sizes (after one of the per-expert counts), run
there as the grouped GEMMs of models.moe.expert_mlp, come back by the reverse all_to_all_single, are weighted by
the router and summed per token. torch.distributed.nn's autograd all-to-all carries the gradients back the same
way, so an expert's gradient on its rank is the sum over the ep group's tokens routed to it.

Gradients: FSDP averages the other parameters' gradients over the dp ranks (each rank's loss is normalised over
its own tokens). An expert's gradient, summed over its ep group by the all-to-all, is summed over the edp ranks
that replicate it and divided by dp: the same mean over all dp ranks' losses, so ep > 1 equals ep = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from models.mixin import with_mixin


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _all_to_all(x: torch.Tensor, *, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable all_to_all_single of the rows of x [M, H] (the backward sends gradients back)."""
    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty(sum(out_splits), x.shape[1])
    return all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)


@torch.compiler.disable  # host-side split sizes and eager collectives: a compiled layer calls this eagerly
def ep_experts_forward(experts: nn.Module, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *,
                       group: dist.ProcessGroup, align: int | None = None) -> torch.Tensor:
    """models.moe.GroupedExperts.forward with the experts spread over `group`: x [N, H], ids [N, k] global
    expert ids, weights [N, k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x), [N, H]. Collective over group
    (every rank calls it once per MoE layer and forward, with any N, 0 included)."""
    from models.moe import expert_mlp

    ep = dist.get_world_size(group)
    gate_up, down = _local(experts.gate_up_proj), _local(experts.down_proj)
    per_rank = gate_up.shape[0]
    n, k = ids.shape
    flat = ids.reshape(-1).to(torch.int64)
    order = flat.argsort(stable=True)  # assignments grouped by expert, so by destination rank
    token = order // k
    counts = torch.zeros(per_rank * ep, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    got = torch.empty_like(counts)  # [source rank, local expert]: rows each rank sends to this rank's experts
    dist.all_to_all_single(got, counts, group=group)
    both = torch.stack([counts.view(ep, per_rank).sum(1), got.view(ep, per_rank).sum(1)]).tolist()  # one sync
    send, recv = both
    rows = _all_to_all(x.index_select(0, token), out_splits=recv, in_splits=send, group=group)
    # received rows come source by source, each source's sorted by local expert: group them by local expert
    local = torch.arange(per_rank, device=x.device).repeat(ep)
    expert = torch.repeat_interleave(local, got, output_size=rows.shape[0])
    perm = expert.argsort(stable=True)
    y = expert_mlp(rows.index_select(0, perm), got.view(ep, per_rank).sum(0), expert[perm], gate_up, down,
                   align=align)
    y = y.index_select(0, perm.argsort())  # back to the received order
    y = _all_to_all(y, out_splits=send, in_splits=recv, group=group)
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))


@dataclass(slots=True)
class ExpertParallel:
    """The expert parameters of a model made expert-parallel by apply_ep, and their gradient reduction."""

    mesh: object  # DeviceMesh ("edp", "ep")
    params: list[nn.Parameter]

    def reduce_gradients(self, *, dp: int) -> None:
        """Each expert gradient (this rank's sum over its ep group's tokens) -> summed over the edp ranks that
        replicate the expert, / dp: the mean over the dp ranks' losses that FSDP gives the other parameters."""
        edp = self.mesh.size(0)
        for p in self.params:
            if p.grad is None:
                continue
            g = _local(p.grad)
            if edp > 1:
                dist.all_reduce(g, group=self.mesh.get_group("edp"))
            g.div_(dp)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    from models.moe import GroupedExperts

    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


class EPExperts(nn.Module):
    """What apply_ep mixes into a GroupedExperts: its forward over the experts spread on `_ep_group`."""

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, align: int | None = None
                ) -> torch.Tensor:
        return ep_experts_forward(self, x, ids, weights, group=self._ep_group, align=align)


def apply_ep(model: nn.Module, ep_mesh) -> ExpertParallel:
    """Keep this rank's num_experts / ep experts of every MoE layer (from the full tensors it was built or loaded
    with, the same on every rank) as DTensors (Replicate() over edp, Shard(0) over ep) and route its tokens to
    the other ranks' experts by all-to-all. In place; call before FSDP, which must leave `params` out."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    ep = ep_mesh.size(1)
    me = ep_mesh.get_local_rank("ep")
    group = ep_mesh.get_group("ep")
    params = []
    for experts in expert_modules(model):
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            if full.shape[0] % ep:
                raise ValueError(f"ep({ep}) must divide num_experts({full.shape[0]})")
            n = full.shape[0] // ep
            local = full.detach()[me * n:(me + 1) * n].clone()
            p = nn.Parameter(DTensor.from_local(local, ep_mesh, [Replicate(), Shard(0)], run_check=False),
                             requires_grad=full.requires_grad)
            setattr(experts, name, p)
            params.append(p)
        experts._ep_group = group
        with_mixin(experts, EPExperts)  # a class-level forward: one compiled graph for every layer (models.mixin)
    return ExpertParallel(mesh=ep_mesh, params=params)
