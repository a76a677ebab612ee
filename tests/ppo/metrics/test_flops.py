"""ppo/metrics/flops.py: the FLOP accounting behind perf/useful_util and perf/mfu/actor (DESIGN.md "Honest numbers")."""

from __future__ import annotations

import pytest

from ppo.metrics.flops import ppo_stage_flops, ppo_step_flops, useful_utilization


def test_flop_counts_follow_design_rule():
    n, t, g = 7_000_000_000, 1000, 400
    full = ppo_stage_flops(n_params_actor=n, n_params_critic=n, n_params_ref=n, n_params_rm=n,
                           trained_tokens=t, generated_tokens=g, ppo_epochs=1)
    # DESIGN.md: 20N per trained token for full PPO (6+6 train, 4 x 2 forwards) + 2N per generated token
    assert sum(full.values()) == pytest.approx(20 * n * t + 2 * n * g)
    assert full["update_actor"] == 6 * n * t and full["gen"] == 2 * n * g
    grpo = ppo_step_flops(n_params_actor=n, n_params_critic=None, n_params_ref=n, n_params_rm=None,
                          trained_tokens=t, generated_tokens=g, ppo_epochs=2)
    assert grpo == pytest.approx((2 * 6 + 2 + 2) * n * t + 2 * n * g)
    fused = ppo_step_flops(n_params_actor=n, n_params_critic=None, n_params_ref=n, n_params_rm=None,
                           trained_tokens=t, generated_tokens=g, ppo_epochs=1, old_logp_forward=False)
    assert fused == pytest.approx(8 * n * t + 2 * n * g)  # the GRPO rule: 6N update + 2N reference
    shared = ppo_stage_flops(n_params_actor=n, n_params_critic=n, n_params_ref=n, n_params_rm=None,
                             trained_tokens=t, generated_tokens=g, ppo_epochs=1, policy_tokens=600)
    assert shared["update_actor"] == 6 * n * 600 and shared["ref"] == 2 * n * 600
    assert shared["update_critic"] == 6 * n * t  # the critic still packs whole sequences
    with_prefill = ppo_stage_flops(n_params_actor=n, n_params_critic=None, n_params_ref=None, n_params_rm=None,
                                   trained_tokens=t, generated_tokens=g, ppo_epochs=1, prefill_tokens=600)
    assert with_prefill["gen"] == 2 * n * (g + 600) and with_prefill["ref"] == 0.0


def test_useful_utilization():
    assert useful_utilization(790e12 * 8 * 0.5, 1.0, n_gpus=8) == pytest.approx(0.5)
    assert useful_utilization(1e12, 2.0, n_gpus=1, peak_flops=1e12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="seconds > 0"):
        useful_utilization(1.0, 0.0, n_gpus=1)
