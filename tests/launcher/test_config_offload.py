"""`<role>.offload_optimizer`: accepted on the roles that own an optimizer, refused where it cannot act
(with `<role>.offload`, which would have nothing to move; on roles without an optimizer it is no key),
and the committed 7B config turns on the memory choreography it documents."""

import pytest

from launcher.config import load_config
from launcher.errors import UserError


def test_offload_optimizer_on_actor_and_critic():
    cfg = load_config("conf/ppo_tiny.yaml", ["actor.offload_optimizer=true", "critic.offload_optimizer=true"])
    assert cfg.actor.offload_optimizer and cfg.critic.offload_optimizer


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_offload_optimizer_with_offload_is_refused(role):
    with pytest.raises(UserError, match=f"{role}.offload=false"):
        load_config("conf/ppo_tiny.yaml", [f"{role}.offload_optimizer=true", f"{role}.offload=true"])


@pytest.mark.parametrize("role", ["ref", "reward", "rollout"])
def test_offload_optimizer_is_no_key_without_an_optimizer(role):
    with pytest.raises(UserError, match=f"unknown config key '{role}.offload_optimizer'"):
        load_config("conf/ppo_tiny.yaml", [f"{role}.offload_optimizer=true"])


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
