"""The config schema: typed dataclasses with their defaults, the allowed values of string keys
(CHOICES), and the settings derived from them (which roles a run uses).

Each role's section holds the keys that role can act on: every model role has a layout (ParallelConfig); only
the trained roles (actor, critic) have activation checkpointing and an optimizer, and only the actor offloads
its optimizer while the rollout generates on its GPUs. The reward section holds the rule function's keys; a
reward model is its own optional section, `reward.model` (null unless set), so a rule reward has no model keys.

The comment beside (or just above) each field is its meaning in `python -m launcher.config`
(launcher/config/doc.py reads them from this file).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainerConfig:
    experiment_name: str = "ppo_tiny"  # run directory name: runs_dir/experiment_name
    runs_dir: str = "runs"  # parent directory of run directories
    total_steps: int = 20  # PPO steps to run (ignored when total_epochs > 0)
    total_epochs: int = 0  # > 0: passes over data.train_files; total_steps = epochs x (prompts // data.batch_size)
    seed: int = 42  # model init, data order and sampling seeds
    save_every: int = 0  # steps between checkpoints; 0: none by step count (see save_every_minutes)
    save_every_minutes: float = 30.0  # also checkpoint when this long has passed since the last one; 0: off
    preempt_grace_s: float = 100.0  # SIGTERM/SIGINT: finish the step and save within this, else exit 75 anyway
    watchdog_timeout_s: float = 180.0  # a rank silent this long makes every rank exit naming it; 0: off
    on_damaged_checkpoint: str = "stop"  # resume=auto and the newest checkpoint is damaged: stop | fallback
    save_final: bool = True  # false: no checkpoint after the last step (benchmarks: ~12 GB a 1B PPO run)
    keep_last: int = 2  # checkpoints kept on disk (older ones are deleted)
    export_hf: str = "final"  # final | every_save: Hugging Face directories of actor and critic in checkpoints
    resume: str = "never"  # never | auto | <checkpoint dir>
    async_rollout: bool = False  # one-step off-policy: generate batch k+1 while batch k trains
    device: str = "auto"  # auto | cpu | cuda
    dist_backend: str = "auto"  # auto (nccl on cuda, gloo otherwise) | nccl | gloo
    dist_timeout_s: int = 600  # process-group timeout of collectives (seconds)
    progress_bar: bool = True  # tqdm bar on rank 0 (metrics lines every 10 steps)
    tensorboard: bool = True  # write scalars (and sample text) to <run dir>/tensorboard
    wandb: bool = False  # log metrics to Weights & Biases (needs `pip install wandb`)
    wandb_project: str = "hybridrl"  # W&B project name
    # supervised warm-up before RL: on data.train_files' answers (data.sft_answer_key, else the ground truth),
    # or on the synthetic task's answers without train_files
    sft_warmup_steps: int = 0
    sft_lr: float = 3e-3  # learning rate of the supervised warm-up
    overwrite: bool = False  # allow reusing a run directory that holds a finished run
    # actor/reference forwards pack each prompt once with its rollout.n responses (GRPO: n x fewer prompt
    # tokens trained; needs actor.pp = ref.pp = 1); unset: on when n > 1 with pp = 1 and native backends
    share_prompts: bool | None = None
    test_freq: int = 0  # validate on data.val_files every N steps (and after the last); 0: only after the last
    val_before_train: bool = True  # validate once before the first RL step (needs data.val_files)
    log_samples_every: int = 0  # every N steps write a few prompts/responses/rewards to samples.jsonl; 0: off
    log_samples_count: int = 4  # how many samples each such step shows
    # steps (1-based) run under torch.profiler: <run dir>/profile/step<N>_rank<r>.json (device time per stage:
    # kernels, gaps, categories, top kernels) and a chrome trace beside it; []: off
    profile_steps: list[int] = field(default_factory=list)
    # after the first step and any step that compiled a graph: one full garbage collection, then gc.freeze() of
    # the survivors, so that Python's later full collections stop rescanning what torch.compile left (each one a
    # host stall of tenths of a second inside some step; ppo/metrics/host_gc.py). false: Python's collector untouched
    gc_freeze: bool = True


@dataclass
class ModelSourceConfig:
    path: str | None = None  # local Hugging Face directory; None: random init from `preset`
    preset: str = "tiny"  # model shape when path is None (models/config.py PRESETS); none: model.path is required
    dtype: str = "float32"  # parameter/compute dtype: float32 | bfloat16
    # auto: model.path's tokenizer when that folder has tokenizer.json, else builtin:char;
    # or builtin:char, or a local tokenizer directory
    tokenizer: str = "auto"


@dataclass
class ParallelConfig:
    """A model role's layout on its ranks (actor, critic, reference, reward model)."""

    tp: int = 1  # tensor-parallel degree
    pp: int = 1  # pipeline-parallel degree
    dp: int = 0  # data-parallel degree; 0: derived from the pool size
    pp_microbatches: int = 0  # pipeline micro-batches per mini-batch; 0: 2 * pp
    pp_schedule: str = "1F1B"  # 1F1B | interleaved
    pp_stages_per_rank: int = 1  # virtual pipeline stages per rank (interleaved schedule)
    compile: bool | None = None  # torch.compile each transformer layer; unset: on with CUDA (config/auto.py)
    backend: str = "native"  # native (PyTorch DTensor/FSDP2/pipelining) | megatron (megatron-core GPTModel)


