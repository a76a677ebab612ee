"""A mixture-of-experts policy's layouts that the native backend and engine cannot run, and actor.router_replay on
a dense model, are refused before launch with the fix (UserError: exit 2)."""

import pytest

from launcher.config.load import load_config
from launcher.errors import UserError
from launcher.planning.plan import compute_plan
from models.config import preset_config

MOE = preset_config("tiny-qwen3-moe")


@pytest.mark.parametrize("overrides, message", [
    (["actor.tp=2"], r"actor.tp=2, actor.pp=1: the model is a mixture of experts .* use actor.tp=1"),
    (["ref.pp=2", "trainer.share_prompts=false"], r"ref.tp=1, ref.pp=2: .* use ref.tp=1 and ref.pp=1"),
    (["rollout.gen_tp=2"], r"rollout.gen_tp=2: .* use rollout.gen_tp=1"),
    (["placement.mode=auto"], r"placement.mode=auto: .* use colocated or split"),
    (["actor.lora.rank=8"], r"actor.lora.rank=8: .* stacked tensors with no adapter support yet"),
])
def test_moe_layouts_the_native_backend_cannot_run_are_refused(overrides, message):
    cfg = load_config("conf/grpo_tiny.yaml", overrides)
    with pytest.raises(UserError, match=message):
        compute_plan(cfg, world_size=4, model=MOE)


def test_moe_with_data_parallelism_plans_and_replay_needs_experts():
    cfg = load_config("conf/grpo_tiny.yaml", ["actor.router_replay=true"])
    plan = compute_plan(cfg, world_size=2, model=MOE)
    assert plan.groups["actor"].dp == 2
    with pytest.raises(UserError, match=r"actor.router_replay=true .* \(llama\) has no experts; set "
                                        r"actor.router_replay=false"):
        compute_plan(cfg, world_size=2, model=preset_config("tiny"))
    dense = load_config("conf/grpo_tiny.yaml", ["actor.router_aux_loss_coef=0.01"])
    with pytest.raises(UserError, match=r"actor.router_aux_loss_coef=0.01 .* no experts; remove"):
        compute_plan(dense, world_size=2, model=preset_config("tiny"))
    with pytest.raises(UserError, match=r"actor.router_aux_loss_coef\(-1.0\) must be >= 0"):
        compute_plan(load_config("conf/grpo_tiny.yaml", ["actor.router_aux_loss_coef=-1.0"]), world_size=2, model=MOE)


def test_megatron_backend_plans_moe_at_ep1_and_refuses_what_it_cannot_run():
    pytest.importorskip("megatron.core")
    cfg = load_config("conf/grpo_tiny.yaml", ["ref.backend=megatron", "trainer.device=cpu"])
    assert compute_plan(cfg, world_size=2, model=MOE).groups["ref"].dp == 2
    with pytest.raises(UserError, match=r"ref.backend=megatron: ref.ep=2: megatron-core's expert parallelism is wired "
                                        r".* use ref.ep=1 with the megatron backend, or ref.backend=native"):
        compute_plan(load_config("conf/grpo_tiny.yaml", ["ref.backend=megatron", "trainer.device=cpu", "ref.ep=2"]),
                     world_size=2, model=MOE)
    full_ac = load_config("conf/grpo_tiny.yaml", ["actor.backend=megatron", "trainer.device=cuda",
                                                  "actor.activation_checkpointing=full"])
    with pytest.raises(UserError, match=r"actor.backend=megatron with a mixture of experts: "
                                        r"activation_checkpointing=full is not supported: .* use none"):
        compute_plan(full_ac, world_size=2, model=MOE)


@pytest.mark.parametrize("overrides, world, message", [
    (["actor.ep=3"], 6, r"actor.ep\(3\) must divide num_experts\(8\)"),
    (["actor.ep=4"], 2, r"actor.ep\(4\) must divide its dp\(2\)"),
    (["ref.ep=0"], 2, r"ref.ep\(0\) must be >= 1"),
])
def test_expert_parallel_layouts_that_cannot_split_are_refused(overrides, world, message):
    with pytest.raises(UserError, match=message):
        compute_plan(load_config("conf/grpo_tiny.yaml", overrides), world_size=world, model=MOE)


def test_expert_parallelism_plans_inside_dp_and_shows_in_the_plan():
    cfg = load_config("conf/grpo_tiny.yaml", ["actor.ep=2", "ref.ep=4"])
    plan = compute_plan(cfg, world_size=4, model=MOE)
    assert (plan.groups["actor"].ep, plan.groups["ref"].ep, plan.groups["rollout"].ep) == (2, 4, 1)
    assert plan.groups["actor"].dims.edp == 2
    header, rule, *rows = plan.table().splitlines()[1:]
    assert header.split()[3:8] == ["tp", "pp", "dp", "ep", "notes"]
    actor = next(r for r in rows if r.split()[0] == "actor")
    assert actor.split()[3:7] == ["1", "1", "4", "2"]
    assert "2 expert-parallel ranks of 1/2 of the experts, 2 replicas" in actor
    with pytest.raises(UserError, match=r"actor.ep=2 spreads a mixture of experts' experts over ranks, and the "
                                        r"model \(llama\) has no experts; use actor.ep=1"):
        compute_plan(load_config("conf/grpo_tiny.yaml", ["actor.ep=2"]), world_size=2, model=preset_config("tiny"))


def test_cost_model_counts_expert_memory_divided_by_ep():
    """Training states per GPU: the non-expert parameters sharded over dp (FSDP), the experts over ep (each rank
    holds 1/ep of them whole); at ep = 1 FSDP shards everything over dp."""
    from launcher.planning.autoplan import candidate_from_plan
    from launcher.planning.costmodel import build_workload, load_calibration
    from launcher.planning.stepmodel import pool_memory

    states, per_param = {}, None
    for ep in (1, 2):
        cfg = load_config("conf/grpo_tiny.yaml", [f"actor.ep={ep}"])
        plan = compute_plan(cfg, world_size=4, model=MOE)
        w = build_workload(cfg, model=MOE)
        items, _, _ = pool_memory(w, load_calibration("h200"), candidate_from_plan(plan, is_async=False), 0)
        states[ep] = items["actor_states"] * 1e9
        if ep == 1:
            per_param = (items["actor_states"] * 1e9 * 4) / w.actor.n_params
    experts, rest = MOE.expert_params(), w.actor.n_params - MOE.expert_params()
    assert experts == 8 * 3 * 64 * 32  # one MoE layer (layer 0 is dense): 8 experts x 3 x H x I
    assert states[1] == pytest.approx((rest + experts) * per_param / 4)
    assert states[2] == pytest.approx(rest * per_param / 4 + experts * per_param / 2)
