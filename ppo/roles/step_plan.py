"""Per-step decisions that follow from the configuration alone (torch-free: the launcher's cost
model makes the same decision as the trainer by calling the same function)."""

from __future__ import annotations

OLD_LOGP_SOURCES = ("recompute", "fused", "fused_first", "behaviour")


def old_logp_source(*, max_staleness: int, rollout_correction: str, ppo_epochs: int, mini_batch_size: int,
                    samples: int, kl_penalty_with_ref: bool) -> str:
    """Where a step's old log-probs (the PPO ratio's denominators) come from (rollout_correction: the resolved
    algorithm.rollout_correction, ppo.algos.rollout_correction.resolve_mode):

    "behaviour": batches generated ahead (trainer.max_staleness >= 1) and no rollout correction: the engine's
        log-probs recorded at generation, so the PPO ratio is taken against the policy that sampled (K steps
        off-policy at most). With a correction the batch trains by decoupled PPO instead: the ratio against
        the trainer's current weights (the proximal policy, "fused", "fused_first" or "recompute" below) and
        the correction's weights pi_proximal / pi_behaviour on each token;
    "fused": one epoch over one mini-batch (mini_batch_size 0 or >= the step's samples) and no
        in-reward KL penalty against a reference, so the old log-probs would be the update's own
        forward bit for bit: that forward serves both (ratio == 1 by construction);
    "fused_first": one epoch over several mini-batches, no in-reward KL penalty: the first mini-batch runs
        before any optimizer step, so its forward serves as above; a forward before the update computes the
        later mini-batches' only (their weights have moved by then), (M - 1) / M of the batch;
    "recompute": a forward of the actor over the batch before the update (several epochs revisit the first
        mini-batch after a step; an in-reward KL penalty needs every old log-prob before the advantages).
    """
    if max_staleness and rollout_correction == "none":
        return "behaviour"
    if ppo_epochs != 1 or kl_penalty_with_ref:
        return "recompute"
    return "fused" if mini_batch_size == 0 or mini_batch_size >= samples else "fused_first"


def old_logp_share(source: str, *, mini_batch_size: int, samples: int) -> float:
    """The share of the step's samples the old-log-prob forward runs over (the FLOP count and the cost model
    scale that pass by it): 1 for "recompute", the M - 1 later of M mini-batches for "fused_first", else 0."""
    if source == "recompute":
        return 1.0
    if source != "fused_first":
        return 0.0
    minis = -(-samples // mini_batch_size)
    return (minis - 1) / minis


def ref_beside_actor(plan) -> bool:
    """The reference is placed exactly like the actor (the same ranks, the same TP x PP x DP): each rank then
    computes the reference's log-probs of the very samples its actor shard trains on, and the update can read
    them on the device (a function of the plan, so every rank decides alike)."""
    a, r = plan.groups.get("actor"), plan.groups.get("ref")
    return (a is not None and r is not None and list(a.ranks) == list(r.ranks)
            and (a.tp, a.pp, a.dp) == (r.tp, r.pp, r.dp))
