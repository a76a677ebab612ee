"""Rollout-training mismatch correction: the engine that sampled a response and the trainer that
scores it disagree on its log-probs (bf16 kernels, different reduction orders: up to 0.07-0.09 per
token measured on the H200), so the "on-policy" samples are slightly off-policy. Truncated importance
sampling (TIS, Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training") reweights each token by min(pi_train / pi_rollout, cap); sequence masking drops whole
responses whose mismatch is large (their gradient is dominated by numerical noise).

Shapes: B sequences, T response tokens; `mask` [B, T] is 1 on response tokens. `train_logp` are
the trainer's log-probs at the weights that generated the batch (the old log-probs), `rollout_logp`
the engine's (behaviour log-probs). Checked against a hand loop in tests/ppo/test_rollout_correction.py.
"""

from __future__ import annotations

from typing import Any

import torch

from ppo.algos.core_algos import masked_mean, masked_sum

ROLLOUT_CORRECTIONS = ("none", "tis", "seq_mask", "tis+seq_mask")
METRIC_KEYS = ("kl", "k3_kl", "ratio_mean", "ratio_max", "ratio_min", "logprob_diff_max", "tis_clipfrac",
               "masked_frac")


def resolve_mode(mode: str, *, max_staleness: int) -> str:
    """`auto` -> tis on-policy (max_staleness 0); none with batches generated ahead (max_staleness >= 1), where
    the trainer never computes log-probs at the behaviour weights (its PPO ratio divides by the engine's log-probs
    directly)."""
    if mode == "auto":
        return "none" if max_staleness else "tis"
    return mode


def compute_rollout_correction(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *,
                               mode: str = "tis", is_cap: float = 2.0, seq_mask_threshold: float = 1.01,
                               sync_metrics: bool = True) -> tuple[torch.Tensor, dict[str, Any]]:
    """Per-token loss weights [B, T] (no gradient) and mismatch metrics.

    ratio = exp(train_logp - rollout_logp) per token.
    tis:      weight = min(ratio, is_cap) (one-sided truncation: a token the engine over-sampled is
              down-weighted, one the trainer likes more is capped so no token dominates the batch).
    seq_mask: weight = 0 for every token of a sequence whose geometric-mean ratio
              exp(mean_t log ratio) lies outside [1 / seq_mask_threshold, seq_mask_threshold].
    none:     weight = 1 (metrics only).
    Metrics (always, whatever the mode): kl = mean(rollout_logp - train_logp) (k1 estimate of
    KL(pi_rollout || pi_train) from the engine's samples), k3_kl (its non-negative k3 form), the
    token ratio's mean/max/min, the largest |log-prob difference|, tis_clipfrac (tokens truncated)
    and masked_frac (sequences masked). Floats, or 0-dim tensors when sync_metrics=False.
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}; choose one of {', '.join(ROLLOUT_CORRECTIONS)}")
    if is_cap <= 1.0:
        raise ValueError(f"rollout_is_cap must be > 1 (got {is_cap}): a cap at or below 1 down-weights every token")
    if seq_mask_threshold <= 1.0:
        raise ValueError(f"rollout_mask_threshold must be > 1 (got {seq_mask_threshold}): it bounds the "
                         f"geometric-mean ratio to [1/threshold, threshold]")
    with torch.no_grad():
        m = mask.float()
        on = m > 0
        # padding may hold -inf/NaN log-probs: zero the difference there before exp
        log_ratio = torch.where(on, train_logp.float() - rollout_logp.float(), torch.zeros_like(m))
        ratio = log_ratio.clamp(-20.0, 20.0).exp()
        weights = m.clone()
        truncated = torch.zeros_like(m)
        if mode in ("tis", "tis+seq_mask"):
            truncated = (ratio > is_cap).float() * m
            weights = weights * ratio.clamp(max=is_cap)
        seq_log_ratio = masked_mean(log_ratio, m, -1)  # [B], 0 for empty rows (never masked)
        masked = torch.zeros_like(seq_log_ratio)
        if mode in ("seq_mask", "tis+seq_mask"):
            bound = torch.log(torch.tensor(seq_mask_threshold, dtype=torch.float32))
            masked = (seq_log_ratio.abs() > bound).float()
            weights = weights * (1.0 - masked)[:, None]
        big = torch.finfo(torch.float32).max
        lo = torch.where(on, ratio, torch.full_like(ratio, big)).min() if ratio.numel() else torch.tensor(big)
        hi = torch.where(on, ratio, torch.full_like(ratio, -big)).max() if ratio.numel() else torch.tensor(-big)
        empty = lo > hi
        stats = torch.stack([
            masked_mean(-log_ratio, m),
            # k3 of KL(rollout || train) on the engine's samples: (r - 1) - log r, r = train/rollout
            masked_mean(torch.expm1(log_ratio.clamp(-20.0, 20.0)) - log_ratio.clamp(-20.0, 20.0), m),
            masked_mean(ratio, m), torch.where(empty, 1.0, hi), torch.where(empty, 1.0, lo),
            (log_ratio.abs() * m).max() if m.numel() else torch.tensor(0.0),
            masked_sum(truncated, m) / m.sum().clamp_min(1), masked.mean() if masked.numel() else torch.tensor(0.0),
        ])
    metrics = dict(zip(METRIC_KEYS, stats.tolist() if sync_metrics else stats.unbind()))
    return weights, metrics