@dataclass
class OptimConfig:
    lr: float = 1e-6  # peak learning rate (AdamW)
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas, e.g. [0.9,0.95]
    warmup_steps: int = 0  # linear learning-rate warm-up steps
    lr_schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    grad_clip: float = 1.0  # max global gradient norm


@dataclass
class LoRAConfig:
    """LoRA adapters on the actor (models/lora.py): the base frozen, the optimizer over the adapters only."""

    rank: int = 0  # adapter rank r; 0: off (full-parameter training)
    alpha: float = 16.0  # the adapters' scale is alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input in the update's forward (actor.tp = 1 only)
    # PEFT module names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or all-linear
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    init_from: str | None = None  # a PEFT adapter directory to continue from (its r, alpha and targets must match)


@dataclass
class ActorConfig(ParallelConfig):
    # recompute activations in the backward: none | full | selective; unset: the cheapest setting that fits the
    # GPU (launcher.planning.fit)
    activation_checkpointing: str | None = None
    optim: OptimConfig = field(default_factory=OptimConfig)  # the actor's optimizer
    ppo_epochs: int = 1  # passes over each batch
    mini_batch_size: int = 0  # samples per optimizer step; 0: the whole batch
    max_tokens_per_micro_batch: int = 4096  # token budget of one packed micro-batch
    clip_low: float = 0.2  # PPO ratio clip below 1 (1 - clip_low)
    clip_high: float = 0.2  # PPO ratio clip above 1 (1 + clip_high; DAPO's clip-higher: 0.28)
    dual_clip_c: float = 3.0  # dual-clip bound for negative advantages
    entropy_coef: float = 0.0  # entropy bonus weight
    use_kl_loss: bool = False  # GRPO style: KL to the reference as a loss term
    kl_loss_coef: float = 0.001  # weight of the KL loss term
    kl_loss_type: str = "low_var_kl"  # KL estimator of the loss term: k1 | k2 | k3 | low_var_kl
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (Dr. GRPO: token sum
    # over rollout.max_response_length, no per-response length normalisation)
    loss_agg: str = "token-mean"
    policy_loss: str = "vanilla"  # vanilla (token-ratio PPO clip) | gspo (sequence ratio; use clip ~3e-4/4e-4)
    # Adam's moments live in pinned host memory and visit the GPU chunk by chunk during the optimizer
    # step (parallel/offload_optim.py): 8 bytes/parameter less device memory, ~8 bytes/parameter each way
    # over PCIe per step; unset: on only when the step does not fit the GPU without it (launcher.planning.fit)
    offload_optimizer: bool | None = None
    # the optimizer states go to pinned host memory while the rollout generates on the actor's GPUs and come back
    # before the update (rollout/hybrid.py); refused beside offload_optimizer=true (they live there already)
    offload_optimizer_while_generating: bool = False
    # LoRA adapters (rank > 0): the reference is the actor's base with its adapters off (no second model)
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass
class CriticConfig(ParallelConfig):
    activation_checkpointing: str | None = None  # as actor.activation_checkpointing
    path: str | None = None  # None: trunk initialised from the actor
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))  # the critic's optimizer
    ppo_epochs: int = 1  # passes over each batch
    mini_batch_size: int = 0  # samples per optimizer step; 0: the whole batch
    max_tokens_per_micro_batch: int = 4096  # token budget of one packed micro-batch
    value_clip: float = 0.2  # clip of the value update around the old values
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean
    offload_optimizer: bool | None = None  # as actor.offload_optimizer


