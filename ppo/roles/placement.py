"""Where this rank stands in a run: the device plan, the process groups of the roles it hosts and
its distributed environment, handed by the launcher to ppo as one object.

    placement = Placement(plan, build_role_groups(plan, rank=env.rank, ...), env)   # launcher side
    placement.plan.roles_of(placement.rank); placement.groups["actor"].mesh; placement.device
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Placement:
    plan: object  # launcher.planning.plan.DevicePlan (duck-typed: ppo does not import the launcher)
    groups: dict  # role -> its group handle (mesh, dims, ranks) for the roles this rank hosts
    env: object  # launcher.dist.DistEnv: rank, world_size, local_rank, device, backend

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def device(self) -> torch.device:
        return self.env.device
