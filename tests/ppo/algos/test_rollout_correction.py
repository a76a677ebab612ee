"""ppo/algos/rollout_correction.py against a hand computation over Python floats."""

from __future__ import annotations

import math

import pytest
import torch

from ppo.algos import core_algos as ca
from ppo.algos.rollout_correction import ROLLOUT_CORRECTIONS, compute_rollout_correction


def _batch(seed=0, b=6, t=7):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([7, 1, 4, 6, 3, 0])[:b]  # one empty row: never masked, weights all 0
    mask = (torch.arange(t)[None] < lens[:, None]).float()
    rollout = -torch.rand(b, t, generator=g) * 2
    train = rollout + torch.randn(b, t, generator=g) * 0.5
    train[1, 0] = rollout[1, 0] + 1.5  # one token far above the cap (ratio e^1.5 = 4.5)
    train[3] = rollout[3] + 0.02  # a sequence with a small, uniform mismatch
    train = torch.where(mask > 0, train, torch.full_like(train, float("-inf")))  # padding is garbage
    return train, rollout, mask


def _naive(train, rollout, mask, mode, cap, thr):
    b, t = len(mask), len(mask[0])
    w = [[0.0] * t for _ in range(b)]
    tok_ratios, diffs, k3s, truncated, masked = [], [], [], 0, 0
    for i in range(b):
        idx = [j for j in range(t) if mask[i][j] > 0]
        lr = {j: train[i][j] - rollout[i][j] for j in idx}
        seq = math.exp(sum(lr.values()) / len(idx)) if idx else 1.0
        drop = mode in ("seq_mask", "tis+seq_mask") and not (1 / thr <= seq <= thr)
        masked += drop
        for j in idx:
            r = math.exp(lr[j])
            tok_ratios.append(r)
            diffs.append(lr[j])
            k3s.append(r - 1 - lr[j])
            wt = r if r <= cap or mode not in ("tis", "tis+seq_mask") else cap
            truncated += mode in ("tis", "tis+seq_mask") and r > cap
            w[i][j] = 0.0 if drop else (wt if mode in ("tis", "tis+seq_mask") else 1.0)
    n = len(tok_ratios)
    metrics = {"kl": -sum(diffs) / n, "k3_kl": sum(k3s) / n, "ratio_mean": sum(tok_ratios) / n,
               "ratio_max": max(tok_ratios), "ratio_min": min(tok_ratios),
               "logprob_diff_max": max(abs(d) for d in diffs), "tis_clipfrac": truncated / n, "masked_frac": masked / b}
    return w, metrics


@pytest.mark.parametrize("mode", ROLLOUT_CORRECTIONS)
def test_rollout_correction_matches_hand_computation(mode):
    train, rollout, mask = _batch()
    cap, thr = 2.0, 1.05
    w, met = compute_rollout_correction(train, rollout, mask, mode=mode, is_cap=cap, seq_mask_threshold=thr)
    want_w, want_m = _naive(train.tolist(), rollout.tolist(), mask.tolist(), mode, cap, thr)
    torch.testing.assert_close(w, torch.tensor(want_w), rtol=1e-5, atol=1e-6)
    for k, v in want_m.items():
        assert met[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    assert not w.requires_grad
    if "tis" in mode:
        assert met["tis_clipfrac"] > 0 and w.max() <= cap
    if "seq_mask" in mode:  # the mismatched rows go, the uniform 0.02 row (ratio 1.02 < 1.05) stays
        assert 0 < met["masked_frac"] < 1 and (w[3] > 0).sum() == 6


def test_rollout_correction_is_identity_when_engine_and_trainer_agree():
    _, rollout, mask = _batch(seed=1)
    for mode in ROLLOUT_CORRECTIONS:
        w, met = compute_rollout_correction(rollout, rollout, mask, mode=mode)
        torch.testing.assert_close(w, mask)
        assert met["kl"] == 0 and met["k3_kl"] == 0 and met["ratio_max"] == met["ratio_min"] == 1.0
        assert met["tis_clipfrac"] == 0 and met["masked_frac"] == 0


def test_tis_weights_scale_the_policy_loss_gradient():
    # with ratio pi/pi_old == 1 (fused old log-probs), d loss / d logp = -A * w / N per token
    train, rollout, mask = _batch(seed=2)
    w, _ = compute_rollout_correction(train, rollout, mask, mode="tis", is_cap=2.0)
    lp = torch.where(mask > 0, train, torch.zeros_like(train)).requires_grad_()
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3))
    loss, _ = ca.policy_loss(lp, lp.detach(), adv, mask, token_weights=w)
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv * w * mask / mask.sum())


def test_rollout_correction_rejects_bad_settings():
    train, rollout, mask = _batch()
    with pytest.raises(ValueError, match="tis"):
        compute_rollout_correction(train, rollout, mask, mode="is")
    with pytest.raises(ValueError, match="rollout_is_cap"):
        compute_rollout_correction(train, rollout, mask, mode="tis", is_cap=1.0)
    with pytest.raises(ValueError, match="rollout_mask_threshold"):
        compute_rollout_correction(train, rollout, mask, mode="seq_mask", seq_mask_threshold=0.9)


def test_metrics_without_sync_are_tensors():
    train, rollout, mask = _batch()
    _, met = compute_rollout_correction(train, rollout, mask, mode="tis", sync_metrics=False)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in met.values())