@dataclass
class RefConfig(ParallelConfig):
    """The frozen reference: a layout and a forward, no backward, no optimizer."""

    enabled: bool = True  # needed for a KL penalty or KL loss
    max_tokens_per_micro_batch: int = 8192  # token budget of one packed micro-batch


@dataclass
class RewardModelConfig(ParallelConfig):
    """A reward model (*ForSequenceClassification) on the reward role's GPUs: the score at each response's last
    token."""

    # its Hugging Face directory; unset: random-initialised (benchmarks only, beside a random-initialised policy)
    path: str | None = None
    max_tokens_per_micro_batch: int = 8192  # token budget of one reward-model micro-batch


@dataclass
class RewardConfig:
    """How responses are scored: the rule function, or the reward model when `reward.model` is set."""

    function: str = "builtin:task"  # builtin:task (the synthetic task's checker), builtin:math, path.py:fn
    # auto | hybridrl | verl; auto: verl's compute_score(data_source, solution_str, ground_truth,
    # extra_info) when the function names solution_str or starts with data_source, else hybridrl's
    # fn(response, ground_truth, **extra)
    signature: str = "auto"
    default_score: float = 0.0  # score of a sample whose reward function raised
    pass_threshold: float = 1.0  # a validation sample counts as solved (pass@k) when its score >= this
    timeout_s: float = 30.0  # per sample; a call running longer is a failure (default_score); 0: no limit
    stop_failed_fraction: float = 1.0  # stop the run when this fraction of a step's samples failed (1: all)
    # a reward model scores instead of the function: reward.model.path=DIR, its layout as a role's
    # (reward.model.tp=2, ...); reward.model={} a random-initialised one (benchmarks); null: the function scores
    model: RewardModelConfig | None = None


