"""PPO / GRPO / RLOO / REINFORCE++ math as pure functions over tensors.

Every function takes tensors and keyword scalars and returns tensors (plus a metrics dict of
Python floats where a trainer wants to log something). Shapes: B sequences, T response tokens;
`mask` [B, T] is 1 on response tokens and 0 on the padding after each response's end. Each
function is checked against a naive Python loop in tests/ppo/test_core_algos.py.

Loss aggregation and micro-batching: a micro-batch loss that is later summed over gradient
accumulation steps (and DP ranks) must be normalised by the *global* token / sequence count,
otherwise micro-batches with few tokens get too much weight. `agg_loss(..., denom=N)` takes
that global count; without it the micro-batch's own count is used.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3", "low_var_kl")


# ---------------------------------------------------------------- masked statistics


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    # where, not x * mask: padding may hold -inf / NaN (log-probs of pad tokens) and NaN * 0 = NaN
    y = torch.where(mask != 0, x * mask, torch.zeros((), dtype=x.dtype, device=x.device))
    return y.sum() if dim is None else y.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over positions where mask is 1; 0 when the mask is empty (no NaN)."""
    return masked_sum(x, mask, dim) / mask.sum(dim).clamp_min(1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True) -> torch.Tensor:
    """Variance of x over masked positions (Bessel-corrected when unbiased and n > 1)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:  # torch.where, not `if n > 1`: no host sync on GPU
        n = mask.sum()
        var = torch.where(n > 1, var * n / (n - 1).clamp_min(1), var)
    return var


def whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """[B, T] -> [B, T] normalised to zero mean / unit variance over masked positions.

    shift_mean=False keeps the original mean (only the scale changes), as used for rewards.
    Positions outside the mask carry the same affine map (callers multiply by mask if needed).
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    return out if shift_mean else out + mean


# ---------------------------------------------------------------- aggregation


def agg_loss(x: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *, denom: float | None = None,
             max_len: int | None = None) -> torch.Tensor:
    """Aggregate a per-token [B, T] matrix to a scalar.

    token-mean:             sum(x * mask) / denom          (denom default: number of masked tokens)
    seq-mean-token-sum:     sum_b sum_t(x * mask) / denom  (denom default: B)
    seq-mean-token-mean:    sum_b mean_t(x | mask) / denom (denom default: B)
    seq-mean-token-sum-norm (Dr. GRPO): sum(x * mask) / max_len / denom (denom default: B;
                            max_len default: T)
    `denom` is the global count across micro-batches / DP ranks, so summing micro-batch losses
    gives exactly the full-batch loss.
    """
    x = x.float()
    mask = mask.to(x.dtype)
    if mode == "token-mean":
        d = mask.sum().clamp_min(1) if denom is None else denom
        return masked_sum(x, mask) / d
    seq_d = x.shape[0] if denom is None else denom
    if mode == "seq-mean-token-sum":
        return masked_sum(x, mask, -1).sum() / seq_d
    if mode == "seq-mean-token-mean":
        # rows with no tokens contribute 0 (and still count in the sequence denominator)
        return masked_mean(x, mask, -1).sum() / seq_d
    if mode == "seq-mean-token-sum-norm":
        return masked_sum(x, mask) / (max_len or x.shape[-1]) / seq_d
    raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {', '.join(AGG_MODES)}")


