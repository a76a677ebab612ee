"""`<role>.offload_optimizer` (Adam's moments in host memory all the time, streamed through the step): accepted
on the roles that own an optimizer, refused beside `actor.offload_optimizer_while_generating` (which would have
nothing to move); on roles without an optimizer it is no key, and neither is an offload while generating on any
role but the actor. The committed 7B config turns on the memory choreography it documents."""

import pytest

from launcher.config.load import load_config
from launcher.errors import UserError


def test_offload_optimizer_on_actor_and_critic():
    cfg = load_config("conf/ppo_tiny.yaml", ["actor.offload_optimizer=true", "critic.offload_optimizer=true"])
    assert cfg.actor.offload_optimizer and cfg.critic.offload_optimizer


def test_offload_optimizer_with_offload_while_generating_is_refused():
    with pytest.raises(UserError, match="set actor.offload_optimizer_while_generating=false"):
        load_config("conf/ppo_tiny.yaml", ["actor.offload_optimizer=true",
                                           "actor.offload_optimizer_while_generating=true"])
    cfg = load_config("conf/ppo_7b_colocated.yaml")
    assert cfg.actor.offload_optimizer_while_generating and not cfg.actor.offload_optimizer


@pytest.mark.parametrize("role", ["ref", "reward", "rollout"])
def test_offload_optimizer_is_no_key_without_an_optimizer(role):
    with pytest.raises(UserError, match=f"unknown config key '{role}.offload_optimizer'"):
        load_config("conf/ppo_tiny.yaml", [f"{role}.offload_optimizer=true"])


@pytest.mark.parametrize("role", ["critic", "ref", "reward", "rollout"])
def test_only_the_actor_offloads_while_generating(role):
    with pytest.raises(UserError, match=f"unknown config key '{role}.offload_optimizer_while_generating'"):
        load_config("conf/ppo_tiny.yaml", [f"{role}.offload_optimizer_while_generating=true"])


def test_bench_grpo_7b_config():
    cfg = load_config("conf/bench_grpo_7b.yaml")
    base = load_config("conf/bench_grpo_1b.yaml")
    assert cfg.model.preset == "llama-7b" and cfg.actor.offload_optimizer
    assert cfg.actor.activation_checkpointing == "full" and cfg.rollout.free_memory_on_sleep
    # the workload itself is not shrunk: same batch, lengths, samples and reference KL
    for key in ("batch_size", "max_prompt_length", "task"):
        assert getattr(cfg.data, key) == getattr(base.data, key)
    assert (cfg.rollout.n, cfg.rollout.max_response_length) == (base.rollout.n, base.rollout.max_response_length)
    assert cfg.actor.use_kl_loss and cfg.ref.enabled


def test_cost_model_counts_the_choreography():
    """launcher/planning/costmodel.py sees what the 7B config changes: the actor keeps 8 of its 16 bytes/param on
    the GPU, the frozen reference 2 (bf16), and each update pays N x 8 bytes over PCIe."""
    from launcher.planning.costmodel import Candidate, build_workload, load_calibration, model_pass_s
    from launcher.planning.stepmodel import pool_memory
    from models.config import preset_config

    cfg = load_config("conf/bench_grpo_7b.yaml")
    model = preset_config("llama-7b")
    cal = load_calibration("h200")
    on, off = (build_workload(load_config("conf/bench_grpo_7b.yaml", [f"actor.offload_optimizer={v}"]), model=model)
               for v in ("true", "false"))
    assert on.offload_optimizer == ("actor",) and off.offload_optimizer == ()
    assert on.frozen_bytes_per_param == 2
    n = on.actor.n_params
    roles = ("actor", "rollout", "ref", "reward")
    one_gpu = Candidate(mode="colocated", pools=((roles, 1),), layouts=tuple((r, (1, 1, 1)) for r in roles),
                        gen_tp=1, is_async=False)
    items, peak, slots = pool_memory(on, cal, one_gpu, 0)
    assert items["actor_states"] == pytest.approx(n * 8 / 1e9) and items["ref_states"] == pytest.approx(n * 2 / 1e9)
    # fits, with room for a KV cache (the cost model sizes it after the engine's weights, so below 256 slots)
    assert peak < cal.hbm_gb and slots > cfg.rollout.max_num_seqs // 2
    off_items, off_peak, _ = pool_memory(off, cal, one_gpu, 0)
    assert off_items["actor_states"] == pytest.approx(n * 16 / 1e9) and off_peak > peak
    layout = (1, 1, 1)
    extra = model_pass_s(on, cal, "actor", on.actor, layout=layout, train=True) - model_pass_s(
        off, cal, "actor", off.actor, layout=layout, train=True)
    assert extra == pytest.approx(n * 8 / cal.pcie_bytes_per_s)
