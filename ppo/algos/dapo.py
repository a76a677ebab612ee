"""DAPO (Yu et al. 2025, "DAPO: an open-source LLM reinforcement learning system at scale"): dynamic
sampling, overlong filtering and overlong reward shaping. (Its fourth part, clip-higher, is
`actor.clip_high` in the PPO loss.)

Dynamic sampling: a GRPO group whose samples all scored the same has advantage 0 everywhere, so it
adds no policy gradient, only dilutes the token mean. With few samples per prompt (n = 4) on an easy
or a hard task most groups are like that and the policy loss sits at 0 for long stretches. The
sampler drops such groups and draws more prompts until the batch is full, for at most
`max_rounds` generation rounds.

Shapes: B samples; groups are runs of samples sharing `prompt_index`. Pure functions are checked
against naive loops in tests/ppo/test_dapo.py.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

# ---------------------------------------------------------------- pure functions


def zero_variance_groups(scores: Sequence[float], group_ids: Sequence[Hashable]) -> dict[Hashable, bool]:
    """{group id: True when every sample of that group has the same score} (a lone sample counts as
    zero-variance: it has nothing to be compared with)."""
    lo: dict[Hashable, float] = {}
    hi: dict[Hashable, float] = {}
    for s, g in zip(scores, group_ids):
        s = float(s)
        lo[g] = min(lo.get(g, s), s)
        hi[g] = max(hi.get(g, s), s)
    return {g: lo[g] == hi[g] for g in lo}


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, buffer_len: int, penalty_factor: float = 1.0
                     ) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the score. lengths [B] -> [B] (<= 0).

    0 for |y| <= max_len - buffer_len; a linear ramp down to -penalty_factor over the last
    buffer_len tokens; -penalty_factor beyond max_len.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong buffer length must be in (0, max_len={max_len}] (got {buffer_len})")
    start = max_len - buffer_len
    ramp = (start - lengths.float()) / buffer_len  # 0 at the buffer's start, -1 at max_len
    return penalty_factor * ramp.clamp(min=-1.0, max=0.0)


def overlong_filter_mask(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """mask [B, T], truncated [B] (response cut at the length limit) -> mask [B, T] with every
    truncated response's tokens off: a cut-off answer is not wrong, so it is not trained on."""
    return mask * (~truncated.bool()).to(mask.dtype)[:, None]


# ---------------------------------------------------------------- dynamic sampling


@dataclass(slots=True)
class FilledBatch:
    """The step's samples after dynamic sampling (ordered by uid) and their scores."""

    samples: list  # ppo.batch.experience.Sample
    scores: dict[int, float]  # uid -> score
    metrics: dict[str, float] = field(default_factory=dict)


def _groups(samples: list) -> dict[int, list]:
    out: dict[int, list] = {}
    for s in samples:
        out.setdefault(s.prompt_index, []).append(s)
    return out


def fill_informative_groups(draw: Callable[[int], tuple[list, dict[int, float]]], *, target_groups: int,
                            max_rounds: int) -> FilledBatch:
    """Draw rounds of groups until `target_groups` groups with non-zero score variance are kept.

    draw(round) -> (samples, {uid: score}) generates and scores one batch of fresh prompts (the
    same on every rank, so every rank keeps the same groups). At most `max_rounds` rounds; if the
    batch is still short then, it is topped up with zero-variance groups from the rounds drawn
    (they carry no policy gradient, but keep the step's batch shape, the DP plan and compiled shapes
    fixed), and `dapo/filled_zero_var_groups` says how many. A prompt drawn twice is kept once.
    Metrics: dapo/gen_rounds, dapo/groups_drawn, dapo/groups_dropped (zero variance),
    dapo/filled_zero_var_groups, dapo/kept_group_frac (informative groups / groups drawn).
    """
    if target_groups < 1 or max_rounds < 1:
        raise ValueError(f"need target_groups >= 1 and max_rounds >= 1 (got {target_groups}, {max_rounds})")
    kept: dict[int, list] = {}
    spare: dict[int, list] = {}
    scores: dict[int, float] = {}
    drawn = dropped = rounds = 0
    while rounds < max_rounds and len(kept) < target_groups:
        samples, round_scores = draw(rounds)
        rounds += 1
        scores.update({s.uid: float(round_scores[s.uid]) for s in samples})
        for pid, group in _groups(samples).items():
            if pid in kept or pid in spare:
                continue
            drawn += 1
            flat = zero_variance_groups([scores[s.uid] for s in group], [pid] * len(group))[pid]
            if flat:
                dropped += 1
                spare[pid] = group
            elif len(kept) < target_groups:
                kept[pid] = group
    filled = 0
    for pid, group in spare.items():
        if len(kept) >= target_groups:
            break
        kept[pid] = group
        filled += 1
    samples = sorted((s for g in kept.values() for s in g), key=lambda s: s.uid)
    metrics = {"dapo/gen_rounds": float(rounds), "dapo/groups_drawn": float(drawn),
               "dapo/groups_dropped": float(dropped), "dapo/filled_zero_var_groups": float(filled),
               "dapo/kept_group_frac": (drawn - dropped) / max(drawn, 1)}
    return FilledBatch(samples, {s.uid: scores[s.uid] for s in samples}, metrics)
