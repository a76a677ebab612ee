"""The step's batch ("experience") and how it moves between role groups.

Every rank holds the same `Experience`: the token ids of every sample are small (a few
hundred KB per step), so after generation each generation replica's leader contributes
its completions to one world all-gather. Per-token results (old/ref log-probs, values)
and per-sample scores are computed by their role group over that group's DP shard and
merged with one more all-gather of the owners' results. Advantages are then a pure
function evaluated identically on every rank, and each training group reads its own
DP shard. Only owners contribute, so a result is never sent twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist


@dataclass(slots=True)
class Sample:
    uid: int  # prompt_index * n + sample_index: a stable id across layouts
    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    finish_reason: str
    ground_truth: str | None = None
    info: dict | None = None  # the prompt's data_source, extra_info and other data columns (for rewards)
    version: int = 0  # the policy version (steps the actor had trained) whose weights generated it (its oldest token's)
    token_versions: list[int] | None = None  # per response token, when they differ (a partial rollout); else None
    # a mixture of experts: the engine's experts of each token it ran, [P + R - 1, L_moe, k] (routing replay)
    routed_experts: torch.Tensor | None = None
    # multi-turn trajectories (ppo/agents): response_ids holds sampled and observation (tool) tokens; loss_mask
    # marks the sampled ones (None: every response token was sampled); text: what the reward reads (None: the
    # response decoded); agent: the trajectory's counts (turns, tool_calls, tool_errors, truncated_observations)
    loss_mask: list[int] | None = None
    text: str | None = None
    agent: dict | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(slots=True)
class Experience:
    """All samples of one step, ordered by uid (the step's rows for the updates: step_batch.StepBatch)."""

    samples: list[Sample]
    # what the workers derive from the token ids alone (micro-batch plans, packed micro-batches), by the
    # arguments that determine it: the reference's forward and the update plan and pack each once. Never
    # weights or results, so nothing here goes stale within the step (the batch dies with it)
    derived: dict = field(default_factory=dict)

    def derive(self, key: tuple, make):
        """make() once per key for this batch."""
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]

    @property
    def max_response_len(self) -> int:
        return max(1, max(len(s.response_ids) for s in self.samples))

    def response_mask(self) -> torch.Tensor:
        """[B, R] bool: the response tokens the policy sampled. Every loss, advantage, KL, entropy and rollout
        correction term reads this mask, so observation tokens of multi-turn trajectories count in none."""
        r = self.max_response_len
        lens = torch.tensor([len(s.response_ids) for s in self.samples])
        mask = torch.arange(r)[None] < lens[:, None]
        for i, s in enumerate(self.samples):
            if s.loss_mask is not None:
                mask[i, : len(s.loss_mask)] &= torch.tensor(s.loss_mask, dtype=torch.bool)
        return mask

    def prompt_units(self) -> tuple[list[list[int]], list[int]]:
        """Runs of consecutive samples sharing a prompt (a GRPO group) and the tokens each packs to
        with its prompt kept once (pack(share_prompts=True)): prompt + every response."""
        from ppo.batch.micro_batches import prompt_groups

        units = prompt_groups([s.prompt_ids for s in self.samples])
        return units, [len(self.samples[u[0]].prompt_ids) + sum(len(self.samples[i].response_ids) for i in u)
                       for u in units]

    def token_staleness(self, step: int) -> torch.Tensor:
        """[B, R] each response token's version gap at `step` (0-based): step - the version that sampled it."""
        return self.stack({s.uid: step - torch.tensor(s.token_versions if s.token_versions is not None
                                                      else [s.version] * len(s.response_ids), dtype=torch.float32)
                           for s in self.samples})

    def behaviour_logprobs(self) -> torch.Tensor:
        # (numpy converts a list of floats ~3x faster than torch.tensor: 256 x 1024 of them in ~8 ms)
        return self.stack({s.uid: torch.from_numpy(np.asarray(s.behaviour_logprobs, dtype=np.float32))
                           for s in self.samples})

    def stack(self, per_uid: dict[int, torch.Tensor], *, fill: float = 0.0, partial: bool = False) -> torch.Tensor:
        """{uid: [R_i]} -> [B, R] in sample order, padded with `fill` (partial: a sample missing from per_uid is a
        row of `fill`; otherwise every sample must be there)."""
        r = self.max_response_len
        out = torch.full((len(self.samples), r), fill, dtype=torch.float32)
        for i, s in enumerate(self.samples):
            v = per_uid.get(s.uid) if partial else per_uid[s.uid]
            if v is not None:
                out[i, : v.numel()] = v.float()
        return out


def all_gather_objects(obj, *, group=None) -> list:
    """World (or group) all-gather of picklable objects, in rank order."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def share_samples(mine: list[Sample]) -> list[Sample]:
    """Each generation leader's samples -> every rank's full list, sorted by uid."""
    merged = [s for part in all_gather_objects(mine) for s in part]
    merged.sort(key=lambda s: s.uid)
    uids = [s.uid for s in merged]
    if len(set(uids)) != len(uids):
        raise RuntimeError("a sample was contributed twice: more than one rank per generation replica reported")
    return merged


def merge_results(mine: dict[str, dict[int, torch.Tensor]]) -> dict[str, dict[int, torch.Tensor]]:
    """{key: {uid: tensor}} from the owners -> the union on every rank (keys: old_logp, ref_logp, ...)."""
    out: dict[str, dict[int, torch.Tensor]] = {}
    # one flat tensor per key on the wire (pickling hundreds of small tensors costs tens of ms a step)
    flat = {k: ([*v], [t.shape for t in v.values()],
                torch.cat([t.detach().reshape(-1).cpu() for t in v.values()]) if v else torch.empty(0))
            for k, v in mine.items()}
    for part in all_gather_objects(flat):
        for key, (uids, shapes, values) in part.items():
            pieces = torch.split(values, [math.prod(sh) for sh in shapes])
            per_uid = {u: x.view(sh) for u, x, sh in zip(uids, pieces, shapes)}
            dst = out.setdefault(key, {})
            overlap = dst.keys() & per_uid.keys()
            if overlap:
                raise RuntimeError(f"{key}: samples {sorted(overlap)[:5]} reported by two ranks")
            dst.update(per_uid)
    return out
