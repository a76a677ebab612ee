"""The layout search: deterministic, fast at 1,024 ranks, memory-aware; placement.mode=auto plans a launch."""

import json
import time

import pytest

from launcher.config.load import load_config
from launcher.errors import UserError
from launcher.planning.autoplan import candidate_from_plan, overrides_of, pool_sizes, search
from launcher.planning.costmodel import build_workload, load_calibration
from launcher.planning.plan import DevicePlan, compute_plan, validate_batch
from launcher.planning.stepmodel import estimate
from models.config import ModelConfig, preset_config
from tests.dist_utils import run_world

CAL = load_calibration("h200")
TINY, L7B = preset_config("tiny"), preset_config("llama-7b")
L70B = ModelConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                   num_attention_heads=64, num_key_value_heads=8)


def test_search_is_deterministic_and_fast_at_1024_ranks():
    cfg = load_config("conf/plan_ppo_hybridflow.yaml")
    t0 = time.process_time()
    a = search(cfg, world_size=1024, model=L7B, cal=CAL, schedules=(False, True), top=5)
    cpu = time.process_time() - t0
    b = search(cfg, world_size=1024, model=L7B, cal=CAL, schedules=(False, True), top=5)
    assert cpu < 10, f"search over 1024 ranks took {cpu:.1f} s of CPU"
    assert a.evaluated == b.evaluated > 100
    assert [e.candidate for e in a.best] == [e.candidate for e in b.best] and len(a.best) == 5
    assert [e.step_s for e in a.best] == sorted(e.step_s for e in a.best)
    for e in a.best[:2]:  # the plans printed launch: the planner accepts its overrides at 1024 ranks
        plan = compute_plan(load_config("conf/plan_ppo_hybridflow.yaml", overrides_of(e.candidate, reward_model=True)),
                            world_size=1024, model=L7B)
        validate_batch(cfg, plan)
        assert candidate_from_plan(plan, is_async=e.candidate.is_async) == e.candidate


def test_pool_sizes_whole_nodes_beyond_two():
    assert pool_sizes(4, 2, CAL) == [(1, 3), (2, 2), (3, 1)]
    sizes = pool_sizes(64, 2, CAL)
    assert all(a % 8 == 0 and a + b == 64 for a, b in sizes) and len(sizes) == 7


def test_memory_rejects_70b_on_8_gpus_and_auto_says_why():
    cfg = load_config("conf/plan_ppo_hybridflow.yaml")
    r = search(cfg, world_size=8, model=L70B, cal=CAL, schedules=(False,))
    assert not r.best and r.rejected[0].startswith("colocated"), r.rejected
    # 70B x 16 bytes of training state over 8 GPUs is 140 GB before any activation
    assert "actor on 8 GPUs needs 142 GB per GPU > 140 GB" in r.rejected[0]
    with pytest.raises(UserError, match="no plan fits 8 GPUs"):
        compute_plan(cfg, world_size=8, model=L70B)
    # with enough GPUs it fits, and every chosen pool stays under the usable memory
    r = search(cfg, world_size=64, model=L70B, cal=CAL, schedules=(False,))
    assert r.best and max(r.best[0].peak_gb) <= CAL.hbm_gb


def test_auto_refuses_layout_keys_it_would_override():
    with pytest.raises(UserError, match="actor.tp=2"):
        compute_plan(load_config("conf/ppo_tiny.yaml", ["placement.mode=auto", "actor.tp=2"]), world_size=4,
                     model=TINY)
    with pytest.raises(UserError, match="placement.calibration: no calibration 'b300'"):
        compute_plan(load_config("conf/ppo_tiny.yaml", ["placement.calibration=b300"]), world_size=4, model=TINY)


def test_estimate_of_a_fixed_plan_is_in_plan_json():
    cfg = load_config("conf/bench_ppo_1b.yaml", ["placement.mode=split", "trainer.max_staleness=1"])
    model = preset_config("llama-1b")
    plan = compute_plan(cfg, world_size=2, model=model)
    p = DevicePlan.from_dict(json.loads(plan.to_json())).predicted
    est = estimate(build_workload(cfg, model=model), CAL, candidate_from_plan(plan, is_async=True))
    assert p["predicted_step_s"] == round(est.step_s, 4) and p["mode"] == "split" and p["async"]
    assert set(p["stages_s"]) >= {"gen", "ref", "values", "reward", "update_actor", "update_critic"}


def test_cli_auto_json(capsys):
    from launcher.planning.plan import main

    rc = main(["conf/bench_ppo_1b.yaml", "--world-size", "2", "--auto", "--json", "--schedules", "sync,async",
               "--top", "3"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["plans"]) == 3 and d["plans"][0]["predicted_step_s"] <= d["plans"][1]["predicted_step_s"]
    assert {"samples_per_s", "useful_utilization", "pools", "peak_gb", "overrides"} <= set(d["plans"][0])
    assert main(["conf/bench_ppo_1b.yaml", "--world-size", "2", "--auto", "--schedules", "later"]) == 2


def _auto_body(rank, world_size):
    import torch.distributed

    from launcher.config.load import load_config
    from launcher.dist import build_role_groups
    from launcher.planning.plan import compute_plan, validate_batch
    from models.config import preset_config

    # as launcher/main.py does: every rank plans on its own (rank 0's plan is then broadcast)
    cfg = load_config("conf/ppo_tiny.yaml", ["placement.mode=auto"])
    plan = compute_plan(cfg, world_size=world_size, model=preset_config("tiny"))
    validate_batch(cfg, plan)
    groups = build_role_groups(plan, rank=rank, device_type="cpu")
    # rank 0 hosts the store: exiting before rank 1 has built its own one-rank groups broke their connection
    torch.distributed.barrier()
    return plan.to_json(), sorted(r for r, h in groups.items() if h.active)


@pytest.mark.distributed
def test_auto_plan_builds_the_same_groups_on_every_rank():
    results = run_world(_auto_body, 2)
    plans = {r[0] for r in results}
    assert len(plans) == 1
    plan = DevicePlan.from_dict(json.loads(plans.pop()))
    assert plan.mode in ("colocated", "split") and plan.predicted["reject"] is None
    assert {r for res in results for r in res[1]} == set(plan.groups) - {"rollout"}  # rollout: the actor's groups


def test_search_proposes_only_layouts_the_planner_accepts():
    # tp=2 divides the heads but not the (odd) intermediate size: the search must use the planner's own
    # size rule (launcher.planning.plan.validate_role_layout), not a looser one of its own
    odd = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2753, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=8)
    cfg = load_config("conf/plan_ppo_hybridflow.yaml")
    r = search(cfg, world_size=8, model=odd, cal=CAL, schedules=(False,), top=10**6)  # every feasible one
    assert r.best and any(pp > 1 for e in r.best for _, (_, pp, _) in e.candidate.layouts)
    for e in r.best:
        assert e.candidate.gen_tp == 1 and all(tp == 1 for _, (tp, _, _) in e.candidate.layouts), \
            e.candidate.describe()
    for e in r.best[::25]:
        # each accepted: no UserError
        overrides = overrides_of(e.candidate, reward_model=True)
        compute_plan(load_config("conf/plan_ppo_hybridflow.yaml", overrides), world_size=8, model=odd)