@dataclass
class RolloutRoleConfig:
    engine: str = "native"  # native | hf | vllm
    gen_tp: int = 0  # generation tensor-parallel degree; 0: the actor's tp
    n: int = 1  # samples per prompt
    temperature: float = 1.0  # sampling temperature (0: greedy)
    top_k: int = -1  # sample among the k most likely tokens; -1: off
    top_p: float = 1.0  # nucleus sampling mass; 1: off
    max_response_length: int = 16  # tokens generated per response at most
    val_n: int = 1  # validation samples per prompt (pass@k uses k = 1 and val_n)
    val_temperature: float = 0.0  # validation sampling temperature (0: greedy)
    # share of the free GPU memory the KV cache may take when the engine wakes; unset: 0.9 while the engine's memory
    # is freed for training, 0.5 with rollout.free_memory_on_sleep=false (training needs the rest)
    gpu_memory_fraction: float | None = None
    max_num_seqs: int | None = None  # sequences decoded at once; unset: the step's rows (data.batch_size x n)
    enable_cuda_graph: bool = True  # capture the decode step in CUDA graphs
    compile: bool | None = None  # torch.compile the native engine's decode forward; unset: on with CUDA
    decode_attention: str = "auto"  # native decode attention kernel: auto (timed per shape) | triton | sdpa | ...
    share_prompt_kv: bool = True  # native triton decode: read each GRPO group's prompt KV once, not n times
    fold_norms: bool = True  # native engine: RMSNorm weights folded into the next GEMMs, no norm kernels in decode
    # native engine: auto (the model dtype) | fp8 (e4m3 values, one fp32 scale per token and KV head: about half
    # the KV bytes per decode step and twice the sequences per GB; log-probs shift by fp8 rounding, which
    # algorithm.rollout_correction absorbs)
    kv_cache_dtype: str = "auto"
    # false: KV cache, weights and CUDA graphs stay resident while training; unset: decided after the first step
    # (resident when the training peak plus the engine's memory fits in 90% of the GPU; native engine on CUDA)
    free_memory_on_sleep: bool | None = None
    bucket_mb: int = 256  # hybrid-engine reshard bucket


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # JSONL / Parquet; empty: the synthetic task
    val_files: list[str] = field(default_factory=list)  # JSONL / Parquet validation prompts; empty: no validation
    # built-in synthetic task (ppo/data/tasks.py: add|copy|reverse[:digits]) when train_files is empty;
    # none: data.train_files is required
    task: str = "add:1"
    task_size: int = 4096  # rows of the synthetic task
    prompt_key: str = "prompt"  # column of the prompt (text or chat messages); dotted for nested
    answer_key: str | None = None  # ground-truth column (dotted); None: reward_model.ground_truth, ground_truth, answer
    sft_answer_key: str | None = None  # column the SFT warm-up trains on; None: the ground truth
    max_prompt_length: int = 64  # prompts with more tokens are dropped (counted in the log)
    batch_size: int = 16  # prompts per step
    shuffle: bool = True  # shuffle prompts every epoch


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose rollout.n samples all scored the same, draw more."""

    enable: bool = False  # DAPO dynamic sampling: keep only groups whose samples' scores differ
    max_num_gen_batches: int = 4  # generation rounds per step at most; then topped up with dropped groups


@dataclass
class OverlongBufferConfig:
    """DAPO soft overlong punishment: the score falls linearly by up to penalty_factor over the last
    `len` tokens before rollout.max_response_length."""

    enable: bool = False  # DAPO soft overlong punishment added to the score
    len: int = 0  # tokens before rollout.max_response_length over which the penalty ramps from 0 to the full factor
    penalty_factor: float = 1.0  # the penalty at rollout.max_response_length


@dataclass
class AlgorithmConfig:
    name: str = "ppo"  # ppo | grpo | rloo | reinforce_pp
    gamma: float = 1.0  # discount
    lam: float = 1.0  # GAE lambda
    norm_adv_by_std: bool = True  # grpo only; false: Dr. GRPO's mean-only baseline
    use_kl_penalty: bool = True  # KL to the reference folded into the token rewards
    kl_penalty: str = "k1"  # k1 | k2 | k3 | low_var_kl
    kl_ctrl: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.01  # KL penalty coefficient (initial one when adaptive)
    target_kl: float = 0.1  # adaptive controller's target KL
    kl_horizon: int = 10000  # adaptive controller's horizon (samples)
    # engine vs trainer log-prob mismatch: auto (tis on-policy; none with trainer.async_rollout, whose
    # ratio already divides by the engine's log-probs) | none (metrics only) | tis | seq_mask | tis+seq_mask
    rollout_correction: str = "auto"
    rollout_is_cap: float = 2.0  # tis: token weight min(pi_train / pi_rollout, cap)
    rollout_mask_threshold: float = 1.01  # seq_mask: drop a response whose geometric-mean ratio leaves [1/t, t]
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)  # DAPO dynamic sampling
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)  # DAPO length penalty
    overlong_filter: bool = False  # DAPO: responses cut at max_response_length get no policy gradient


@dataclass
class PoolConfig:
    roles: list[str] = field(default_factory=list)  # roles placed on this pool's ranks
    size: int = 1  # a weight: pools get world_size * size / sum(sizes) ranks


@dataclass
class PlacementConfig:
    # colocated | split | auto (the cost model picks pools and layouts: launcher/planning/autoplan.py)
    mode: str = "colocated"
    pools: list[PoolConfig] = field(default_factory=list)  # split mode; empty: actor+rollout | the rest
    # cost model's machine (launcher/planning/calibration/<name>.json or a path): auto, plan estimates
    calibration: str = "h200"


@dataclass
class MonitorConfig:
    enabled: bool = True  # sample GPU utilization and memory through NVML into util.jsonl
    interval_s: float = 0.5  # seconds between samples


@dataclass
class ControllerConfig:
    enabled: bool = False  # resize micro-batch and rollout token budgets from GPU feedback at step boundaries
    low_util: float = 0.60  # grow the budgets when utilization is below this
    high_mem: float = 0.85  # shrink them when memory use is above this fraction
    grow: float = 1.2  # growth factor
    shrink: float = 0.5  # shrink factor
    hysteresis_steps: int = 2  # steps a condition must hold before acting
    max_oom_retries: int = 3  # CUDA OOM: halve the budget and retry a stage at most this often


@dataclass
class Config:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # run, loop, logging, checkpoints
    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)  # the policy model and tokenizer
    actor: ActorConfig = field(default_factory=ActorConfig)  # policy training
    critic: CriticConfig = field(default_factory=CriticConfig)  # value model (PPO)
    ref: RefConfig = field(default_factory=RefConfig)  # frozen reference policy (KL)
    reward: RewardConfig = field(default_factory=RewardConfig)  # reward function or reward model
    rollout: RolloutRoleConfig = field(default_factory=RolloutRoleConfig)  # generation
    data: DataConfig = field(default_factory=DataConfig)  # prompts
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # advantages and KL
    placement: PlacementConfig = field(default_factory=PlacementConfig)  # which ranks host which roles
    monitor: MonitorConfig = field(default_factory=MonitorConfig)  # GPU monitor
    controller: ControllerConfig = field(default_factory=ControllerConfig)  # batch-size controller


CHOICES: dict[str, tuple[str, ...]] = {
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.dist_backend": ("auto", "nccl", "gloo"),
    "trainer.on_damaged_checkpoint": ("stop", "fallback"),
    "trainer.export_hf": ("final", "every_save"),
    "model.dtype": ("float32", "bfloat16"),
    "rollout.engine": ("native", "vllm"),  # rollout.factory.ENGINES
    "rollout.decode_attention": ("auto", "triton", "sdpa", "sdpa-efficient", "sdpa-cudnn", "bmm"),
    "rollout.kv_cache_dtype": ("auto", "fp8"),  # rollout.base.KV_CACHE_DTYPES
    "algorithm.name": ("ppo", "grpo", "rloo", "reinforce_pp"),
    "algorithm.kl_penalty": ("k1", "k2", "k3", "low_var_kl"),
    "algorithm.kl_ctrl": ("fixed", "adaptive"),
    "placement.mode": ("colocated", "split", "auto"),
    "reward.signature": ("auto", "hybridrl", "verl"),
    "actor.loss_agg": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "actor.policy_loss": ("vanilla", "gspo"),
    "algorithm.rollout_correction": ("auto", "none", "tis", "seq_mask", "tis+seq_mask"),
    "critic.loss_agg": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"),
    "actor.optim.lr_schedule": ("constant", "cosine"),
    "critic.optim.lr_schedule": ("constant", "cosine"),
}
for _role in ("actor", "critic", "ref", "reward.model"):
    CHOICES[f"{_role}.pp_schedule"] = ("1F1B", "interleaved")
    CHOICES[f"{_role}.backend"] = ("native", "megatron")
for _role in ("actor", "critic"):
    CHOICES[f"{_role}.activation_checkpointing"] = ("none", "full", "selective")

ROLES = ("actor", "rollout", "ref", "critic", "reward")
MODEL_ROLES = ("actor", "critic", "ref", "reward")  # the roles that may hold a model (a layout section)


def role_section(cfg: Config, role: str) -> ParallelConfig | None:
    """A model role's layout section: reward.model for the reward role (None for a rule reward)."""
    return cfg.reward.model if role == "reward" else getattr(cfg, role)


def reward_is_model(cfg: Config) -> bool:
    return cfg.reward.model is not None


def uses_critic(cfg: Config) -> bool:
    return cfg.algorithm.name == "ppo"


def uses_ref(cfg: Config) -> bool:
    a = cfg.algorithm
    return cfg.ref.enabled and ((a.use_kl_penalty and a.kl_coef > 0) or cfg.actor.use_kl_loss)


def resolved_rollout_correction(cfg: Config) -> str:
    """algorithm.rollout_correction with `auto` resolved: tis on-policy, none with async rollout."""
    from ppo.algos.rollout_correction import resolve_mode

    return resolve_mode(cfg.algorithm.rollout_correction, async_rollout=cfg.trainer.async_rollout)


def active_roles(cfg: Config) -> list[str]:
    """Roles this config needs, in plan order."""
    roles = ["actor", "rollout"]
    if uses_ref(cfg):
        roles.append("ref")
    if uses_critic(cfg):
        roles.append("critic")
    roles.append("reward")  # rule rewards run on the reward ranks' CPUs; a reward model on their GPUs
    return roles
