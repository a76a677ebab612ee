"""Learning, asserted: the CPU demo's PPO (critic, KL penalty) and GRPO raise the reward on the tiny addition
task by a margin that a run at actor learning rate 0 does not reach (the control proves the check can fail).

One process: what is asserted is learning (the distributed paths have tests of their own), and on the tiny
model a second rank roughly doubles the run's CPU time (each rank pays the per-step Python cost). GRPO's
warm-up sees PPO's examples (70 steps of 32 = 35 of 64; at 35 it starts near 0.05, where few groups of 4 have
a reward to compare).

Measured rises (last 10 minus first 10 steps' mean reward; a mean of 10 steps has a standard deviation of about
0.02 here), trainer.seed 42 / 1 (2026-12-04): PPO 60 steps 0.156 / 0.197; GRPO (32 prompts x 4) 60 steps
0.157 / 0.120; GRPO with trainer.max_staleness=2 (batches trained two steps after the policy that sampled them,
the PPO ratio against the engine's log-probs) 0.138 at seed 42; the control, 20 steps at actor lr 0, 0.003 / -0.008;
GRPO with the tiny Qwen3-MoE, routing replay and actor.router_aux_loss_coef=0.01, 60 steps 0.232 / 0.178.
GRPO with LoRA (r 16, alpha 32, lr 2e-3) on every linear layer and the head (2026-12-04), 60 steps: 0.205 / 0.103
(sync merged), 0.248 / 0.201 (sync adapters); 40 steps with sync adapters (the test): 0.168 / 0.077; the same without
lm_head, 60 steps: -0.001 at seed 42 (the reward stays at 0.002 from the LoRA warm-up on: the tiny model's frozen
random head caps its logit margins, docs/lora.md).
"""

from __future__ import annotations

import json
import statistics

import pytest

from tests.ppo.test_trainer import _ok, launch, metrics

WINDOW = 10  # steps averaged at each end
MARGIN = 0.08  # the rise the last window's mean reward must show over the first's
QUIET = ["trainer.save_every=0", "trainer.save_final=false"]


def reward_rise(rows: list[dict]) -> float:
    """Mean reward of the last WINDOW steps minus that of the first WINDOW steps."""
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) >= 2 * WINDOW, f"{len(rewards)} steps: too few for two windows of {WINDOW}"
    return statistics.mean(rewards[-WINDOW:]) - statistics.mean(rewards[:WINDOW])


def learns(rows: list[dict]) -> bool:
    return reward_rise(rows) >= MARGIN


def _run(tmp_path, config: str, *overrides: str) -> list[dict]:
    # the demo's own settings (no TINY shrinking): its SFT warm-up, batch and response length
    res = launch(tmp_path, 1, config, *QUIET, "data.batch_size=64", "rollout.max_response_length=4",
                 "trainer.sft_warmup_steps=35", "actor.mini_batch_size=32",
                 "data.task_size=4096", "actor.ppo_epochs=2", "critic.mini_batch_size=32", *overrides, timeout=600)
    _ok(res)
    name = "grpo_tiny" if "grpo" in config else "ppo_tiny"
    return metrics(tmp_path / name)


@pytest.mark.distributed
@pytest.mark.slow
def test_ppo_with_a_critic_learns(tmp_path):
    rows = _run(tmp_path, "conf/ppo_tiny.yaml", "trainer.total_steps=60")
    assert learns(rows), f"reward rose by {reward_rise(rows):.3f} < {MARGIN}"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.extended  # for the CI budget: synchronous GRPO learns in make test through the verl recipe, MoE and LoRA
def test_grpo_learns(tmp_path):
    rows = _run(tmp_path, "conf/grpo_tiny.yaml", "trainer.total_steps=60", "data.batch_size=32",
                "trainer.sft_warmup_steps=70")
    assert learns(rows), f"reward rose by {reward_rise(rows):.3f} < {MARGIN}"


@pytest.mark.distributed
@pytest.mark.slow
def test_grpo_learns_two_steps_stale(tmp_path):
    rows = _run(tmp_path, "conf/grpo_tiny.yaml", "trainer.total_steps=60", "data.batch_size=32",
                "trainer.sft_warmup_steps=70", "trainer.max_staleness=2")
    assert [r["async/staleness_max"] for r in rows[:4]] == [0, 1, 2, 2]
    assert learns(rows), f"reward rose by {reward_rise(rows):.3f} < {MARGIN}"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.extended  # 19 s beyond make test's budget: a check of the learning checks, not of the trainer
def test_a_run_at_learning_rate_0_does_not_pass_the_check(tmp_path):
    """The control: the same warm-up, then PPO whose actor cannot move; the check above must fail on it (20
    steps: the two windows; with the policy frozen the reward is stationary, more steps change nothing)."""
    rows = _run(tmp_path, "conf/ppo_tiny.yaml", "trainer.total_steps=20", "actor.optim.lr=0")
    assert not learns(rows), f"reward rose by {reward_rise(rows):.3f} with the actor frozen"


@pytest.mark.distributed
@pytest.mark.slow
def test_grpo_with_a_mixture_of_experts_policy_learns(tmp_path):
    """The tiny Qwen3-MoE (8 experts, top-2) with routing replay and its load-balancing loss in the actor's, weighted
    by actor.router_aux_loss_coef (the exported checkpoint's config.json carries it)."""
    rows = _run(tmp_path, "conf/grpo_tiny.yaml", "model.preset=tiny-qwen3-moe", "actor.router_replay=true",
                "actor.router_aux_loss_coef=0.01", "trainer.total_steps=60", "data.batch_size=32",
                "trainer.sft_warmup_steps=70", "trainer.save_final=true")
    assert learns(rows), f"reward rose by {reward_rise(rows):.3f} < {MARGIN}"
    assert all("actor/aux_loss" in r and "actor/router_mismatch" in r for r in rows)
    exported = json.loads((tmp_path / "grpo_tiny" / "checkpoints" / "step_60" / "actor" / "config.json").read_text())
    assert exported["router_aux_loss_coef"] == 0.01


@pytest.mark.distributed
@pytest.mark.slow
def test_grpo_with_lora_on_the_linear_layers_and_the_head_learns(tmp_path):
    """LoRA as a PEFT user sets it up for a model whose head must learn: adapters on every linear layer and on
    lm_head (target_modules all-linear + lm_head), the warm-up and GRPO training the adapters only. The engine
    applies them in its GEMMs (sync adapters) and its log-probs stay the trainer's."""
    rows = _run(tmp_path, "conf/grpo_tiny.yaml", "trainer.total_steps=40", "data.batch_size=32",
                "trainer.sft_warmup_steps=70", "actor.lora.rank=16", "actor.lora.alpha=32", "actor.optim.lr=2e-3",
                "actor.lora.target_modules=[all-linear,lm_head]", "actor.lora.sync=adapters")
    assert learns(rows), f"reward rose by {reward_rise(rows):.3f} < {MARGIN}"
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4
    sent = [r["reshard/engine_bytes"] for r in rows]
    assert len(set(sent[1:])) == 1 and sent[1] < sent[0] / 3  # the adapters alone after the first update
