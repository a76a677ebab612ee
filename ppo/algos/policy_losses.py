"""The policy-gradient term of the actor loss: which surrogate (PPO's token ratio or GSPO's sequence
ratio) and the rollout-correction weights it is multiplied by.

GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): one importance ratio per
sequence, the geometric mean of its token ratios, s_i = exp(mean_t(logp - old_logp)), clipped at
the sequence level. Token ratios of a long response multiply noise; their geometric mean does not
grow with length, and clipping decides per response, not per token.

Per-token form (the paper's GSPO-token): s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)] has the value s_i
and the gradient s_i * d log pi(y_t), so token-level advantages and every `agg_loss` mode still
apply. Shapes: B sequences, T response tokens, mask [B, T]. Checked against a per-sequence loop in
tests/ppo/test_policy_losses.py.
"""

from __future__ import annotations

from typing import Any

import torch

from ppo.algos.core_algos import (
    PolicyLossSettings,
    _metrics,
    agg_loss,
    check_dual_clip,
    kl_estimate,
    masked_mean,
    policy_loss,
    weighted_surrogate_loss,
)
from ppo.algos.rollout_correction import compute_rollout_correction

POLICY_LOSSES = ("vanilla", "gspo")


def gspo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                     clip_low: float = 3e-4, clip_high: float = 4e-4, dual_clip_c: float | None = None,
                     agg: str = "seq-mean-token-mean",
                     denom: float | None = None, max_len: int | None = None,
                     token_weights: torch.Tensor | None = None,
                     sync_metrics: bool = True) -> tuple[torch.Tensor, dict[str, Any]]:
    """Sequence-ratio clipped surrogate. logp, old_logp, advantages, mask: [B, T] -> (loss, metrics).

    loss_it = max(-A_it * s_it, -A_it * clip(s_it, 1 - clip_low, 1 + clip_high)), times
    token_weights (e.g. rollout-correction weights, no gradient) when given, aggregated by `agg`
    (the paper: seq-mean-token-mean). The paper's clip ranges are ~1e-4, far below PPO's 0.2,
    because s_i averages out per-token noise. dual_clip_c bounds a negative-advantage loss by
    -A * c as in policy_loss. Metrics carry policy_loss's keys: clipfrac (tokens in clipped
    sequences), clipfrac_lower (dual clip active), approx_kl, and the sequence ratio's mean/min/max
    over non-empty sequences.
    """
    check_dual_clip(dual_clip_c)
    m = mask.float()
    adv = advantages.float()
    lp = logp.float()
    log_ratio = torch.where(m > 0, lp - old_logp.float(), torch.zeros_like(lp))
    seq_log_ratio = masked_mean(log_ratio, m, -1)  # [B]
    # value s_i, gradient through this token's own log-prob only; clamp as exp overflow guard
    log_s = lp - lp.detach() + seq_log_ratio.detach().clamp(max=10.0)[:, None]
    ratio = log_s.exp()
    loss, clipped, lower = weighted_surrogate_loss(ratio, adv, m, clip_low=clip_low, clip_high=clip_high,
                                                   dual_clip_c=dual_clip_c, token_weights=token_weights, agg=agg,
                                                   denom=denom, max_len=max_len)
    with torch.no_grad():
        seq_ratio = seq_log_ratio.clamp(max=10.0).exp()
        has = m.sum(-1) > 0
        big = torch.finfo(torch.float32).max
        lo = torch.where(has, seq_ratio, torch.full_like(seq_ratio, big)).min() if has.numel() else torch.tensor(big)
        hi = torch.where(has, seq_ratio, torch.full_like(seq_ratio, -big)).max() if has.numel() else torch.tensor(-big)
        empty = lo > hi
        n_seq = has.float().sum().clamp_min(1)
        stats = torch.stack([
            masked_mean(clipped, m), masked_mean(lower, m), masked_mean(-log_ratio, m),
            (seq_ratio * has).sum() / n_seq, torch.where(empty, 1.0, lo), torch.where(empty, 1.0, hi),
        ])
    metrics = _metrics(("clipfrac", "clipfrac_lower", "approx_kl", "ratio_mean", "ratio_min", "ratio_max"), stats,
                       sync_metrics)
    return loss, metrics


