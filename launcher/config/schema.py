"""Config schema (typed dataclasses) and loading: YAML files + `key=value` overrides via OmegaConf.

    cfg = load_config("conf/ppo_tiny.yaml", ["actor.lr=1e-5", "placement.mode=split"])

A YAML file may extend others: `extends: base.yaml` (or a list), paths relative to the
file. Unknown keys fail with the dotted path and the closest valid names; wrong types
name the source (file or command line), the key and the expected type. Everything here
runs before any process group exists, so a bad config costs nothing and exits with 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.errors import UserError

# ---------------------------------------------------------------------------- schema


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
    # tokens trained; needs actor.pp = ref.pp = 1)
    share_prompts: bool = False
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
    dtype: str = "float32"  # parameter/compute dtype: float32 | bfloat16 | float16
    # auto: model.path's tokenizer when that folder has tokenizer.json, else builtin:char;
    # or builtin:char, or a local tokenizer directory
    tokenizer: str = "auto"


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel degree
    pp: int = 1  # pipeline-parallel degree
    dp: int = 0  # data-parallel degree; 0: derived from the pool size
    pp_microbatches: int = 0  # pipeline micro-batches per mini-batch; 0: 2 * pp
    pp_schedule: str = "1F1B"  # 1F1B | interleaved
    pp_stages_per_rank: int = 1  # virtual pipeline stages per rank (interleaved schedule)
    activation_checkpointing: str = "none"  # none | full | selective
    compile: bool = False  # torch.compile each transformer layer
    offload: bool = False  # optimizer states to pinned CPU memory while generating
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
class ActorConfig(ParallelConfig):
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
    # over PCIe per step
    offload_optimizer: bool = False


@dataclass
class CriticConfig(ParallelConfig):
    path: str | None = None  # None: trunk initialised from the actor
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))  # the critic's optimizer
    ppo_epochs: int = 1  # passes over each batch
    mini_batch_size: int = 0  # samples per optimizer step; 0: the whole batch
    max_tokens_per_micro_batch: int = 4096  # token budget of one packed micro-batch
    value_clip: float = 0.2  # clip of the value update around the old values
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean
    offload_optimizer: bool = False  # as actor.offload_optimizer


@dataclass
class RefConfig(ParallelConfig):
    enabled: bool = True  # needed for a KL penalty or KL loss
    max_tokens_per_micro_batch: int = 8192  # token budget of one packed micro-batch


@dataclass
class RewardConfig(ParallelConfig):
    type: str = "rule"  # rule | model
    function: str = "builtin:task"  # builtin:task (the synthetic task's checker), builtin:math, path.py:fn
    # auto | hybridrl | verl; auto: verl's compute_score(data_source, solution_str, ground_truth,
    # extra_info) when the function names solution_str or starts with data_source, else hybridrl's
    # fn(response, ground_truth, **extra)
    signature: str = "auto"
    model_path: str | None = None  # reward model (*ForSequenceClassification) directory
    default_score: float = 0.0  # score of a sample whose reward function raised
    pass_threshold: float = 1.0  # a validation sample counts as solved (pass@k) when its score >= this
    timeout_s: float = 30.0  # per sample; a call running longer is a failure (default_score); 0: no limit
    stop_failed_fraction: float = 1.0  # stop the run when this fraction of a step's samples failed (1: all)
    max_tokens_per_micro_batch: int = 8192  # token budget of one reward-model micro-batch


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
    gpu_memory_fraction: float = 0.5  # share of GPU memory for weights + KV cache while generating
    max_num_seqs: int = 256  # sequences decoded at once
    enable_cuda_graph: bool = True  # capture the decode step in CUDA graphs
    compile: bool = False  # torch.compile the native engine's decode forward (fuses norms/RoPE/SiLU)
    decode_attention: str = "auto"  # native decode attention kernel: auto (timed per shape) | triton | sdpa | ...
    share_prompt_kv: bool = True  # native triton decode: read each GRPO group's prompt KV once, not n times
    fold_norms: bool = True  # native engine: RMSNorm weights folded into the next GEMMs, no norm kernels in decode
    free_memory_on_sleep: bool = True  # false: KV cache, weights and CUDA graphs stay resident while training
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
    mode: str = "colocated"  # colocated | split | auto (the cost model picks pools and layouts: launcher/autoplan.py)
    pools: list[PoolConfig] = field(default_factory=list)  # split mode; empty: actor+rollout | the rest
    calibration: str = "h200"  # cost model's machine (launcher/calibration/<name>.json or a path): auto, plan estimates


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
    "model.dtype": ("float32", "bfloat16", "float16"),
    "rollout.engine": ("native", "hf", "vllm"),
    "rollout.decode_attention": ("auto", "triton", "sdpa", "sdpa-efficient", "sdpa-cudnn", "bmm"),
    "algorithm.name": ("ppo", "grpo", "rloo", "reinforce_pp"),
    "algorithm.kl_penalty": ("k1", "k2", "k3", "low_var_kl"),
    "algorithm.kl_ctrl": ("fixed", "adaptive"),
    "placement.mode": ("colocated", "split", "auto"),
    "reward.type": ("rule", "model"),
    "reward.signature": ("auto", "hybridrl", "verl"),
    "actor.loss_agg": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "actor.policy_loss": ("vanilla", "gspo"),
    "algorithm.rollout_correction": ("auto", "none", "tis", "seq_mask", "tis+seq_mask"),
    "critic.loss_agg": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"),
    "actor.optim.lr_schedule": ("constant", "cosine"),
    "critic.optim.lr_schedule": ("constant", "cosine"),
}
for _role in ("actor", "critic", "ref", "reward"):
    CHOICES[f"{_role}.pp_schedule"] = ("1F1B", "interleaved")
    CHOICES[f"{_role}.activation_checkpointing"] = ("none", "full", "selective")
    CHOICES[f"{_role}.backend"] = ("native", "megatron")

ROLES = ("actor", "rollout", "ref", "critic", "reward")

# ---------------------------------------------------------------------------- loading


def _fields_at(path: list[str]) -> list[str]:
    """Valid field names of the schema node at a dotted path (for "did you mean")."""
    cls: Any = Config
    for part in path:
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return []
        t = hints[part]
        if typing.get_origin(t) is list:
            t = typing.get_args(t)[0]
        if not dataclasses.is_dataclass(t):
            return []
        cls = t
    return [f.name for f in dataclasses.fields(cls)]


def _explain(err: Exception, source: str) -> UserError:
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    full_key = getattr(err, "full_key", None) or ""
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)):
        parts = [p for p in full_key.replace("[", ".").replace("]", "").split(".") if p and not p.isdigit()]
        key = parts[-1] if parts else full_key
        valid = _fields_at(parts[:-1])
        close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr('.'.join(parts[:-1] + [c])) for c in close)}?" if close else ""
        choices = f" Valid keys here: {', '.join(valid)}." if valid and not close else ""
        return UserError(f"{source}: unknown config key '{full_key}'{hint}{choices}")
    if isinstance(err, ValidationError):
        want = ""
        parts = full_key.split(".")
        cls: Any = Config
        try:
            for p in parts[:-1]:
                cls = typing.get_type_hints(cls)[p]
            t = typing.get_type_hints(cls)[parts[-1]]
            want = f" (expected {getattr(t, '__name__', t)})"
        except (KeyError, TypeError):
            pass
        msg = str(err).splitlines()[0]
        return UserError(f"{source}: bad value for '{full_key}'{want}: {msg}")
    return UserError(f"{source}: {err}")


def _list_fields(cls: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: element type} of every list-typed field of the schema (list[str], list[float], ...)."""
    out: dict[str, Any] = {}
    for name, t in typing.get_type_hints(cls).items():
        if typing.get_origin(t) is list:
            out[prefix + name] = typing.get_args(t)[0]
        elif dataclasses.is_dataclass(t):
            out.update(_list_fields(t, f"{prefix}{name}."))
    return out


