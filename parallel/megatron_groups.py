"""megatron-core process groups from our device plan: a `ProcessGroupCollection`, never its globals.

    pgc = build_process_groups(mesh)          # mesh: DeviceMesh ("pp", "dp", "tp") of one role group
    gpt = build_megatron_model(cfg, pg_collection=pgc, ...)

megatron-core's `parallel_state.initialize_model_parallel` holds ONE layout per process; the hybrid
engine needs the actor's training grid, its generation grid and other roles' grids in one job, so
every megatron object here gets its groups explicitly (tp, pp, dp from the role's mesh; mp = tp x pp
of this DP replica; intra_dist_opt = the whole role group, over which the distributed optimizer's
grad norm is reduced; embd = first + last stage for tied heads at pp > 1). Expert groups (a mixture of
experts, `ep` from the plan; tp = pp = 1 there, parallel.dims): ep = the ep consecutive dp ranks of this
rank's expert-parallel group (dp rank d is expert-parallel rank d % ep, as in the native backend), expt_dp =
the dp ranks holding the same experts (d % ep equal; at ep = 1 the dp group), expt_tp a size-1 group (experts
whole on each rank). Every expert group is a real group, for dense models too: with `expt_dp` missing megatron's
DDP calls `new_group(ranks=[rank])`, a WORLD collective that hangs when another role's ranks are busy elsewhere.

Groups are created with `use_local_synchronization=True`: only their members call, so ranks of
other roles never have to match. Groups of the same ranks are reused (colocated roles share them).
`assert_no_global_state()` is checked by every builder: a global megatron layout would be picked
up silently by megatron code paths that fall back to it.
"""

from __future__ import annotations

import torch.distributed as dist

_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def assert_no_global_state() -> None:
    """megatron-core's global parallel_state must stay uninitialised (several layouts coexist here)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron-core parallel_state.initialize_model_parallel was called in this process: "
                           "hybridrl passes explicit process groups (one layout per role) and megatron code "
                           "that falls back to the globals would use the wrong grid; remove that call")


def local_group(ranks: list[int]) -> dist.ProcessGroup:
    """A process group of `ranks` (sorted), created by its members only; cached per rank set."""
    key = tuple(sorted(int(r) for r in ranks))
    if dist.get_rank() not in key:
        raise ValueError(f"rank {dist.get_rank()} is not in group {key}")
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key), use_local_synchronization=True)
    return _GROUPS[key]


def build_process_groups(mesh, *, ep: int = 1):
    """ProcessGroupCollection of this rank's coordinate in a ("pp", "dp", "tp") DeviceMesh; ep: expert-parallel
    ranks (dividing dp, tp = pp = 1).

    Collective over the members of each group built (all ranks of the role call it together)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    assert_no_global_state()
    if tuple(mesh.mesh_dim_names or ()) != ("pp", "dp", "tp"):
        raise ValueError(f"mesh dims {mesh.mesh_dim_names}: build it with parallel.dims.build_mesh")
    grid = mesh.mesh  # [pp, dp, tp] global ranks
    pp_i, dp_i, tp_i = mesh.get_coordinate()
    me = dist.get_rank()
    tp, pp, dp = mesh.get_group("tp"), mesh.get_group("pp"), mesh.get_group("dp")
    self_group = local_group([me])
    pgc = ProcessGroupCollection()
    pgc.tp, pgc.pp, pgc.dp, pgc.dp_cp = tp, pp, dp, dp
    pgc.cp, pgc.tp_cp = self_group, tp
    pgc.mp = local_group(grid[:, dp_i, :].flatten().tolist())
    pgc.intra_dist_opt = local_group(grid.flatten().tolist())
    pgc.tp_dp_cp = local_group(grid[pp_i].flatten().tolist())
    if ep > 1:
        n_dp = grid.shape[1]
        if grid.shape[0] != 1 or grid.shape[2] != 1 or n_dp % ep:
            raise ValueError(f"ep({ep}) needs tp = pp = 1 and ep | dp; the mesh is pp x dp x tp = {tuple(grid.shape)}")
        start = dp_i // ep * ep
        pgc.ep = local_group(grid[0, start:start + ep, 0].tolist())
        pgc.expt_dp = local_group(grid[0, dp_i % ep::ep, 0].tolist())
        pgc.expt_tp, pgc.tp_ep, pgc.tp_ep_pp = self_group, pgc.ep, pgc.ep
    else:  # ep = 1: every dp rank holds every expert, so the experts' data-parallel group is dp itself (megatron
        # then treats expert weights as dense ones: `allreduce` is False only at expert_model_parallel_size > 1)
        pgc.ep, pgc.expt_tp, pgc.expt_dp, pgc.tp_ep = self_group, self_group, dp, tp
        pgc.tp_ep_pp = pgc.mp  # the experts' model-parallel group (tp x pp; the expert optimizer's rank in it)
    pgc.intra_expt_dp = pgc.expt_dp
    pgc.pos_embd = None
    n_pp = grid.shape[0]
    if n_pp > 1 and pp_i in (0, n_pp - 1):
        pgc.embd = local_group([int(grid[0, dp_i, tp_i]), int(grid[-1, dp_i, tp_i])])
    else:
        pgc.embd = None
    return pgc
