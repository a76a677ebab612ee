"""Trajectories in training: observation tokens (loss mask 0) get exactly zero gradient from every loss term,
whatever the advantage estimator, aggregation, KL, entropy or rollout correction; GRPO groups trajectories."""

import pytest
import torch

from ppo.algos import core_algos as algos
from ppo.algos.core_algos import PolicyLossSettings
from ppo.algos.policy_losses import compute_policy_loss
from ppo.batch.experience import Experience, Sample
from ppo.batch.step_batch import compute_step_batch
from ppo.metrics.step_metrics import agent_metrics
from ppo.settings import AdvantageSettings

# sample 0: 3 sampled, 2 observed, 2 sampled; sample 1: single turn; samples 2-3: another group
MASKS = [[1, 1, 1, 0, 0, 1, 1], None, [1, 0, 0, 0, 1], [1, 1, 0, 1]]


def experience():
    samples = []
    for i, m in enumerate(MASKS):
        n = len(m) if m else 6
        lps = [-0.3 - 0.01 * t if (m is None or m[t]) else 0.0 for t in range(n)]
        samples.append(Sample(uid=i, prompt_index=i // 2, prompt_ids=[1, 2, 3], response_ids=[5] * n,
                              behaviour_logprobs=lps, finish_reason="stop", loss_mask=m,
                              agent={"turns": 1 + (m is not None), "tool_calls": int(m is not None),
                                     "tool_errors": 0, "truncated_observations": 0,
                                     "sampled_tokens": sum(m) if m else n,
                                     "observation_tokens": (len(m) - sum(m)) if m else 0}))
    return Experience(samples)


def observed(exp):
    out = torch.zeros(len(exp.samples), exp.max_response_len, dtype=torch.bool)
    for i, m in enumerate(MASKS):
        if m:
            out[i, : len(m)] = ~torch.tensor(m, dtype=torch.bool)
    return out


@pytest.mark.parametrize("estimator", ["grpo", "ppo", "rloo", "reinforce_pp"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_observation_tokens_get_exactly_zero_gradient(estimator, agg):
    exp = experience()
    obs = observed(exp)
    mask = exp.response_mask()
    assert not (mask & obs).any() and mask.sum() == sum(sum(m) if m else 6 for m in MASKS)
    g = torch.Generator().manual_seed(0)
    shape = mask.shape
    merged = {"score": {i: torch.tensor(float(i % 3)) for i in range(4)},
              "old_logp": {i: -torch.rand(len(s.response_ids), generator=g) for i, s in enumerate(exp.samples)},
              "values": {i: torch.randn(len(s.response_ids), generator=g) for i, s in enumerate(exp.samples)}}
    ref = -torch.rand(shape, generator=g)
    a = AdvantageSettings(name=estimator, use_kl_penalty=True, rollout_correction="tis+seq_mask")
    batch, metrics, _ = compute_step_batch(exp, merged, a=a, n=2, max_response_length=8, kl_coef=0.1,
                                           old_logp="recompute", ref_logp=ref)
    assert (batch.advantages[obs] == 0).all() and batch.rollout_logp is not None
    logp = (batch.old_logp + 0.05 * torch.randn(shape, generator=g)).requires_grad_(True)
    entropy = torch.rand(shape, generator=g).requires_grad_(True)
    s = PolicyLossSettings(agg=agg, entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, max_len=8,
                           rollout_correction="tis+seq_mask", rollout_mask_threshold=10.0)
    loss, _ = compute_policy_loss(logp, old_logp=batch.old_logp, advantages=batch.advantages, mask=batch.mask,
                                  settings=s, entropy=entropy, ref_logp=ref, rollout_logp=batch.rollout_logp)
    values = torch.randn(shape, generator=g).requires_grad_(True)
    returns = batch.returns if batch.returns is not None else torch.randn(shape, generator=g)
    vf, _ = algos.value_loss(values, torch.zeros(shape), returns, batch.mask, agg=agg if "norm" not in agg else
                             "token-mean")
    (loss + vf).backward()
    for grad in (logp.grad, entropy.grad, values.grad):
        assert (grad[obs] == 0).all()  # exactly zero, not small
        assert (grad[batch.mask] != 0).any()  # the sampled tokens do learn
    assert metrics["rollout/logprob_diff_max"] < 1.5  # compared over sampled tokens only


def test_agent_metrics_count_turns_tools_and_tokens():
    m = agent_metrics(experience())
    assert m["agent/turns_mean"] == 1.75 and m["agent/tool_calls_mean"] == 0.75
    assert m["agent/observation_tokens_mean"] == (2 + 3 + 1) / 4 and m["agent/truncated_frac"] == 0
    assert agent_metrics(Experience([Sample(0, 0, [1], [2], [-1.0], "stop")])) == {}
