"""Every rank receives rank 0's plan and builds groups whose membership matches it (real gloo worlds)."""

import pytest

from tests.dist_utils import run_world


def _body(rank, world_size, overrides):
    import torch
    import torch.distributed as dist

    from launcher.config.load import load_config
    from launcher.dist import broadcast_plan, build_role_groups
    from launcher.planning.plan import compute_plan
    from models.config import preset_config

    cfg = load_config("conf/ppo_tiny.yaml", overrides)
    # only rank 0's plan counts: the others pass None and must receive the same one
    plan = compute_plan(cfg, world_size=world_size, model=preset_config("tiny")) if rank == 0 else None
    plan = broadcast_plan(plan, rank=rank)
    groups = build_role_groups(plan, rank=rank, device_type="cpu")
    members = {}
    for role, h in groups.items():
        assert h.active == (rank in h.spec.ranks)
        if not h.active:
            assert h.mesh.get_coordinate() is None
            continue
        coord = h.mesh.get_coordinate()
        pp_idx, dp_idx, tp_idx = coord
        local = h.spec.ranks.index(rank)
        assert h.dims.coords(local) == (pp_idx, dp_idx, tp_idx)
        # all-gather the global ranks of each mesh dim: they must be exactly the plan's grid row
        for dim in ("pp", "dp", "tp"):
            sub = h.mesh[dim]
            got = [torch.zeros(1, dtype=torch.int64) for _ in range(sub.size())]
            dist.all_gather(got, torch.tensor([rank]), group=sub.get_group())
            members[(role, dim)] = [int(t) for t in got]
    return plan.to_json(), members


def _expected(plan_json, role, dim, rank):
    import json

    from launcher.planning.plan import DevicePlan

    g = DevicePlan.from_dict(json.loads(plan_json)).groups[role]
    grid = g.dims.mesh_tensor(g.ranks)
    pp_i, dp_i, tp_i = g.dims.coords(g.ranks.index(rank))
    row = {"pp": grid[:, dp_i, tp_i], "dp": grid[pp_i, :, tp_i], "tp": grid[pp_i, dp_i, :]}[dim]
    return row.tolist()


@pytest.mark.distributed
@pytest.mark.parametrize("world,overrides", [
    (4, ["placement.mode=split", "actor.tp=2", "critic.tp=2"]),
    (4, ["placement.mode=colocated", "actor.tp=2", "actor.pp=2", "ref.tp=2"]),
])
def test_every_rank_same_plan_and_groups(world, overrides):
    results = run_world(_body, world, args=(overrides,))
    plans = {r[0] for r in results}
    assert len(plans) == 1  # identical plan on every rank
    plan_json = plans.pop()
    for rank, (_, members) in enumerate(results):
        for (role, dim), got in members.items():
            assert got == _expected(plan_json, role, dim, rank), (rank, role, dim)


def test_a_cuda_rank_runs_one_host_thread_unless_omp_num_threads_is_set(monkeypatch):
    import torch

    from launcher.dist import limit_host_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        assert limit_host_threads("cpu") is None and torch.get_num_threads() == 2
        line = limit_host_threads("cuda")
        assert torch.get_num_threads() == 1 and line.startswith("torch intra-op threads 1") and "2 before" in line
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert limit_host_threads("cuda") is None and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