def compute_policy_objective(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                             mask: torch.Tensor, *, cfg: PolicyLossSettings, rollout_logp: torch.Tensor | None = None,
                             denom: float | None = None, sync_metrics: bool = True) -> tuple[torch.Tensor, dict]:
    """Policy-gradient loss of one micro-batch. All tensors [B, T] -> (loss, metrics).

    old_logp: the trainer's log-probs under the weights that generated the batch (logp.detach()
    when the update's own forward serves as the old log-probs). rollout_logp: the engine's
    behaviour log-probs; with them, the mismatch metrics come back as `rollout_corr/<key>` and
    the correction weights (cfg.rollout_correction) multiply the per-token loss.
    """
    if cfg.kind not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {cfg.kind!r}; choose one of {', '.join(POLICY_LOSSES)}")
    weights, metrics = None, {}
    if rollout_logp is not None:
        w, rc = compute_rollout_correction(old_logp, rollout_logp, mask, mode=cfg.rollout_correction,
                                           is_cap=cfg.rollout_is_cap, seq_mask_threshold=cfg.rollout_mask_threshold,
                                           sync_metrics=sync_metrics)
        weights = None if cfg.rollout_correction == "none" else w
        metrics.update({f"rollout_corr/{k}": v for k, v in rc.items()})
    fn = gspo_policy_loss if cfg.kind == "gspo" else policy_loss
    loss, m = fn(logp, old_logp, advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                 dual_clip_c=cfg.dual_clip_c, agg=cfg.agg, denom=denom, max_len=cfg.max_len, token_weights=weights,
                 sync_metrics=sync_metrics)
    metrics.update(m)
    return loss, metrics


def compute_policy_loss(logp: torch.Tensor, *, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                        settings: PolicyLossSettings, entropy: torch.Tensor | None = None,
                        ref_logp: torch.Tensor | None = None, rollout_logp: torch.Tensor | None = None,
                        denom: float | None = None, sync_metrics: bool = True) -> tuple[torch.Tensor, dict]:
    """The actor's loss: clipped surrogate - entropy_coef * entropy + kl_loss_coef * KL(pi || ref).

    logp (differentiable), old_logp, advantages, mask, entropy, ref_logp: [B, T] -> (loss scalar,
    metrics). `entropy` is required when settings.needs_entropy and `ref_logp` when
    settings.needs_ref; an entropy passed without a coefficient only feeds the `entropy` metric.
    Each term is aggregated with settings.agg over `denom` (the global count, see agg_loss).
    The surrogate is settings.kind's (vanilla or GSPO); `rollout_logp` (the engine's behaviour
    log-probs) adds the rollout_corr/* mismatch metrics and settings.rollout_correction's weights.
    metrics: policy_loss's, rollout_corr/*, pg_loss, entropy (masked token mean), kl_loss: floats, or
    0-d tensors with sync_metrics=False (no device sync before backward: the caller converts them
    once its micro-batch loop is done).
    """
    s = settings
    if s.needs_entropy and entropy is None:
        raise ValueError(f"entropy_coef={s.entropy_coef} needs the per-token entropy")
    if s.needs_ref and ref_logp is None:
        raise ValueError("use_kl_loss needs the reference log-probs (ref_logp)")
    loss, metrics = compute_policy_objective(logp, old_logp, advantages, mask, cfg=s, rollout_logp=rollout_logp,
                                             denom=denom, sync_metrics=sync_metrics)
    out = float if sync_metrics else torch.Tensor.detach
    metrics["pg_loss"] = out(loss.detach())
    if entropy is not None:
        metrics["entropy"] = out(masked_mean(entropy.detach().float(), mask.float()))
        if s.needs_entropy:
            loss = loss - s.entropy_coef * agg_loss(entropy, mask, s.agg, denom=denom, max_len=s.max_len)
    if s.needs_ref:
        kl_loss = agg_loss(kl_estimate(logp, ref_logp, kind=s.kl_loss_type), mask, s.agg, denom=denom,
                           max_len=s.max_len)
        loss = loss + s.kl_loss_coef * kl_loss
        metrics["kl_loss"] = out(kl_loss.detach())
    return loss, metrics
