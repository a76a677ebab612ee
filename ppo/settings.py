"""The typed pieces of a run that the launcher hands to `ppo` (docs/design.md, convention 2: OmegaConf at the edge,
typed dataclasses inside): the run's seed, length, logs and checkpoints, its prompts, the reward, the
roles' loss and update settings, the generation role's engine config and sampling, how each role's workers
are built, and the step loop's own settings. launcher/handoff.py builds them from the config tree once;
nothing in `ppo` reads the tree. Each fact has one field, and its readers read it there.

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


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """The agent loops the rollout runs (ppo/agents; docs/agents.md): the loop of rows without an agent_name
    column, the tools and loop files, and the tool loop's limits."""

    default: str = "single_turn"
    tools_file: str | None = None
    loop_file: str | None = None
    max_turns: int = 4
    max_tool_response_tokens: int = 256
    tool_timeout_s: float = 30.0
    tool_workers: int = 8
    keep_kv: bool = True  # NativeEngine sessions: a trajectory's KV kept between its turns (ppo/agents/driver.py)


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
    # the actor's optimizer states to pinned host memory while the engine generates, back before the update
    # (rollout.hybrid.HybridEngine); not the host-streamed optimizer (OptimizerSettings.stream_from_host)
    offload_optimizer_while_generating: bool = False
    dtype: torch.dtype = torch.float32  # of the generation weights
    vllm: object | None = None  # rollout.vllm_support.VLLMOptions when engine_kind == "vllm"
    # a LoRA actor's update to the engine (actor.lora.sync): "adapters", "merged" or "auto" (ppo.roles.generation.
    # choose_lora_sync decides at start); full-parameter actors: "merged" (every weight)
    lora_sync: str = "merged"
    # rollout.free_memory_on_sleep unset: the engine frees its memory on sleep until the first step's peaks show
    # whether it fits beside training (ppo.roles.generation.RolloutRole.settle_memory)
    settle_residency: bool = False
    partial_kv: str = "recompute"  # rollout.partial.PartialRollouts(kv=): recompute | keep the KV at a weight swap
    decode_beside: bool = False  # partial rollouts decode on beside the scoring and the update (rollout/beside.py)
    agent: AgentSettings = AgentSettings()


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
    # Adam's moments live in pinned host memory and stream through the GPU during each optimizer step
    # (parallel/offload_optim.py); not the engine's offload while generating
    stream_from_host: bool = False


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
    """The reward role: a rule function or a reward model, and what the loop does with failed scores."""

    is_model: bool = False  # a reward model scores (reward.model set), not the function
    function: str = "builtin:task:add:1"  # the rule function's spec (builtin:task resolved against data.task)
    signature: str = "auto"
    model_path: str | None = None
    default_score: float = 0.0
    timeout_s: float | None = 30.0  # None: no limit
    max_tokens_per_micro_batch: int = 8192  # the reward model's micro-batch token budget
    pass_threshold: float = 1.0  # validation: a sample counts as solved when its score >= this
    stop_failed_fraction: float = 1.0  # stop the run when this fraction of a step's samples failed