def agg_count(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """This micro-batch's share of `agg_loss`'s global `denom`: its token count for token-mean, its
    sequence count for the seq-mean modes. Sum it over micro-batches and DP ranks to get denom."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {', '.join(AGG_MODES)}")
    return mask.float().sum() if mode == "token-mean" else torch.tensor(float(mask.shape[0]))


# ---------------------------------------------------------------- log-probs


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits [..., V], labels [...] -> log p(label) [...] in fp32 (no [.., V] log-softmax kept)."""
    logits = logits.float()  # bf16 log-softmax loses ~2 digits; the PPO ratio needs them
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


# ---------------------------------------------------------------- advantages


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float,
                whiten_advantages: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over token-level rewards.

    rewards, values, mask: [B, T] -> advantages [B, T], returns [B, T] (both 0 where mask is 0).
    Masked positions are skipped: the bootstrap value and the running GAE pass through them
    unchanged, so padding after the response end (or masked tool/observation tokens in the
    middle) neither adds TD errors nor breaks the recursion. returns = raw advantages + values;
    advantages are whitened over the mask when `whiten_advantages`.
    """
    rewards, values, m = rewards.float(), values.float(), mask.float()
    b, t = rewards.shape
    adv = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(b)
    last_gae = rewards.new_zeros(b)
    with torch.no_grad():
        for i in reversed(range(t)):
            delta = rewards[:, i] + gamma * next_value - values[:, i]
            gae = delta + gamma * lam * last_gae
            # a masked step is invisible: V(s_{t+1}) and the running GAE carry over it unchanged
            next_value = m[:, i] * values[:, i] + (1 - m[:, i]) * next_value
            last_gae = m[:, i] * gae + (1 - m[:, i]) * last_gae
            adv[:, i] = last_gae
        # returns come from the raw advantages: the critic regresses onto unscaled value targets
        returns = (adv + values) * m
        if whiten_advantages:
            adv = whiten(adv, m)
        adv = adv * m
    return adv, returns


def _group_index(group_ids: torch.Tensor | Sequence[Hashable], n: int, device: torch.device) -> torch.Tensor:
    """Any per-sample group labels (ints, strings, uids) -> dense int64 ids [B]."""
    if isinstance(group_ids, torch.Tensor):
        _, inv = torch.unique(group_ids, return_inverse=True)
        return inv.to(device)
    if len(group_ids) != n:
        raise ValueError(f"group_ids has {len(group_ids)} entries but there are {n} scores")
    table: dict[Hashable, int] = {}
    return torch.tensor([table.setdefault(g, len(table)) for g in group_ids], dtype=torch.long, device=device)


def _group_stats(scores: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group size, group mean and unbiased group std (std=1 for singletons)."""
    g = int(idx.max()) + 1 if idx.numel() else 0
    count = torch.zeros(g, dtype=scores.dtype, device=scores.device).index_add_(0, idx, torch.ones_like(scores))
    total = torch.zeros_like(count).index_add_(0, idx, scores)
    mean = total / count
    sq = torch.zeros_like(count).index_add_(0, idx, (scores - mean[idx]) ** 2)
    std = torch.where(count > 1, (sq / (count - 1).clamp_min(1)).sqrt(), torch.ones_like(count))
    return count[idx], mean[idx], std[idx]


def compute_grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor | Sequence[Hashable], mask: torch.Tensor,
                            *, norm_by_std: bool = True, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantages: (score - group mean) / (group std + eps), broadcast over the response.

    scores [B] (one scalar per sample), group_ids [B] (samples of one prompt share an id),
    mask [B, T] -> (advantages, returns), both [B, T] and equal. A group of one gets mean 0, std 1
    (its raw score), as in verl. norm_by_std=False is Dr. GRPO's mean-only baseline.
    """
    s = scores.float()
    idx = _group_index(group_ids, s.shape[0], s.device)
    count, mean, std = _group_stats(s, idx)
    # a lone sample has no baseline to compare with: keep its raw score rather than zeroing it
    mean = torch.where(count > 1, mean, torch.zeros_like(mean))
    adv = (s - mean) / (std + eps) if norm_by_std else s - mean
    out = adv[:, None] * mask.float()
    return out, out


def compute_rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor | Sequence[Hashable],
                            mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: score minus the mean of the *other* samples of the same prompt.

    scores [B], group_ids [B], mask [B, T] -> (advantages, returns) [B, T]. For a group of n > 1,
    score_i - (sum - score_i)/(n - 1) == (score_i - mean) * n/(n - 1). A group of one keeps its raw
    score (baseline 0).
    """
    s = scores.float()
    idx = _group_index(group_ids, s.shape[0], s.device)
    count, mean, _ = _group_stats(s, idx)
    adv = torch.where(count > 1, (s - mean) * count / (count - 1).clamp_min(1), s)
    out = adv[:, None] * mask.float()
    return out, out


def compute_reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, *,
                                    gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted reward-to-go per token, then whitening over the whole batch.

    token_rewards, mask [B, T] -> (advantages, returns) [B, T]. The running return is reset by
    the mask, so nothing leaks from padding into the response.
    """
    r, m = token_rewards.float(), mask.float()
    returns = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    for i in reversed(range(r.shape[1])):
        running = r[:, i] + gamma * running
        returns[:, i] = running
        running = running * m[:, i]
    adv = whiten(returns, m) * m
    return adv, returns * m


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """scores [B] -> [B, T] zeros with each score at its row's last response token (rows with an
    empty mask get no reward)."""
    m = response_mask.bool()
    t = m.shape[1]
    pos = torch.arange(t, device=m.device).expand_as(m)
    last = torch.where(m, pos, torch.full_like(pos, -1)).max(dim=1).values  # [B], -1 if empty
    out = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
    has = last >= 0
    rows = torch.nonzero(has).squeeze(-1)
    out[rows, last[has]] = scores.float()[has]
    return out


# ---------------------------------------------------------------- losses


def _metrics(keys: tuple[str, ...], stats: torch.Tensor, sync: bool) -> dict[str, Any]:
    # one device sync for all metrics (not one .item() each), or none at all
    return dict(zip(keys, stats.tolist() if sync else stats.unbind()))


def check_dual_clip(dual_clip_c: float | None) -> None:
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1.0 (got {dual_clip_c}); use None to disable dual clip")


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, *, clip_low: float, clip_high: float,
                      dual_clip_c: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO clip max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), then (dual clip) a
    negative-advantage loss bounded by -A c. ratio, adv: [B, T] (a per-token or broadcast per-sequence
    ratio) -> (loss [B, T], clipped [B, T] (the clip bound), lower [B, T] (dual clip active)), as floats."""
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(loss1, loss2)
    lower = torch.zeros_like(pg)
    if dual_clip_c is not None:
        loss3 = -adv * dual_clip_c
        lower = ((pg > loss3) & (adv < 0)).float()
        pg = torch.where(adv < 0, torch.minimum(pg, loss3), pg)
    return pg, (loss2 > loss1).float(), lower