def _coerce_lists(node: Any, source: str) -> Any:
    """A single value given for a list of strings becomes a one-element list (`data.train_files=a.jsonl`
    means [a.jsonl]); for other lists a single value is an error that says what to write."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(node, DictConfig):
        return node
    tree = OmegaConf.to_container(node, resolve=False)
    changed = False
    for key, elem in _list_fields(Config).items():
        cur: Any = tree
        parts = key.split(".")
        for p in parts[:-1]:
            cur = cur.get(p) if isinstance(cur, dict) else None
        if not isinstance(cur, dict) or parts[-1] not in cur:
            continue
        value = cur[parts[-1]]
        if value is None or isinstance(value, list | tuple | dict):
            continue
        if elem is str:
            cur[parts[-1]], changed = [value], True
        else:
            example = {float: "[0.9,0.95]", int: "[1,2]"}.get(elem, "[...]")
            raise UserError(f"{source}: '{key}' is a list; write {key}={example} (got {value!r})")
    return OmegaConf.create(tree) if changed else node


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()):
    """YAML file -> list of (source, DictConfig) in merge order, bases first."""
    from omegaconf import OmegaConf

    path = path.resolve()
    if path in seen:
        raise UserError(f"{path}: 'extends' cycle: {' -> '.join(str(p) for p in seen + (path,))}")
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        node = OmegaConf.load(path)
    except Exception as e:  # noqa: BLE001 - yaml errors come in many types
        raise UserError(f"{path}: cannot parse YAML: {e}") from None
    if not hasattr(node, "keys"):  # a list, or a scalar: not a config
        raise UserError(f"{path}: the top level of a config file must be a mapping of sections (trainer:, actor:, "
                        f"...), not a {type(node).__name__.replace('ListConfig', 'list')}")
    if len(node) == 0:
        raise UserError(f"{path}: the config file is empty; it needs at least one section (e.g. trainer:) or an "
                        f"'extends: ppo_tiny.yaml' line (every key left out takes its schema default)")
    out = []
    bases = node.pop("extends", None) if hasattr(node, "pop") else None
    for base in [bases] if isinstance(bases, str) else list(bases or []):
        out += _read_yaml(path.parent / base, seen + (path,))
    out.append((str(path), node))
    return out


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Merge YAML (with its bases) and `key=value` overrides onto the schema, validate, return a Config."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = OmegaConf.structured(Config)
    sources = _read_yaml(Path(path)) if path else []
    for bad in [o for o in overrides if "=" not in o]:
        raise UserError(f"command line: override {bad!r} must look like key=value (e.g. actor.tp=2)")
    for o in overrides:
        try:
            sources.append(("command line", OmegaConf.from_dotlist([o])))
        except Exception as e:  # noqa: BLE001 - yaml scanner errors for malformed values
            raise UserError(f"command line: cannot parse override {o!r} as YAML "
                            f"(flow mappings need a space after ':', e.g. {{roles: [actor], size: 1}}): "
                            f"{str(e).splitlines()[0]}") from None
    for source, node in sources:
        node = _coerce_lists(node, source)
        try:
            cfg = OmegaConf.merge(cfg, node)
        except OmegaConfBaseException as e:
            raise _explain(e, source) from None
    obj: Config = OmegaConf.to_object(cfg)
    validate_config(obj)
    return obj


def to_yaml(cfg: Config) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for p in dotted.split("."):
        obj = getattr(obj, p)
    return obj


def validate_config(cfg: Config) -> None:
    """Value checks that the types alone do not express. Topology is checked by launcher.plan."""
    for key, choices in CHOICES.items():
        v = _get(cfg, key)
        if v not in choices:
            close = difflib.get_close_matches(str(v), choices, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(f"{key}={v!r} is not one of {', '.join(choices)}{hint}")
    t, r = cfg.trainer, cfg.rollout
    checks = [
        (t.total_steps >= 1, f"trainer.total_steps({t.total_steps}) must be >= 1"),
        (cfg.data.batch_size >= 1, f"data.batch_size({cfg.data.batch_size}) must be >= 1"),
        (r.n >= 1, f"rollout.n({r.n}) must be >= 1"),
        (r.temperature >= 0, f"rollout.temperature({r.temperature}) must be >= 0"),
        (0 < r.top_p <= 1, f"rollout.top_p({r.top_p}) must be in (0, 1]"),
        (r.max_response_length >= 1, f"rollout.max_response_length({r.max_response_length}) must be >= 1"),
        (cfg.actor.ppo_epochs >= 1, f"actor.ppo_epochs({cfg.actor.ppo_epochs}) must be >= 1"),
        (t.keep_last >= 1, f"trainer.keep_last({t.keep_last}) must be >= 1"),
        (t.total_epochs >= 0, f"trainer.total_epochs({t.total_epochs}) must be >= 0 (0: use trainer.total_steps)"),
        (t.test_freq >= 0, f"trainer.test_freq({t.test_freq}) must be >= 0 (0: validate after the last step only)"),
        (t.log_samples_every >= 0, f"trainer.log_samples_every({t.log_samples_every}) must be >= 0 (0: off)"),
        (t.log_samples_count >= 1, f"trainer.log_samples_count({t.log_samples_count}) must be >= 1"),
        (r.val_n >= 1, f"rollout.val_n({r.val_n}) must be >= 1"),
        (r.val_temperature >= 0, f"rollout.val_temperature({r.val_temperature}) must be >= 0 (0: greedy)"),
        (t.save_every >= 0, f"trainer.save_every({t.save_every}) must be >= 0 (0: no step-based checkpoints)"),
        (t.save_every_minutes >= 0, f"trainer.save_every_minutes({t.save_every_minutes}) must be >= 0 (0: off)"),
        (all(isinstance(x, int) and x >= 1 for x in t.profile_steps),
         f"trainer.profile_steps({list(t.profile_steps)}) must list step numbers >= 1 (e.g. [3]; []: off)"),
        (t.dist_timeout_s > 0, f"trainer.dist_timeout_s({t.dist_timeout_s}) must be > 0 seconds: it bounds how "
                               f"long a collective waits for a missing rank"),
        (t.preempt_grace_s >= 0, f"trainer.preempt_grace_s({t.preempt_grace_s}) must be >= 0 (0: no limit)"),
        (t.watchdog_timeout_s >= 0, f"trainer.watchdog_timeout_s({t.watchdog_timeout_s}) must be >= 0 (0: off)"),
        (cfg.reward.timeout_s >= 0, f"reward.timeout_s({cfg.reward.timeout_s}) must be >= 0 (0: no limit)"),
        (0 < cfg.reward.stop_failed_fraction <= 1,
         f"reward.stop_failed_fraction({cfg.reward.stop_failed_fraction}) must be in (0, 1] (1: stop only when "
         f"every sample of a step failed)"),
        (cfg.actor.mini_batch_size >= 0,
         f"actor.mini_batch_size({cfg.actor.mini_batch_size}) must be >= 0 (samples per optimizer step; 0: the "
         f"whole batch)"),
        (cfg.critic.mini_batch_size >= 0,
         f"critic.mini_batch_size({cfg.critic.mini_batch_size}) must be >= 0 (samples per optimizer step; 0: the "
         f"whole batch)"),
        (cfg.critic.ppo_epochs >= 1, f"critic.ppo_epochs({cfg.critic.ppo_epochs}) must be >= 1"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)
    _validate_roles_keys(cfg)
    d = cfg.data
    # recipes for real models and data say preset/task "none": forgetting the path is an error, not a toy run
    if cfg.model.path is None and cfg.model.preset == "none":
        raise UserError("model.path is required (model.preset=none: no random initialisation); "
                        "set model.path=<Hugging Face model directory>")
    if not d.train_files and d.task == "none":
        raise UserError("data.train_files is required (data.task=none: no synthetic task); "
                        "set data.train_files=train.parquet (or [a.parquet,b.parquet])")
    # validation and sample-log keys act only with their switch: set without it, they are refused
    unused = [(key, value) for key, value, default, active in (
        ("trainer.test_freq", t.test_freq, 0, d.val_files), ("rollout.val_n", r.val_n, 1, d.val_files),
        ("rollout.val_temperature", r.val_temperature, 0.0, d.val_files),
        ("reward.pass_threshold", cfg.reward.pass_threshold, 1.0, d.val_files),
        ("trainer.log_samples_count", t.log_samples_count, 4, t.log_samples_every)) if value != default and not active]
    for key, value in unused:
        switch = "trainer.log_samples_every" if key == "trainer.log_samples_count" else "data.val_files"
        example = "10" if switch == "trainer.log_samples_every" else "[val.parquet]"
        raise UserError(f"{key}={value} acts only with {switch}, which is not set; set {switch}={example} "
                        f"or remove {key}")
    if r.val_n > 1 and r.val_temperature == 0:
        raise UserError(f"rollout.val_n={r.val_n} with rollout.val_temperature=0 (greedy) draws {r.val_n} identical "
                        f"samples; set rollout.val_temperature=1.0 (for pass@{r.val_n}) or rollout.val_n=1")
    if d.sft_answer_key and not (t.sft_warmup_steps and d.train_files):
        raise UserError(f"data.sft_answer_key={d.sft_answer_key!r} is read by the SFT warm-up on data.train_files "
                        f"only; set trainer.sft_warmup_steps>0 and data.train_files, or remove data.sft_answer_key")
    if cfg.algorithm.name in ("grpo", "rloo") and r.n < 2:
        raise UserError(f"algorithm.name={cfg.algorithm.name} compares samples of one prompt: "
                        f"set rollout.n >= 2 (got {r.n})")
    _validate_algorithm_variants(cfg)
    if t.share_prompts and (cfg.actor.pp > 1 or cfg.ref.pp > 1):
        raise UserError(f"trainer.share_prompts packs a prompt once with its responses, which pipeline micro-batches "
                        f"cannot (actor.pp={cfg.actor.pp}, ref.pp={cfg.ref.pp}); set trainer.share_prompts=false or "
                        f"pp=1")
    for role in ("actor", "critic"):
        if getattr(cfg, role).offload_optimizer and getattr(cfg, role).offload:
            raise UserError(f"{role}.offload_optimizer=true keeps the optimizer states in host memory all the time, "
                            f"so {role}.offload=true (move them there while generating) has nothing to move; "
                            f"set {role}.offload=false")
    for role in ("actor", "critic", "ref", "reward"):
        _validate_megatron_role(cfg, role)
    if t.resume not in ("never", "auto") and not Path(t.resume).exists():
        raise UserError(f"trainer.resume={t.resume!r}: no such checkpoint directory (use never, auto or a path)")
    if cfg.model.path is not None and not Path(cfg.model.path).is_dir():
        raise UserError(f"model.path={cfg.model.path!r} is not a directory holding config.json and *.safetensors "
                        f"(set model.path=<Hugging Face model directory>)")
    if cfg.reward.type == "model" and not cfg.reward.model_path and cfg.model.path:
        # a random-initialised reward model only makes sense next to a random-initialised policy (benchmarks)
        raise UserError("reward.type=model needs reward.model_path (a *ForSequenceClassification directory)")
    if r.engine == "vllm":
        _validate_vllm(cfg)
    for pool in cfg.placement.pools:
        for role in pool.roles:
            if role not in ROLES:
                close = difflib.get_close_matches(role, ROLES, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise UserError(f"placement.pools: unknown role {role!r}{hint}; roles: {', '.join(ROLES)}")
        if pool.size < 1:
            raise UserError(f"placement.pools: size must be >= 1, got {pool.size} for roles {pool.roles}")


def _validate_algorithm_variants(cfg: Config) -> None:
    """DAPO / GSPO / Dr. GRPO / rollout-correction keys: each acts in this setting, or is refused."""
    a, r = cfg.algorithm, cfg.rollout
    default = AlgorithmConfig()
    if a.rollout_correction not in ("auto", "none") and cfg.trainer.async_rollout:
        raise UserError(f"algorithm.rollout_correction={a.rollout_correction} needs the trainer's log-probs at the "
                        f"weights that generated the batch, which trainer.async_rollout never computes (its PPO "
                        f"ratio divides by the engine's log-probs directly); set algorithm.rollout_correction=auto "
                        f"or none")
    mode = resolved_rollout_correction(cfg)
    if "tis" not in mode and a.rollout_is_cap != default.rollout_is_cap:
        raise UserError(f"algorithm.rollout_is_cap={a.rollout_is_cap} acts only with algorithm.rollout_correction=tis "
                        f"or tis+seq_mask (it is {a.rollout_correction} -> {mode})")
    if "seq_mask" not in mode and a.rollout_mask_threshold != default.rollout_mask_threshold:
        raise UserError(f"algorithm.rollout_mask_threshold={a.rollout_mask_threshold} acts only with "
                        f"algorithm.rollout_correction=seq_mask or tis+seq_mask (it is {a.rollout_correction})")
    if a.rollout_is_cap <= 1.0:
        raise UserError(f"algorithm.rollout_is_cap({a.rollout_is_cap}) must be > 1 (a cap at or below 1 "
                        f"down-weights every token)")
    if a.rollout_mask_threshold <= 1.0:
        raise UserError(f"algorithm.rollout_mask_threshold({a.rollout_mask_threshold}) must be > 1: it bounds "
                        f"the geometric-mean ratio to [1/threshold, threshold]")
    fg, ob = a.filter_groups, a.overlong_buffer
    if fg.enable:
        if r.n < 2:
            raise UserError(f"algorithm.filter_groups.enable drops groups whose rollout.n samples scored the same: "
                            f"set rollout.n >= 2 (got {r.n})")
        if cfg.trainer.async_rollout:
            raise UserError("algorithm.filter_groups.enable regenerates within the step, which "
                            "trainer.async_rollout (generating the next batch ahead) cannot; turn one off")
        if fg.max_num_gen_batches < 1:
            raise UserError(f"algorithm.filter_groups.max_num_gen_batches({fg.max_num_gen_batches}) must be >= 1")
    elif fg.max_num_gen_batches != FilterGroupsConfig().max_num_gen_batches:
        raise UserError("algorithm.filter_groups.max_num_gen_batches acts only with "
                        "algorithm.filter_groups.enable=true")
    if ob.enable:
        if not 0 < ob.len <= r.max_response_length:
            raise UserError(f"algorithm.overlong_buffer.len({ob.len}) must be in (0, rollout.max_response_length="
                            f"{r.max_response_length}]")
    elif ob != OverlongBufferConfig():
        raise UserError("algorithm.overlong_buffer.len / penalty_factor act only with "
                        "algorithm.overlong_buffer.enable=true")
    if not a.norm_adv_by_std and a.name != "grpo":
        raise UserError(f"algorithm.norm_adv_by_std=false acts only with algorithm.name=grpo (Dr. GRPO); "
                        f"{a.name} does not divide by a group std")


def resolved_rollout_correction(cfg: Config) -> str:
    """algorithm.rollout_correction with `auto` resolved: tis on-policy, none with async rollout."""
    from ppo.algos.rollout_correction import resolve_mode

    return resolve_mode(cfg.algorithm.rollout_correction, async_rollout=cfg.trainer.async_rollout)


def _validate_vllm(cfg: Config) -> None:
    """rollout.engine=vllm: vLLM installed in a supported version, a log-prob convention that matches ours,
    and no key that only the native engine reads."""
    from rollout.vllm_support import installed_vllm_version, logprobs_mode_for, vllm_install_problem

    r = cfg.rollout
    problem = vllm_install_problem(installed_vllm_version())
    if problem is not None:
        raise UserError(problem)
    try:
        logprobs_mode_for(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)
    except ValueError as e:
        raise UserError(str(e)) from None
    if r.decode_attention != "auto":
        raise UserError(f"rollout.decode_attention={r.decode_attention!r} selects a native-engine kernel; vLLM picks "
                        "its own attention backend: leave it at auto with rollout.engine=vllm")
    if not r.share_prompt_kv:
        raise UserError("rollout.share_prompt_kv=false turns off a native-engine kernel feature; vLLM shares prompt "
                        "KV through its own prefix cache: leave it at true with rollout.engine=vllm")
    if not r.fold_norms:
        raise UserError("rollout.fold_norms=false turns off a native-engine feature; vLLM runs its own fused norms: "
                        "leave it at true with rollout.engine=vllm")


def _validate_megatron_role(cfg: Config, role: str) -> None:
    """`<role>.backend: megatron` settings megatron-core cannot run, refused before any process starts
    (the layout checks that need the model's shape are in launcher.plan)."""
    sec = getattr(cfg, role)
    if sec.backend != "megatron" or (role == "reward" and cfg.reward.type == "rule"):
        return
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        raise UserError(f"{role}.backend=megatron needs megatron-core: pip install -e .[megatron] "
                        "(megatron-core==0.16.1)") from None
    trains = role in ("actor", "critic")
    import torch

    on_cpu = cfg.trainer.device == "cpu" or (cfg.trainer.device == "auto" and not torch.cuda.is_available())
    if on_cpu and (trains or sec.pp > 1):
        what = "training (its DDP buffers, distributed optimizer and schedules)" if trains else "pp > 1 (its schedules)"
        device = "cpu" if cfg.trainer.device == "cpu" else "auto with no GPU visible"
        raise UserError(f"{role}.backend=megatron: megatron-core {what} needs CUDA, and trainer.device is "
                        f"{device}; use {role}.backend=native on CPU")
    refused = [
        (sec.compile and sec.activation_checkpointing == "full",
         f"{role}.compile=true with activation_checkpointing=full",
         "megatron's full recompute wraps the layers itself and is not tested compiled; use one of the two"),
        (sec.activation_checkpointing == "selective", f"{role}.activation_checkpointing=selective",
         "megatron's selective recompute targets its own core attention; use none or full"),
        (sec.pp_stages_per_rank != 1, f"{role}.pp_stages_per_rank={sec.pp_stages_per_rank}",
         "virtual pipeline stages are not wired for megatron; use 1"),
        (sec.pp_schedule != "1F1B", f"{role}.pp_schedule={sec.pp_schedule}",
         "megatron-core's schedule for pp > 1 is 1F1B; use 1F1B"),
        (sec.pp_microbatches != 0, f"{role}.pp_microbatches={sec.pp_microbatches}",
         "megatron's schedules run the token-budget micro-batches (any count, any lengths); leave it 0"),
        (trains and cfg.model.dtype == "float16", "model.dtype=float16",
         "megatron training here has no loss scaler; use bfloat16 or float32"),
        (trains and getattr(sec, "offload_optimizer", False), f"{role}.offload_optimizer=true",
         "host-resident Adam moments are the native backend's (parallel/offload_optim.py); set it to false"),
    ]
    for bad, key, fix in refused:
        if bad:
            raise UserError(f"{role}.backend=megatron: {key} is not supported: {fix}")


# ParallelConfig keys that only a model-backed role reads (a rule reward is plain Python over the pool)
_MODEL_KEYS = ("tp", "pp", "pp_microbatches", "pp_schedule", "pp_stages_per_rank", "activation_checkpointing",
               "compile", "backend")


def _validate_roles_keys(cfg: Config) -> None:
    """Keys that would be accepted and ignored: the rollout engine kind, offload on roles without an
    optimizer to offload while generating, model layout keys of a rule reward."""
    from rollout.base import RolloutConfig
    from rollout.factory import ENGINES, NOT_BUILT

    r = cfg.rollout
    if r.engine not in ENGINES:
        raise UserError(f"rollout.engine={r.engine}: {NOT_BUILT[r.engine]}")
    try:  # the engine's own checks, once, before launch
        RolloutConfig(gpu_memory_fraction=r.gpu_memory_fraction, max_num_seqs=r.max_num_seqs,
                     decode_attention=r.decode_attention).validate()
    except ValueError as e:
        raise UserError(f"rollout.{e}") from None
    for role in ("critic", "ref", "reward"):
        if getattr(cfg, role).offload:
            raise UserError(f"{role}.offload=true: only the actor offloads (its optimizer states, while the rollout "
                            f"generates on its GPUs); set {role}.offload=false")
    if cfg.reward.type == "rule":
        default = RewardConfig()
        for key in (*_MODEL_KEYS, "model_path", "max_tokens_per_micro_batch"):
            if getattr(cfg.reward, key) != getattr(default, key):
                raise UserError(f"reward.{key}={getattr(cfg.reward, key)!r} has no effect with reward.type=rule "
                                f"(a rule function runs data parallel over its pool, no model); remove it or set "
                                f"reward.type=model")


def uses_critic(cfg: Config) -> bool:
    return cfg.algorithm.name == "ppo"


def uses_ref(cfg: Config) -> bool:
    a = cfg.algorithm
    return cfg.ref.enabled and ((a.use_kl_penalty and a.kl_coef > 0) or cfg.actor.use_kl_loss)


if __name__ == "__main__":  # python -m launcher.config [section]: every key, its type, default and meaning
    import sys

    from launcher.config_doc import main

    sys.exit(main())
