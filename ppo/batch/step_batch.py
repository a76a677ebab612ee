"""The step's advantages and the tensors the updates read, a pure function of the merged batch
(every rank computes the same), and DAPO's soft overlong penalty of the scores.

    tensors, metrics, kl_seen = step_tensors(exp, merged, a=settings.loop.advantages, n=4,
                                             max_response_length=256, kl_coef=0.001, old_logp="recompute")
    kl_ctrl.update(kl_seen, n_steps=len(exp.samples))   # the caller owns the KL controller
    tensors["advantages"]  # [B, R], zero past each response
"""

from __future__ import annotations

import torch

from ppo.algos import core_algos as algos
from ppo.algos.rollout_correction import resolve_mode
from ppo.batch.experience import Experience
from ppo.settings import AdvantageSettings


def overlong_penalties(exp: Experience, a: AdvantageSettings, *, max_len: int) -> torch.Tensor | None:
    """[B] DAPO soft overlong penalties of the samples (None unless algorithm.overlong_buffer.enable)."""
    if not a.overlong_buffer:
        return None
    from ppo.algos.dapo import overlong_penalty

    lengths = torch.tensor([len(s.response_ids) for s in exp.samples])
    return overlong_penalty(lengths, max_len=max_len, buffer_len=a.overlong_buffer_len,
                            penalty_factor=a.overlong_penalty_factor)


def step_tensors(exp: Experience, merged: dict[str, dict[int, torch.Tensor]], *, a: AdvantageSettings, n: int,
                 max_response_length: int, kl_coef: float | None,
                 old_logp: str) -> tuple[dict[str, torch.Tensor], dict[str, float], float | None]:
    """[B, R] tensors for the updates: mask, advantages, (old_logp, returns, values, ref_logp), the
    step's advantage metrics, and the KL the in-reward penalty observed (None without one), which the
    caller feeds to its KL controller: this function changes nothing outside it. n: samples per prompt;
    kl_coef: the KL penalty's coefficient this step (algorithm.use_kl_penalty); old_logp: the step's
    old_logp_source (fused: no old log-probs yet)."""
    mask = exp.response_mask()
    scores = torch.tensor([float(merged["score"][s.uid]) for s in exp.samples])
    token_rewards = algos.scores_to_token_rewards(scores, mask)
    t = {"mask": mask, "scores": scores}
    if "old_logp" in merged:
        t["old_logp"] = exp.stack(merged["old_logp"])
    metrics: dict[str, float] = reward_extra_metrics(merged)  # reward/<key>/mean of dict results
    if old_logp != "behaviour":
        # the engine's log-probs: the actor loss measures (and corrects, algorithm.rollout_correction)
        # how far the trainer's disagree (async: they are the ratio's denominator already)
        missing = [s.uid for s in exp.samples if len(s.behaviour_logprobs) != len(s.response_ids)]
        if missing and resolve_mode(a.rollout_correction, async_rollout=False) != "none":
            raise RuntimeError(f"the rollout engine returned no log-probs for samples {missing[:5]} (of "
                               f"{len(missing)}): algorithm.rollout_correction={a.rollout_correction} needs them; "
                               f"set algorithm.rollout_correction=none")
        if not missing:
            t["rollout_logp"] = exp.behaviour_logprobs()
    if "reward_failed" in merged:
        failed = sum(float(merged["reward_failed"][s.uid]) for s in exp.samples)
        metrics["reward/failed"] = failed
        metrics["reward/failed_frac"] = failed / len(exp.samples)
    if old_logp == "recompute" and "rollout_logp" in t:
        # on-policy the engine's log-probs and the trainer's must agree (same weights, same temperature)
        diff = (t["rollout_logp"] - t["old_logp"]).abs() * mask
        metrics["rollout/logprob_diff_max"] = float(diff.max())
        metrics["rollout/logprob_diff_mean"] = float(diff.sum() / mask.sum().clamp_min(1))
    if merged.get("entropy"):
        metrics["actor/entropy"] = float(algos.masked_mean(exp.stack(merged["entropy"]), mask.float()))
    t.update(late_tensors(exp, merged))
    kl_seen = None
    if "ref_logp" in t and "old_logp" in t:
        kl = algos.kl_estimate(t["old_logp"], t["ref_logp"], kind=a.kl_penalty)
        metrics["actor/kl"] = float(algos.masked_mean(kl, mask.float()))
        if a.use_kl_penalty:
            token_rewards, kl_m = algos.apply_kl_penalty(token_rewards, t["old_logp"], t["ref_logp"], mask,
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
        t["values"] = exp.stack(merged["values"])
        adv, ret = algos.compute_gae(token_rewards, t["values"], mask, gamma=a.gamma, lam=a.lam,
                                     whiten_advantages=True)
        t["returns"] = ret
        metrics["critic/explained_var"] = _explained_variance(t["values"], ret, mask)
    elif a.name == "grpo":
        adv = algos.compute_grpo_advantages(token_rewards.sum(-1), group_ids, mask,
                                            norm_by_std=a.norm_adv_by_std)
    elif a.name == "rloo":
        adv = algos.compute_rloo_advantages(token_rewards.sum(-1), group_ids, mask)
    else:
        adv = algos.compute_reinforce_pp_advantages(token_rewards, mask, gamma=a.gamma)
    adv = adv[0] if isinstance(adv, tuple) else adv
    t["advantages"] = adv * mask
    pen = overlong_penalties(exp, a, max_len=max_response_length)
    if pen is not None:
        metrics["dapo/overlong_penalty_mean"] = float(pen.mean())
    if a.overlong_filter:
        # DAPO: truncated responses still count in their group's baseline, but get no policy gradient
        from ppo.algos.dapo import overlong_filter_mask

        truncated = torch.tensor([s.finish_reason == "length" for s in exp.samples])
        metrics["dapo/overlong_filtered_frac"] = float(truncated.float().mean())
        t["actor_mask"] = overlong_filter_mask(mask, truncated)
    return t, metrics, kl_seen


def late_tensors(exp: Experience, merged: dict[str, dict[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The [B, R] tensors that only the losses read (the reference's log-probs), from merged results: the
    trainer adds them after step_tensors when the advantages did not need them."""
    return {"ref_logp": exp.stack(merged["ref_logp"])} if "ref_logp" in merged else {}


def check_step_tensors(t: dict[str, torch.Tensor], a: AdvantageSettings) -> None:
    """The step's tensors hold what its losses read."""
    if a.use_kl_loss and "ref_logp" not in t:
        raise RuntimeError("actor.use_kl_loss needs the reference role (ref.enabled=true)")


def reward_extra_metrics(merged: dict[str, dict[int, torch.Tensor]]) -> dict[str, float]:
    """`reward/<key>/mean` for each extra numeric key of the reward function's dict results."""
    return {f"{k}/mean": float(torch.stack(list(v.values())).float().mean())
            for k, v in merged.items() if k.startswith("reward/") and v}


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.float()
    var_r = algos.masked_var(returns, m)
    return float(1 - algos.masked_var(returns - values, m) / var_r.clamp_min(1e-8))