def weighted_surrogate_loss(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *, clip_low: float,
                            clip_high: float, dual_clip_c: float | None, token_weights: torch.Tensor | None,
                            agg: str, denom: float | None, max_len: int | None):
    """The clipped surrogate of `ratio` [B, T] (token or sequence ratios alike), times the rollout-correction
    weights, aggregated by `agg`. -> (loss, clipped, lower) as clipped_surrogate gives them."""
    pg, clipped, lower = clipped_surrogate(ratio, adv, clip_low=clip_low, clip_high=clip_high, dual_clip_c=dual_clip_c)
    if token_weights is not None:
        pg = pg * token_weights.detach().float()
    return agg_loss(pg, mask, agg, denom=denom, max_len=max_len), clipped, lower


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip_c: float | None = 3.0,
                agg: str = "token-mean", denom: float | None = None, max_len: int | None = None,
                token_weights: torch.Tensor | None = None,
                sync_metrics: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO surrogate (decoupled clip range, DAPO's clip-higher) with optional dual clip.

    logp, old_logp, advantages, mask: [B, T] -> (loss scalar, metrics). Dual clip (Ye et al. 2020)
    bounds the loss of negative-advantage tokens by -A * c, c > 1, so a token whose ratio exploded
    cannot dominate. token_weights [B, T] (no gradient; e.g. rollout-correction weights) scale each
    token's clipped loss before aggregation; max_len is agg_loss's (seq-mean-token-sum-norm).
    metrics: clipfrac, clipfrac_lower (dual clip active), approx_kl (k1 of old vs new),
    ratio_mean/min/max; Python floats, or detached 0-dim tensors when sync_metrics=False
    (no device sync inside the micro-batch loop: accumulate them and call .item() once per step).
    """
    check_dual_clip(dual_clip_c)
    m = mask.float()
    adv = advantages.float()
    log_ratio = (logp.float() - old_logp.float()).clamp(-20.0, 20.0)  # exp overflow guard
    ratio = log_ratio.exp()
    loss, clipped, lower = weighted_surrogate_loss(ratio, adv, m, clip_low=clip_low, clip_high=clip_high,
                                                   dual_clip_c=dual_clip_c, token_weights=token_weights, agg=agg,
                                                   denom=denom, max_len=max_len)
    with torch.no_grad():
        big = torch.finfo(ratio.dtype).max
        lo = torch.where(m > 0, ratio, torch.full_like(ratio, big)).min()
        hi = torch.where(m > 0, ratio, torch.full_like(ratio, -big)).max()
        empty = lo > hi
        stats = torch.stack([
            masked_mean(clipped, m), masked_mean(lower, m), masked_mean(-log_ratio, m),
            masked_mean(ratio, m), torch.where(empty, 1.0, lo), torch.where(empty, 1.0, hi),
        ])
    metrics = _metrics(("clipfrac", "clipfrac_lower", "approx_kl", "ratio_mean", "ratio_min", "ratio_max"), stats,
                       sync_metrics)
    return loss, metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
               clip: float | None = 0.2, agg: str = "token-mean",
               denom: float | None = None, sync_metrics: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss 0.5 * max((v - R)^2, (clip(v, v_old +- clip) - R)^2), aggregated.

    values (new predictions), old_values, returns, mask: [B, T] -> (loss, {vf_clipfrac, vpred_mean}).
    clip=None gives the plain squared error. sync_metrics as in policy_loss.
    """
    m = mask.float()
    v, r = values.float(), returns.float()
    l1 = (v - r) ** 2
    if clip is None:
        per_token, l2 = l1, l1
    else:
        old = old_values.float()
        l2 = (old + (v - old).clamp(-clip, clip) - r) ** 2
        per_token = torch.maximum(l1, l2)
    loss = 0.5 * agg_loss(per_token, m, agg, denom=denom)
    with torch.no_grad():
        stats = torch.stack([masked_mean((l2 > l1).float(), m), masked_mean(v, m)])
    metrics = _metrics(("vf_clipfrac", "vpred_mean"), stats, sync_metrics)
    return loss, metrics


@dataclass(frozen=True, slots=True)
class PolicyLossSettings:
    """What the actor's loss is made of (the actor config's loss keys, typed). New loss variants
    add their settings here, and `policy_losses.compute_policy_loss` reads them; nothing else changes."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float | None = 3.0
    agg: str = "token-mean"
    entropy_coef: float = 0.0
    use_kl_loss: bool = False  # KL(pi || ref) as a loss term (GRPO style), needs the reference log-probs
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    kind: str = "vanilla"  # the surrogate: vanilla (token-ratio PPO clip) | gspo (sequence ratio, policy_losses.py)
    max_len: int | None = None  # seq-mean-token-sum-norm's constant divisor (rollout.max_response_length)
    # engine-vs-trainer mismatch weights (ppo/algos/rollout_correction.py): none | tis | seq_mask | tis+seq_mask
    rollout_correction: str = "none"
    rollout_is_cap: float = 2.0
    rollout_mask_threshold: float = 1.01

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss itself uses the per-token entropy (callers may still pass it for the metric)."""
        return self.entropy_coef != 0.0

    @property
    def needs_ref(self) -> bool:
        return self.use_kl_loss


# ---------------------------------------------------------------- KL


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, *, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1/k2/k3).

    k1: logp - ref_logp (unbiased, can be negative); k2: 0.5 * k1^2;
    k3: exp(-k1) - 1 + k1 (unbiased, always >= 0); low_var_kl: k3 with the log-ratio clamped to
    [-20, 20] and the estimate to [-10, 10] for numerical safety (verl's default for GRPO).
    """
    d = logp.float() - ref_logp.float()
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        return torch.expm1(-d) + d
    if kind == "low_var_kl":
        d = d.clamp(-20.0, 20.0)
        return (torch.expm1(-d) + d).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_KINDS)}")


class FixedKLController:
    """Constant KL coefficient; same interface as AdaptiveKLController."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 ("Fine-Tuning LMs from Human Preferences").

    value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon after each batch of n_steps
    samples: the coefficient grows when the policy drifts past the target KL and shrinks below it.
    """

    def __init__(self, init_kl_coef: float, *, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController needs target_kl > 0 and horizon > 0 "
                             f"(got target_kl={target_kl}, horizon={horizon})")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        err = min(max(current_kl / self.target - 1.0, -0.2), 0.2)  # clipped so one noisy batch moves it little
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = int(state.get("horizon", self.horizon))


def apply_kl_penalty(token_rewards: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                     *, kl_coef: float, kind: str = "k1") -> tuple[torch.Tensor, dict[str, float]]:
    """In-reward KL penalty: rewards - kl_coef * KL per token.

    token_rewards, logp, ref_logp, mask: [B, T] -> (rewards [B, T], {kl, kl_coef}). `kl` is the
    batch mean of per-sequence mean KL: feed it to the controller's update(kl, n_steps=B).
    """
    m = mask.float()
    kl = kl_estimate(logp, ref_logp, kind=kind) * m
    # per-token penalty (not one per sequence): GAE then credits each token with its own KL cost
    rewards = token_rewards.float() - kl_coef * kl
    seq_kl = masked_mean(kl, m, -1)
    current = seq_kl.mean().item() if seq_kl.numel() else 0.0
    if not math.isfinite(current):
        raise FloatingPointError(f"KL penalty is {current}: log-probs contain inf/NaN (check the ref model)")
    return rewards, {"kl": current, "kl_coef": float(kl_coef)}
