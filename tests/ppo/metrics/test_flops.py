"""ppo/metrics/flops.py: the FLOP accounting behind perf/useful_util and perf/mfu/actor (docs/design.md)."""

from __future__ import annotations

import pytest

from models.config import ModelConfig
from ppo.metrics.flops import (
    ppo_stage_flops,
    ppo_step_flops,
    spec_peak_flops,
    update_matmul_flops,
    useful_utilization,
)


def test_flop_counts_follow_design_rule():
    n, t, g = 7_000_000_000, 1000, 400
    full = ppo_stage_flops(n_params_actor=n, n_params_critic=n, n_params_ref=n, n_params_rm=n,
                           trained_tokens=t, generated_tokens=g, ppo_epochs=1)
    # docs/design.md: 20N per trained token for full PPO (6+6 train, 4 x 2 forwards) + 2N per generated token
    assert sum(full.values()) == pytest.approx(20 * n * t + 2 * n * g)
    assert full["update_actor"] == 6 * n * t and full["gen"] == 2 * n * g
    grpo = ppo_step_flops(n_params_actor=n, n_params_critic=None, n_params_ref=n, n_params_rm=None,
                          trained_tokens=t, generated_tokens=g, ppo_epochs=2)
    assert grpo == pytest.approx((2 * 6 + 2 + 2) * n * t + 2 * n * g)
    fused = ppo_step_flops(n_params_actor=n, n_params_critic=None, n_params_ref=n, n_params_rm=None,
                           trained_tokens=t, generated_tokens=g, ppo_epochs=1, old_logp_share=0.0)
    assert fused == pytest.approx(8 * n * t + 2 * n * g)  # the GRPO rule: 6N update + 2N reference
    # fused_first over 2 mini-batches: the second half's forward only
    half = ppo_stage_flops(n_params_actor=n, n_params_critic=None, n_params_ref=n, n_params_rm=None,
                           trained_tokens=t, generated_tokens=g, ppo_epochs=1, old_logp_share=0.5,
                           attention_policy=1e9)
    assert half["old_log_prob"] == pytest.approx((2 * n * t + 1e9) / 2)
    shared = ppo_stage_flops(n_params_actor=n, n_params_critic=n, n_params_ref=n, n_params_rm=None,
                             trained_tokens=t, generated_tokens=g, ppo_epochs=1, policy_tokens=600)
    assert shared["update_actor"] == 6 * n * 600 and shared["ref"] == 2 * n * 600
    assert shared["update_critic"] == 6 * n * t  # the critic still packs whole sequences
    with_prefill = ppo_stage_flops(n_params_actor=n, n_params_critic=None, n_params_ref=None, n_params_rm=None,
                                   trained_tokens=t, generated_tokens=g, ppo_epochs=1, prefill_tokens=600)
    assert with_prefill["gen"] == 2 * n * (g + 600) and with_prefill["ref"] == 0.0


def test_useful_utilization():
    assert useful_utilization(989e12 * 8 * 0.5, 1.0, n_gpus=8, peak_flops=989e12) == pytest.approx(0.5)
    assert useful_utilization(1e12, 2.0, n_gpus=1, peak_flops=1e12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="peak_flops > 0"):
        useful_utilization(1.0, 0.0, n_gpus=1, peak_flops=1e12)


def test_spec_peak_by_device_name():
    """MFU divides by the data sheet's dense bf16 peak; an unknown device (or the CPU) has none."""
    assert spec_peak_flops("NVIDIA H200") == 989e12
    assert spec_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert spec_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert spec_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert spec_peak_flops("Some Future Accelerator") is None
    assert spec_peak_flops(None) is None and spec_peak_flops("cpu") is None


def test_critic_and_reward_model_have_no_lm_head():
    cfg = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    assert cfg.matmul_params() - cfg.matmul_params(lm_head=False) == 1000 * 64


def test_attention_counts_causal_pairs_and_shared_prompts_once():
    """4 L W per attended (query, key) pair, causal; a shared prompt's own pairs once per group, each response
    attending the prompt and its own earlier tokens (checked against a naive count of the pairs)."""
    from ppo.metrics.flops import attention_forward_flops

    prompts, responses = [3, 5], [[2, 4], [1]]

    def naive(share: bool) -> int:
        pairs = 0
        for p, rs in zip(prompts, responses):
            for j, r in enumerate(rs):
                seq = p + r
                first = 0 if (j == 0 or not share) else p  # a shared prompt's queries run once per group
                pairs += sum(q + 1 for q in range(first, seq))
        return pairs

    for share in (False, True):
        got = attention_forward_flops(prompts, responses, layers=2, attn_width=8, share_prompts=share)
        assert got == 4 * 2 * 8 * naive(share)
    n, t = 1000, 15
    flops = ppo_stage_flops(n_params_actor=n, n_params_critic=n, n_params_ref=n, n_params_rm=None, trained_tokens=t,
                            generated_tokens=7, ppo_epochs=2, attention_policy=10.0, attention_full=20.0)
    assert flops["update_actor"] == 2 * (6 * n * t + 30.0) and flops["ref"] == 2 * n * t + 10.0
    assert flops["update_critic"] == 2 * (6 * n * t + 60.0) and flops["gen"] == 2 * n * 7 + 10.0


def test_a_lora_update_counts_no_weight_gradients_for_the_frozen_base():
    n, a = 1_000_000, 10_000
    assert update_matmul_flops(n) == 6 * n
    assert update_matmul_flops(n, a) == 4 * n + 6 * a  # forward and input grads over N + A, weight grads of A
    kw = dict(n_params_actor=n, n_params_critic=None, n_params_ref=n, n_params_rm=None, trained_tokens=100,
              generated_tokens=50, ppo_epochs=2)
    full, lora = ppo_stage_flops(**kw), ppo_stage_flops(**kw, adapter_params_actor=a)
    assert full["update_actor"] == 2 * 100 * 6 * n and lora["update_actor"] == 2 * 100 * (4 * n + 6 * a)
    assert {k: v for k, v in lora.items() if k != "update_actor"} == {k: v for k, v in full.items()
                                                                    if k != "update_actor"}
