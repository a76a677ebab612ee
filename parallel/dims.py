"""Topology of one role group: `ParallelDims(tp, pp, dp)` and the meshes it yields.

Rank order inside a group follows Megatron and torchtitan: tp fastest, then dp, pp
slowest, i.e. local = (pp_idx * dp + dp_idx) * tp + tp_idx. Validation needs only
integers, so plans for 1024 ranks are checked without any process.

Expert parallelism (`ep`, a mixture of experts' layout) divides the dp ranks: dp_idx = edp_idx * ep + ep_idx, so
an expert-parallel group is ep consecutive dp ranks (each holds num_experts / ep experts whole) and the ranks
that hold the same experts (the expert-data-parallel group, dp / ep of them) sit at stride ep.

A group's meshes are built from its explicit list of global ranks; every rank of the
world calls `build_mesh` for every group (process-group creation is collective), and a
rank outside the group simply gets a mesh whose coordinate it does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class TopologyError(ValueError):
    """A layout that cannot work; the message names the numbers and the fix."""


@dataclass(frozen=True, slots=True)
class ParallelDims:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1  # expert parallelism inside dp (a mixture of experts; tp = pp = 1)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise TopologyError(f"{name} must be a positive integer, got {v!r}")
        if self.ep > 1 and (self.tp > 1 or self.pp > 1):
            raise TopologyError(f"ep({self.ep}) composes with data parallelism only: tp({self.tp}) and pp({self.pp}) "
                                "must be 1 (experts are neither tensor- nor pipeline-parallel)")
        if self.dp % self.ep:
            raise TopologyError(f"ep({self.ep}) must divide dp({self.dp}): an expert-parallel group is ep of the dp "
                                "ranks")

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (expert data parallelism): dp / ep."""
        return self.dp // self.ep

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, local_rank: int) -> tuple[int, int, int]:
        """local rank -> (pp_idx, dp_idx, tp_idx)."""
        if not 0 <= local_rank < self.world_size:
            raise IndexError(f"local rank {local_rank} outside a group of {self.world_size}")
        tp_idx = local_rank % self.tp
        dp_idx = (local_rank // self.tp) % self.dp
        pp_idx = local_rank // (self.tp * self.dp)
        return pp_idx, dp_idx, tp_idx

    def local_rank(self, *, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def validate_model(self, *, num_heads: int, num_kv_heads: int, num_layers: int,
                       vocab_size: int | None = None, intermediate_size: int | None = None,
                       stages_per_rank: int = 1, role: str = "model", num_experts: int = 0) -> None:
        """Check that this layout can shard a transformer of the given shape (the one place these
        rules live: launcher/planning/plan.py calls it for every role and the generation layout before launch).
        Tied embeddings need no rule: TP shares one DTensor, and a pipeline's first and last stages
        sum their copies' gradients (parallel/pipeline.py)."""
        if self.ep > 1 and not num_experts:
            raise TopologyError(f"{role} ep({self.ep}) splits a mixture of experts' experts, and the model is dense; "
                                f"use {role}.ep=1")
        if self.ep > 1 and num_experts % self.ep:
            raise TopologyError(f"{role} ep({self.ep}) must divide num_experts({num_experts})")
        if num_heads % self.tp:
            raise TopologyError(f"{role} tp({self.tp}) must divide num_attention_heads({num_heads})")
        if num_kv_heads % self.tp:
            raise TopologyError(f"{role} tp({self.tp}) must divide num_key_value_heads({num_kv_heads})")
        if intermediate_size is not None and intermediate_size % self.tp:
            raise TopologyError(f"{role} tp({self.tp}) must divide intermediate_size({intermediate_size})")
        if vocab_size is not None and vocab_size % self.tp:
            raise TopologyError(f"{role} tp({self.tp}) must divide vocab_size({vocab_size})")
        if self.pp * stages_per_rank > num_layers:
            per = f" x pp_stages_per_rank({stages_per_rank})" if stages_per_rank > 1 else ""
            raise TopologyError(f"{role} pp({self.pp}){per} must not exceed num_hidden_layers({num_layers})")

    def mesh_tensor(self, ranks: list[int]) -> torch.Tensor:
        """Global ranks of the group laid out as a [pp, dp, tp] grid."""
        if len(ranks) != self.world_size:
            raise TopologyError(
                f"a group of {len(ranks)} ranks cannot hold tp({self.tp}) x pp({self.pp}) x dp({self.dp})"
                f" = {self.world_size}"
            )
        return torch.tensor(ranks, dtype=torch.int64).view(self.pp, self.dp, self.tp)


MESH_DIMS = ("pp", "dp", "tp")


def build_mesh(dims: ParallelDims, ranks: list[int], *, device_type: str):
    """DeviceMesh with dims ("pp", "dp", "tp") over `ranks`. Collective: call on every rank."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, dims.mesh_tensor(ranks), mesh_dim_names=MESH_DIMS)


EXPERT_MESH_DIMS = ("edp", "ep")


def expert_mesh_tensor(dims: ParallelDims, ranks: list[int]) -> torch.Tensor:
    """Global ranks of the group laid out as an [edp, ep] grid (dp_idx = edp_idx * ep + ep_idx; tp = pp = 1)."""
    return dims.mesh_tensor(ranks).view(dims.edp, dims.ep)


def build_expert_mesh(dims: ParallelDims, ranks: list[int], *, device_type: str):
    """DeviceMesh with dims ("edp", "ep") over `ranks`, or None when ep == 1. Collective: call on every rank."""
    if dims.ep == 1:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, expert_mesh_tensor(dims, ranks), mesh_dim_names=EXPERT_MESH_DIMS)
