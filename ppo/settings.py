"""The typed pieces of a run that the launcher hands to `ppo` (STYLE.md #2: OmegaConf at the edge,
typed dataclasses inside): the roles' loss and update settings, and the generation role's engine
config and sampling. launcher/handoff.py builds them from the config tree once; ppo/roles.py and
ppo/generation.py read nothing else of the tree.

    settings = build_ppo_settings(cfg, device=env.device)     # launcher side
    roles.update_actor(...)    # reads settings.roles.policy_loss, settings.roles.actor_update
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppo.core_algos import PolicyLossSettings
from rollout.base import RolloutConfig


@dataclass(frozen=True, slots=True)
class UpdateSettings:
    """A trained role's update loop: epochs x mini-batches (one optimizer step each)."""

    epochs: int = 1
    mini_batch_size: int = 0  # samples per optimizer step; 0: the whole batch (one step per epoch)


@dataclass(frozen=True, slots=True)
class ValueLossSettings:
    clip: float | None = 0.2  # None: plain squared error
    agg: str = "token-mean"


@dataclass(frozen=True, slots=True)
class RolesSettings:
    policy_loss: PolicyLossSettings
    actor_update: UpdateSettings
    critic_update: UpdateSettings
    value_loss: ValueLossSettings
    sft_lr: float = 0.0  # the supervised warm-up's learning rate
    sft_max_tokens: int = 8192  # its micro-batch token budget


@dataclass(frozen=True, slots=True)
class GenerationSettings:
    engine_kind: str  # rollout.factory's engine name
    engine: RolloutConfig  # the engine's own config (its token budget is the batch controller's to move)
    temperature: float = 1.0
    top_k: int = -1  # -1: off
    top_p: float = 1.0
    max_response_length: int = 256
    n: int = 1  # samples per prompt
    bucket_bytes: int = 256 << 20  # reshard bucket size
    offload_optimizer: bool = False  # the actor's optimizer states to pinned CPU while generating
    dtype: torch.dtype = torch.float32  # of the generation weights
    vllm: object | None = None  # rollout.vllm_support.VLLMOptions when engine_kind == "vllm"


@dataclass(frozen=True, slots=True)
class PPOSettings:
    roles: RolesSettings
    generation: GenerationSettings
