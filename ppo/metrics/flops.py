"""FLOP accounting for PPO/GRPO steps (DESIGN.md "Honest numbers"): what `perf/useful_util` and
`perf/mfu/actor` count. Pure functions; the launcher's monitor and the benchmarks use them too."""

from __future__ import annotations

H200_PEAK_BF16_FLOPS = 790e12  # measured dense bf16 matmul ceiling (DESIGN.md "Honest numbers")


def useful_utilization(flops: float, seconds: float, *, n_gpus: int, peak_flops: float = H200_PEAK_BF16_FLOPS) -> float:
    """Fraction of the hardware FLOP ceiling spent on useful model FLOPs (MFU-style)."""
    if seconds <= 0 or n_gpus <= 0:
        raise ValueError(f"useful_utilization needs seconds > 0 and n_gpus > 0, got seconds={seconds}, n_gpus={n_gpus}")
    return flops / (seconds * n_gpus * peak_flops)


def ppo_stage_flops(
    *,
    n_params_actor: int,
    n_params_critic: int | None,
    n_params_ref: int | None,
    n_params_rm: int | None,
    trained_tokens: int,
    generated_tokens: int,
    ppo_epochs: int,
    prefill_tokens: int = 0,
    old_logp_forward: bool = True,
    policy_tokens: int | None = None,
) -> dict[str, float]:
    """Model FLOPs of one PPO step per stage (keys match the timing_s/<stage> names).

    The dense-transformer rule of DESIGN.md "Honest numbers": a forward costs 2N FLOP per
    token, forward+backward 6N. `trained_tokens` is prompt+response tokens of the batch as fed
    to the trainer; `generated_tokens` the decoded tokens and `prefill_tokens` the prompt tokens
    the engine prefilled (2N each; counted under "gen"). Attention's O(T^2) term is ignored, so
    long sequences make these numbers a slight underestimate, never an overestimate.
    A None model is absent (GRPO: no critic; kl_coef 0: no ref; rule reward: no RM).
    old_logp_forward=False: no separate old-log-prob forward ran (async rollout takes the behaviour
    log-probs of generation; one epoch over one mini-batch reuses the update's forward), so none is
    counted: GRPO with a reference is then the 8N per trained token of 6N update + 2N reference.
    policy_tokens: the tokens the actor and reference forwards really process when that is fewer than
    trained_tokens (trainer.share_prompts packs a prompt once per group), so useful FLOPs never count
    work that was not needed.
    """
    t = float(trained_tokens)
    tp = t if policy_tokens is None else float(policy_tokens)
    out = {
        "gen": 2.0 * n_params_actor * (generated_tokens + prefill_tokens),
        "old_log_prob": 2.0 * n_params_actor * tp if old_logp_forward else 0.0,
        "ref": 2.0 * n_params_ref * tp if n_params_ref else 0.0,
        "reward": 2.0 * n_params_rm * t if n_params_rm else 0.0,
        "values": 2.0 * n_params_critic * t if n_params_critic else 0.0,
        "update_actor": 6.0 * n_params_actor * tp * ppo_epochs,
        "update_critic": 6.0 * n_params_critic * t * ppo_epochs if n_params_critic else 0.0,
    }
    return out


def ppo_step_flops(**kwargs) -> float:
    """Total model FLOPs of one PPO step: the sum of `ppo_stage_flops(**kwargs)` (about 20N per
    trained token for full PPO with one epoch, plus 2N per generated or prefilled token)."""
    return sum(ppo_stage_flops(**kwargs).values())
