"""The typed pieces of a run that the launcher hands to `ppo` (STYLE.md #2: OmegaConf at the edge,
typed dataclasses inside): the roles' loss and update settings, the generation role's engine config
and sampling, how each role's workers are built, and the step loop's own settings. launcher/handoff.py
builds them from the config tree once; ppo/trainer.py, ppo/roles/build.py and ppo/roles/generation.py read nothing
else of the tree.

    settings = build_ppo_settings(cfg, device=env.device)     # launcher side
    roles.update_actor(...)    # reads settings.roles.policy_loss, settings.roles.actor_update
    trainer.fit()              # reads settings.loop (save_every, test_freq, ...)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppo.algos.core_algos import PolicyLossSettings
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
    # rollout.free_memory_on_sleep unset: the engine frees its memory on sleep until the first step's peaks show
    # whether it fits beside training (ppo.roles.generation.RolloutRole.settle_memory)
    settle_residency: bool = False


@dataclass(frozen=True, slots=True)
class OptimizerSettings:
    """AdamW with a warm-up and a constant or cosine schedule (ppo.roles.workers.build_optimizer)."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0


@dataclass(frozen=True, slots=True)
class WorkerLayout:
    """How one role's model runs on its ranks (ppo.roles.workers.WorkerSpec's settings beyond the mesh)."""

    backend: str = "native"  # native | megatron
    activation_checkpointing: str = "none"  # none | full | selective
    compile: bool = False
    pp_microbatches: int = 0  # 0: 2 * pp
    pp_schedule: str = "1F1B"
    pp_stages_per_rank: int = 1


@dataclass(frozen=True, slots=True)
class RewardSettings:
    """The reward role: a rule function (function, resolved against the data task) or a reward model."""

    is_model: bool = False  # reward.type == "model"
    function: str = "builtin:task"  # as configured (named in error messages)
    task: str = ""  # data.task: what builtin:task checks
    signature: str = "auto"
    model_path: str | None = None
    default_score: float = 0.0
    timeout_s: float | None = 30.0  # None: no limit
    max_tokens_per_micro_batch: int = 8192  # the reward model's micro-batch token budget
    pass_threshold: float = 1.0  # validation: a sample counts as solved when its score >= this
    stop_failed_fraction: float = 1.0  # stop the run when this fraction of a step's samples failed

    @property
    def resolved_function(self) -> str:
        return f"builtin:task:{self.task}" if self.function == "builtin:task" else self.function


@dataclass(frozen=True, slots=True)
class RoleBuildSettings:
    """What ppo.roles.build_roles needs beyond the placement: models' sources, layouts, optimizers."""

    seed: int
    dtype: str  # float32 | bfloat16 | float16
    model_path: str | None
    critic_path: str | None  # None: model_path
    share_prompts: bool
    layouts: dict[str, WorkerLayout]  # role -> layout, for actor, ref, critic, reward
    actor_optim: OptimizerSettings
    critic_optim: OptimizerSettings
    actor_offload_optimizer: bool = False
    critic_offload_optimizer: bool = False
    reward: RewardSettings = RewardSettings()


@dataclass(frozen=True, slots=True)
class AdvantageSettings:
    """algorithm.*: the advantage estimator, the KL penalty and DAPO's score shaping and filters."""

    name: str = "ppo"  # ppo | grpo | rloo | reinforce_pp
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    use_kl_penalty: bool = True
    kl_penalty: str = "k1"
    rollout_correction: str = "auto"  # as configured (ppo.algos.rollout_correction.resolve_mode)
    use_kl_loss: bool = False  # actor.use_kl_loss: needs the reference's log-probs
    overlong_buffer: bool = False  # DAPO soft overlong punishment
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    overlong_filter: bool = False
    filter_groups: bool = False  # DAPO dynamic sampling
    max_gen_rounds: int = 4  # algorithm.filter_groups.max_num_gen_batches


@dataclass(frozen=True, slots=True)
class ControllerSettings:
    """controller.*: the batch controller (ppo.control.controller) and the OOM retries of each stage."""

    enabled: bool = False
    low_util: float = 0.60
    high_mem: float = 0.85
    grow: float = 1.2
    shrink: float = 0.5
    hysteresis_steps: int = 2
    max_oom_retries: int = 3


@dataclass(frozen=True, slots=True)
class LoopSettings:
    """The step loop's own settings (ppo.trainer.PPOTrainer). The number of steps is not here: with
    trainer.total_epochs it depends on the data, and ppo.run.state.TrainState resolves it."""

    seed: int
    batch_size: int  # prompts per step
    n: int  # samples per prompt
    max_response_length: int
    async_rollout: bool
    share_prompts: bool
    actor_ppo_epochs: int
    actor_mini_batch_size: int
    micro_batch_tokens: dict[str, int]  # role -> its configured micro-batch token budget (actor, ref, critic)
    advantages: AdvantageSettings
    controller: ControllerSettings
    reward: RewardSettings
    sft_warmup_steps: int
    val_before_train: bool
    test_freq: int
    val_n: int
    val_temperature: float
    save_every: int
    save_final: bool
    save_every_minutes: float
    log_samples_every: int
    log_samples_count: int
    profile_steps: tuple[int, ...]  # 1-based steps run under torch.profiler (ppo.metrics.profiling)
    gc_freeze: bool  # freeze the objects alive after warm-up out of Python's full collections (ppo.metrics.host_gc)


@dataclass(frozen=True, slots=True)
class PPOSettings:
    roles: RolesSettings
    generation: GenerationSettings
    build: RoleBuildSettings
    loop: LoopSettings
