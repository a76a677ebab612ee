"""The step's batch (`StepBatch`), a pure function of the merged batch computed alike on every rank: its
advantages, the tensors the updates read, and DAPO's soft overlong penalty of the scores; the reference's
log-probs wherever they are (`ReferenceLogprobs`, `DeviceRows`).

    batch, metrics, kl_seen = compute_step_batch(exp, merged, a=settings.loop.advantages, n=4,
                                                 max_response_length=256, kl_coef=0.001, old_logp="recompute")
    kl_ctrl.update(kl_seen, n_steps=len(exp.samples))   # the caller owns the KL controller
    batch.advantages  # [B, R], zero past each response
    mb = batch.rows(rows, device)   # one micro-batch's rows on the device, one pinned copy
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from ppo.algos import core_algos as algos
from ppo.algos.rollout_correction import resolve_mode
from ppo.batch.experience import Experience
from ppo.batch.packing import copy_to_device
from ppo.settings import AdvantageSettings


class DeviceRows:
    """Per-sample response rows of a scoring pass, left on the device: its micro-batches' [B_k, R_k] outputs
    (0 past each response's end). take(mb) -> [len(mb), R] for any micro-batch of those samples, R its longest
    response: the pass's own tensor when the micro-batch is one of its (an update planned like the pass),
    else the rows gathered and padded (another token budget, e.g. after an OOM halving)."""

    def __init__(self, exp: Experience, outputs: list[tuple[list[int], torch.Tensor]]):
        self._lengths = {i: len(exp.samples[i].response_ids) for mb, _ in outputs for i in mb}
        self._by_mb = {tuple(mb): t for mb, t in outputs}
        self._where = {i: (t, j) for mb, t in outputs for j, i in enumerate(mb)}

    def take(self, mb: list[int]) -> torch.Tensor:
        missing = [i for i in mb if i not in self._where]
        if missing:
            raise RuntimeError(f"samples {missing[:5]} were scored on other ranks: their rows are not on this device")
        width = max(1, max(self._lengths[i] for i in mb))
        own = self._by_mb.get(tuple(mb))
        if own is not None and own.shape[1] == width:
            return own.float()
        return torch.stack([F.pad(t[j, :width].float(), (0, max(0, width - t.shape[1])))
                            for t, j in (self._where[i] for i in mb)])


@dataclass(slots=True)
class StepBatch:
    """The step's per-sample tensors: rows in sample order (exp.samples), R the longest response, every [B, R]
    tensor zero past each response's end. compute_step_batch always fills mask, scores and advantages; an update
    reads a StepBatch of only the fields its loss needs (the critic's: mask, values, returns), so any field but
    the mask may be None."""

    mask: torch.Tensor  # [B, R] bool: the response's tokens
    scores: torch.Tensor | None = None  # [B] each sample's shaped score
    advantages: torch.Tensor | None = None  # [B, R]
    # [B, R] the PPO ratio's denominators; None when fused (the update's own forward, detached, serves)
    old_logp: torch.Tensor | None = None
    # [B, R] the reference's, on the host or left on the device where they were computed (DeviceRows)
    ref_logp: torch.Tensor | DeviceRows | None = None
    rollout_logp: torch.Tensor | None = None  # [B, R] the engine's behaviour log-probs (None: a sample has none)
    values: torch.Tensor | None = None  # [B, R] the critic's (GAE only)
    returns: torch.Tensor | None = None  # [B, R] GAE's returns
    actor_mask: torch.Tensor | None = None  # [B, R] DAPO's overlong filter: the mask less truncated responses

    def tensors(self) -> dict[str, torch.Tensor | DeviceRows]:
        """The fields that are set, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def rows(self, mb: list[int], device: torch.device) -> StepBatch:
        """The micro-batch `mb`'s rows on `device`: the host tensors queued through one pinned buffer and one
        non-blocking copy (no sync), DeviceRows taken where they are."""
        t = self.tensors()
        out = copy_to_device({k: v[mb] for k, v in t.items() if not isinstance(v, DeviceRows)}, device)
        out.update({k: v.take(mb) for k, v in t.items() if isinstance(v, DeviceRows)})
        return StepBatch(**out)

    def narrow(self, width: int, device: torch.device) -> StepBatch:
        """[B, R_max] rows (on the device already) -> [B, width] (width: the longest response), contiguous."""
        return StepBatch(**{k: v[:, :width].to(device).contiguous() for k, v in self.tensors().items()})


class ReferenceLogprobs:
    """The step's reference log-probs, wherever they are: [B, R] host rows merged with the other scores (`host`),
    the rows a deferred pass left on the device (DeviceRows; None on ranks that computed none), or that pass
    still running: get() calls `wait` once (it waits for the pass and merges every rank's rows)."""

    def __init__(self, value: torch.Tensor | DeviceRows | None = None, *, wait=None):
        self._value, self._wait = value, wait

    @property
    def host(self) -> torch.Tensor | None:
        """[B, R] on the host already (None: not yet, on the device, or no reference)."""
        return self._value if isinstance(self._value, torch.Tensor) else None

    def get(self) -> torch.Tensor | DeviceRows | None:
        if self._wait is not None:
            self._value, self._wait = self._wait(), None
        return self._value


def overlong_penalties(exp: Experience, a: AdvantageSettings, *, max_len: int) -> torch.Tensor | None:
    """[B] DAPO soft overlong penalties of the samples (None unless algorithm.overlong_buffer.enable)."""
    if not a.overlong_buffer:
        return None
    from ppo.algos.dapo import overlong_penalty

    lengths = torch.tensor([len(s.response_ids) for s in exp.samples])
    return overlong_penalty(lengths, max_len=max_len, buffer_len=a.overlong_buffer_len,
                            penalty_factor=a.overlong_penalty_factor)


def compute_step_batch(exp: Experience, merged: dict[str, dict[int, torch.Tensor]], *, a: AdvantageSettings, n: int,
                       max_response_length: int, kl_coef: float | None, old_logp: str,
                       ref_logp: torch.Tensor | None = None, token_staleness: torch.Tensor | None = None
                       ) -> tuple[StepBatch, dict[str, float], float | None]:
    """The step's batch for the updates (mask, scores, advantages, and old_logp, rollout_logp, values, returns,
    ref_logp, actor_mask as the step has them), the step's advantage metrics, and the KL the in-reward penalty
    observed (None without one), which the caller feeds to its KL controller: this function changes nothing
    outside it. n: samples per prompt; kl_coef: the KL penalty's coefficient this step (algorithm.use_kl_penalty);
    old_logp: the step's old_logp_source (fused: no old log-probs yet; fused_first: those of the mini-batches
    after the first); ref_logp: [B, R] the reference's
    log-probs when they are here before the advantages (the KL penalty and the KL metric read them);
    token_staleness: [B, R] each token's version gap (trainer.max_staleness >= 1): with recomputed old log-probs
    the engine-vs-trainer metrics are also given per gap g, rollout_corr/staleness_<g>/<key>."""
    mask = exp.response_mask()
    scores = torch.tensor([float(merged["score"][s.uid]) for s in exp.samples])
    token_rewards = algos.scores_to_token_rewards(scores, mask)
    b = StepBatch(mask=mask, scores=scores, ref_logp=ref_logp)
    if "old_logp" in merged:  # fused_first: the later mini-batches' rows (zeros in the first's, never read)
        b.old_logp = exp.stack(merged["old_logp"], partial=old_logp == "fused_first")
    metrics: dict[str, float] = reward_extra_metrics(merged)  # reward/<key>/mean of dict results
    if old_logp != "behaviour":
        # the engine's log-probs: the actor loss measures (and corrects, algorithm.rollout_correction)
        # how far the trainer's disagree (async: they are the ratio's denominator already)
        missing = [s.uid for s in exp.samples if len(s.behaviour_logprobs) != len(s.response_ids)]
        if missing and resolve_mode(a.rollout_correction, max_staleness=0) != "none":
            raise RuntimeError(f"the rollout engine returned no log-probs for samples {missing[:5]} (of "
                               f"{len(missing)}): algorithm.rollout_correction={a.rollout_correction} needs them; "
                               f"set algorithm.rollout_correction=none")
        if not missing:
            b.rollout_logp = exp.behaviour_logprobs()
    if "reward_failed" in merged:
        failed = sum(float(merged["reward_failed"][s.uid]) for s in exp.samples)
        metrics["reward/failed"] = failed
        metrics["reward/failed_frac"] = failed / len(exp.samples)
    if old_logp == "recompute" and b.rollout_logp is not None:
        # on-policy the engine's log-probs and the trainer's must agree (same weights, same temperature)
        diff = (b.rollout_logp - b.old_logp).abs() * mask
        metrics["rollout/logprob_diff_max"] = float(diff.max())
        metrics["rollout/logprob_diff_mean"] = float(diff.sum() / mask.sum().clamp_min(1))
        if token_staleness is not None:
            metrics.update(staleness_split(b.old_logp, b.rollout_logp, mask, token_staleness))
    if merged.get("entropy"):
        metrics["actor/entropy"] = float(algos.masked_mean(exp.stack(merged["entropy"]), mask.float()))
    kl_seen = None
    if ref_logp is not None and b.old_logp is not None and old_logp != "fused_first":
        kl = algos.kl_estimate(b.old_logp, ref_logp, kind=a.kl_penalty)
        metrics["actor/kl"] = float(algos.masked_mean(kl, mask.float()))
        if a.use_kl_penalty:
            token_rewards, kl_m = algos.apply_kl_penalty(token_rewards, b.old_logp, ref_logp, mask,
                                                         kl_coef=kl_coef, kind=a.kl_penalty)
            kl_seen = kl_m["kl"]
            metrics["actor/kl_coef"] = kl_m["kl_coef"]
    group_ids = torch.tensor([s.prompt_index for s in exp.samples])
    if n > 1:
        # groups whose samples all scored the same: no GRPO/RLOO signal (DAPO dynamic sampling drops them)
        from ppo.algos.dapo import zero_variance_groups

        flat = zero_variance_groups(scores.tolist(), group_ids.tolist())
        metrics["reward/zero_var_group_frac"] = sum(flat.values()) / max(len(flat), 1)
    if a.name == "ppo":
        b.values = exp.stack(merged["values"])
        adv, b.returns = algos.compute_gae(token_rewards, b.values, mask, gamma=a.gamma, lam=a.lam,
                                           whiten_advantages=True)
        metrics["critic/explained_var"] = _explained_variance(b.values, b.returns, mask)
    elif a.name == "grpo":
        adv = algos.compute_grpo_advantages(token_rewards.sum(-1), group_ids, mask,
                                            norm_by_std=a.norm_adv_by_std)
    elif a.name == "rloo":
        adv = algos.compute_rloo_advantages(token_rewards.sum(-1), group_ids, mask)
    else:
        adv = algos.compute_reinforce_pp_advantages(token_rewards, mask, gamma=a.gamma)
    adv = adv[0] if isinstance(adv, tuple) else adv
    b.advantages = adv * mask
    pen = overlong_penalties(exp, a, max_len=max_response_length)
    if pen is not None:
        metrics["dapo/overlong_penalty_mean"] = float(pen.mean())
    if a.overlong_filter:
        # DAPO: truncated responses still count in their group's baseline, but get no policy gradient
        from ppo.algos.dapo import overlong_filter_mask

        truncated = torch.tensor([s.finish_reason == "length" for s in exp.samples])
        metrics["dapo/overlong_filtered_frac"] = float(truncated.float().mean())
        b.actor_mask = overlong_filter_mask(mask, truncated)
    return b, metrics, kl_seen


def reward_extra_metrics(merged: dict[str, dict[int, torch.Tensor]]) -> dict[str, float]:
    """`reward/<key>/mean` for each extra numeric key of the reward function's dict results."""
    return {f"{k}/mean": float(torch.stack(list(v.values())).float().mean())
            for k, v in merged.items() if k.startswith("reward/") and v}


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.float()
    var_r = algos.masked_var(returns, m)
    return float(1 - algos.masked_var(returns - values, m) / var_r.clamp_min(1e-8))


def staleness_split(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                    token_staleness: torch.Tensor) -> dict[str, float]:
    """The rollout-correction metrics (ppo.algos.rollout_correction) over the tokens of each version gap g:
    rollout_corr/staleness_<g>/{kl, k3_kl, ratio_mean, logprob_diff_max}. All [B, R]; mask: the response tokens."""
    from ppo.algos.rollout_correction import compute_rollout_correction

    out = {}
    for g in sorted({int(v) for v in token_staleness[mask].tolist()}):
        _, m = compute_rollout_correction(train_logp, rollout_logp, mask & (token_staleness == g), mode="none")
        out.update({f"rollout_corr/staleness_{g}/{k}": m[k] for k in ("kl", "k3_kl", "ratio_mean", "logprob_diff_max")})
    return out