@dataclass(frozen=True, slots=True)
class LoRASettings:
    """actor.lora with rank > 0 (models.lora.LoRASpec's fields, and a PEFT adapter directory to start from)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("all-linear",)
    init_from: str | None = None


@dataclass(frozen=True, slots=True)
class RoleBuildSettings:
    """What ppo.roles.build_roles needs beyond the placement, the run's seed and the reward: models' sources,
    layouts, optimizers."""

    dtype: str  # float32 | bfloat16
    model_path: str | None  # None: random init (also where the tokenizer comes from with model.tokenizer=auto)
    critic_path: str | None  # None: model_path
    share_prompts: bool  # actor and reference forwards pack each prompt once with its n responses
    layouts: dict[str, WorkerLayout]  # role -> layout, for actor, ref, critic, reward
    actor_optim: OptimizerSettings
    critic_optim: OptimizerSettings
    actor_lora: LoRASettings | None = None  # None: full-parameter training
    router_replay: bool = False  # a mixture of experts: actor and reference forwards use the engine's experts
    router_aux_loss_coef: float | None = None  # a mixture of experts: the actor's load-balancing weight (None: model's)


@dataclass(frozen=True, slots=True)
class KLControlSettings:
    """algorithm.kl_ctrl / kl_coef / target_kl / kl_horizon: the in-reward KL penalty's coefficient
    (ppo.algos.core_algos.FixedKLController / AdaptiveKLController)."""

    kind: str = "fixed"  # fixed | adaptive
    coef: float = 0.01  # the coefficient (the initial one when adaptive)
    target: float = 0.1  # adaptive: the KL it steers to
    horizon: int = 10000  # adaptive: samples over which it moves


@dataclass(frozen=True, slots=True)
class AdvantageSettings:
    """algorithm.*: the advantage estimator, the KL penalty and DAPO's score shaping and filters."""

    name: str = "ppo"  # ppo | grpo | rloo | reinforce_pp
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    use_kl_penalty: bool = True
    kl_penalty: str = "k1"
    kl_control: KLControlSettings = KLControlSettings()
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
    """The step loop's own settings (ppo.trainer.PPOTrainer). What the loop reads from other settings is
    read there: the seed (RunSettings), prompts per step (DataSettings.batch_size), samples per prompt and the
    response length (GenerationSettings), the actor's epochs and mini-batches (RolesSettings.actor_update),
    the reward (RewardSettings). The number of steps is not here: with trainer.total_epochs it depends on the
    data, and ppo.run.state.TrainState resolves it."""

    max_staleness: int  # K: batches generated ahead, each trained at most K steps after its policy (0: synchronous)
    batches_in_flight: int  # > 1: over-provisioned partial rollouts (rollout.partial), no batches generated ahead
    stale_policy: str  # partial rollouts' due groups: "pace" (waited for) | "drop" (not waited for; dropped)
    micro_batch_tokens: dict[str, int]  # role -> its configured micro-batch token budget (actor, ref, critic)
    advantages: AdvantageSettings
    controller: ControllerSettings
    sft_warmup_steps: int  # the supervised warm-up's steps (its micro-batches: micro_batch_tokens["actor"])
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
    max_nonfinite_steps: int = 3  # non-finite steps in a row (not applied) that stop the run (NonFiniteStepsError)


@dataclass(frozen=True, slots=True)
class RunSettings:
    """trainer.*: the run's seed and length, its logs and its checkpoints (ppo.run.state.TrainState)."""

    seed: int  # model init, data order and sampling
    total_steps: int  # ignored when total_epochs > 0
    total_epochs: int  # > 0: total_steps = epochs x the data's batches per epoch (TrainState resolves it)
    experiment_name: str  # the W&B run's name
    progress_bar: bool
    tensorboard: bool
    wandb: bool
    wandb_project: str
    resume: str  # never | auto | <checkpoint dir>
    on_damaged_checkpoint: str  # stop | fallback
    keep_last: int  # checkpoints kept on disk
    export_hf: str  # final | every_save
    config_record: dict | None = None  # the resolved config as plain data: the W&B run's config


@dataclass(frozen=True, slots=True)
class DataSettings:
    """data.* and model.tokenizer: the prompts, their tokenizer and order, the supervised warm-up's answers."""

    tokenizer: str  # as configured; auto: RoleBuildSettings.model_path's tokenizer.json, else builtin:char
    train_files: tuple[str, ...]  # empty: the synthetic task
    val_files: tuple[str, ...]  # empty: no validation
    task: str  # the synthetic task (ppo/data/tasks.py)
    task_size: int
    prompt_key: str
    answer_key: str | None
    sft_answer_key: str | None
    max_prompt_length: int
    batch_size: int  # prompts per step
    shuffle: bool


@dataclass(frozen=True, slots=True)
class PPOSettings:
    run: RunSettings
    data: DataSettings
    reward: RewardSettings
    roles: RolesSettings
    generation: GenerationSettings
    build: RoleBuildSettings
    loop: LoopSettings
