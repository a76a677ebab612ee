"""Process-group start-up and the role groups of a device plan, as explicit objects.

Every rank calls `build_role_groups(plan, ...)`: creating a process group is collective
over the whole world, so each rank builds every role's mesh, also those it is not in
(its coordinate there is None). Nothing is stored in module globals.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from launcher.planning.plan import DevicePlan, RoleGroup
from parallel.dims import build_expert_mesh, build_mesh


@dataclass(slots=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def resolve_device(kind: str) -> str:
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        from launcher.errors import UserError

        raise UserError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu (or auto)")
    return kind


def limit_host_threads(device: str) -> str | None:
    """On a CUDA rank torch's intra-op pool serves only small host-side ops (the engine's bookkeeping, packing,
    advantages), and a pool of one thread per core spinning between them starves the rank's own loop and an
    agent's tool threads (docs/results.md, multi-turn agent generation). So one thread, as torchrun sets for
    several ranks per node, unless OMP_NUM_THREADS says otherwise.
    -> the auto line for the run log, or None (CPU runs, or OMP_NUM_THREADS set: left as they are)."""
    if device != "cuda" or "OMP_NUM_THREADS" in os.environ:
        return None
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    return (f"torch intra-op threads 1 (auto: a CUDA rank's host ops are small; {before} before; "
            f"OMP_NUM_THREADS sets it)")


def init_distributed(*, device: str, backend: str = "auto", timeout_s: int = 600) -> DistEnv:
    """Init the default group from torchrun's environment (a single process works without torchrun)."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # plain `python launcher/main.py`: a world of one
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    dev = torch.device(device, local_rank) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                                store=_restart_safe_store(world, timeout),
                                device_id=dev if device == "cuda" else None)
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=dev, backend=backend)


def _restart_safe_store(world_size: int, timeout: datetime.timedelta):
    """The rendezvous store for this attempt, or None (torch's env:// default).

    torchrun's agent hosts one TCPStore for all restarts of a job and its workers connect to it
    as clients (TORCHELASTIC_USE_AGENT_STORE=True). After `torchrun --max-restarts N` restarts the
    workers, the keys of the failed attempt (gloo's full-mesh addresses, new_group counters) are
    still there: gloo connects to dead peers ("Connection refused") or new_group hangs. A prefix
    per attempt gives each restart a clean namespace (the templates also set
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which gives each attempt its own store)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"hybridrl/attempt_{attempt}/", store)


def broadcast_plan(plan: DevicePlan | None, *, rank: int) -> DevicePlan:
    """Rank 0's plan to every rank (the others pass None or their own and get rank 0's)."""
    box = [plan.to_json() if rank == 0 and plan is not None else None]
    dist.broadcast_object_list(box, src=0)
    import json

    return DevicePlan.from_dict(json.loads(box[0]))


@dataclass(slots=True)
class RoleHandle:
    """One role's ranks, layout and DeviceMesh ("pp", "dp", "tp"); `active` if this rank is in it; expert_mesh: its
    ("edp", "ep") DeviceMesh when the layout is expert-parallel (ep > 1), else None."""

    spec: RoleGroup
    mesh: object
    active: bool
    expert_mesh: object = None

    @property
    def dims(self):
        return self.spec.dims


def build_role_groups(plan: DevicePlan, *, rank: int, device_type: str) -> dict[str, RoleHandle]:
    """Build every role's mesh on every rank (collective). The rollout role's generation groups are
    built by the hybrid engine (strided HybridFlow grouping), not here."""
    out: dict[str, RoleHandle] = {}
    for role, g in plan.groups.items():
        if role == "rollout":
            continue
        mesh = build_mesh(g.dims, g.ranks, device_type=device_type)
        out[role] = RoleHandle(spec=g, mesh=mesh, active=rank in g.ranks,
                               expert_mesh=build_expert_mesh(g.dims, g.ranks, device_type=device_type))
    return out
