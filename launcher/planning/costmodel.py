"""Cost model of one PPO/GRPO step on a device plan: stage seconds, step seconds, memory per GPU.

    cal = load_calibration("h200")
    w = build_workload(cfg, model=preset_config("llama-1b"))
    est = estimate(w, cal, Candidate.colocated(world_size=1, tp=1, pp=1, gen_tp=1, is_async=False))
    est.step_s, est.stages, est.peak_gb, est.reject   # reject: None, or why the plan cannot run

Every stage time is counted work over a calibrated ceiling (launcher/planning/calibration/<machine>.json,
written by `python -m bench.calibrate`):
- generation: per decode step, max(weight bytes / HBM, matmul FLOPs / matmul peak) + KV bytes / HBM
  + a per-layer launch overhead (fitted to bench.generate at three batch sizes), TP all-reduces;
  prefill at a prefill MFU; waves when the KV cache holds fewer sequences than a replica gets.
- forwards (old log-probs, reference, values, reward model) and updates: ppo/metrics/flops.py's 2N / 6N per
  token plus the causal attention term, at the forward / update MFU of the micro-benchmarks, a 1F1B
  pipeline bubble, TP all-reduces (not overlapped) and FSDP gathers (overlapped with compute).
- reshard: the bytes each rank receives (parallel/reshard.py's lower bound) at the measured rate.
- host: GAE and rule rewards on the CPU; samples and results exchanged between pools.
Step time per placement (ppo/trainer/step.py's order): colocated runs every stage in sequence; split runs
the pools' stages of each phase side by side (the slower pool bounds the phase); async overlaps
generation of batch k+1 with scoring of batch k and drops the old-log-prob forward.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ppo.metrics.flops import update_matmul_flops
from ppo.roles.step_plan import old_logp_share, old_logp_source

CALIBRATION_DIR = Path(__file__).resolve().parent / "calibration"
# mixed precision: fp32 master + fp32 grad + Adam m, v (fp32); the 2-byte weights the forward reads (FSDP2's
# gathered copy, or the bf16 parameters of parallel/master_weights.py at dp = 1) are not counted
TRAINED_BYTES_PER_PARAM = 16
FROZEN_BYTES_PER_PARAM = 4  # reference / reward model with model.dtype=float32; a 16-bit model.dtype stores
# them in it (2 bytes: ppo/roles/workers.py, WorkerSpec.frozen)
# Adam's m and v (fp32): to host memory while generating (actor.offload_optimizer_while_generating), or for good
# (<role>.offload_optimizer)
OFFLOADED_BYTES_PER_PARAM = 8
BF16 = 2


@dataclass(frozen=True, slots=True)
class Calibration:
    """Measured ceilings of one machine type (one GPU and its links); see launcher/planning/calibration/*.json."""

    name: str
    peak_flops: float  # the device's dense bf16 spec peak, FLOP/s (989e12 on H100/H200 SXM); fractions below are of it
    hbm_bytes_per_s: float
    hbm_gb: float  # usable device memory per GPU (GB, 1e9)
    gpus_per_node: int
    mfu_update: float  # forward+backward+optimizer over (6N + causal attention) FLOPs
    mfu_forward: float  # log-prob / value forward over (2N + causal attention) FLOPs
    mfu_prefill: float
    dp_update_efficiency: float  # per-GPU update speed at dp=2 (FSDP) over dp=1: what FSDP costs beyond the model
    dp_forward_efficiency: float  # the same for the log-prob forward
    decode_weight_bw_fraction: float  # weight streaming of the decode GEMMs, of hbm_bytes_per_s
    decode_gemm_fraction: float  # decode GEMMs when compute-bound, of peak_flops
    decode_kv_bw_fraction: float  # decode attention streaming the KV cache, of hbm_bytes_per_s
    decode_kv_fp8_bw_fraction: float  # the same with rollout.kv_cache_dtype=fp8 (its bytes: values and row scales)
    decode_layer_overhead_s: float  # launch gaps and small kernels per layer and decode step
    activation_bytes_per_token_layer_hidden: float  # saved activations of a training micro-batch
    reshard_bytes_per_s: float  # received bytes per second per rank of the hybrid-engine reshard
    nccl_intra_bytes_per_s: float  # collective bus bandwidth inside a node
    nccl_inter_bytes_per_s: float  # per GPU, across nodes
    nccl_latency_s: float
    pcie_bytes_per_s: float  # optimizer offload to host memory
    host_gae_s_per_token: float
    host_rule_reward_s_per_sample: float
    source: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        names = set(cls.__dataclass_fields__)
        missing = sorted(names - set(d) - {"source"})
        if missing:
            raise ValueError(f"calibration {d.get('name')!r} lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in d.items() if k in names})


MACHINES = {"H200": "h200", "H100": "h100"}  # a CUDA device name's part -> its calibration's name
DEFAULT_CALIBRATION = "h200"


def current_gpu_name() -> str | None:
    """The name of the CUDA device this process sees, or None."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def auto_calibration(device_name: str | None) -> tuple[str, str]:
    """placement.calibration=auto for a launch on the GPU named `device_name` (None: no GPU): (the calibration's
    name, why)."""
    if device_name is None:
        return DEFAULT_CALIBRATION, f"no GPU visible here: the {DEFAULT_CALIBRATION} calibration"
    machine = next((m for part, m in MACHINES.items() if part in device_name), None)
    if machine is not None and (CALIBRATION_DIR / f"{machine}.json").is_file():
        return machine, f"the calibration of this GPU ({device_name})"
    how = f"`python -m bench.calibrate --name {machine}` on it" if machine else "none of its type"
    return DEFAULT_CALIBRATION, f"no calibration of this GPU ({device_name}; {how}): the {DEFAULT_CALIBRATION} one"


def resolve_calibration(cfg) -> list[str]:
    """placement.calibration=auto -> the launch's machine (auto_calibration), in place. -> its auto line, or none
    where the config names one."""
    from launcher.config.auto import on_cuda

    if cfg.placement.calibration != "auto":
        return []
    name, why = auto_calibration(current_gpu_name() if on_cuda(cfg) else None)
    cfg.placement.calibration = name
    return [f"placement.calibration={name} (auto: {why})"]


def load_calibration(name_or_path: str) -> Calibration:
    """`h200` -> launcher/planning/calibration/h200.json; a path to a .json file is read as given; `auto` ->
    auto_calibration's for this process's GPU (a launch resolves it first, with its line: resolve_calibration)."""
    if name_or_path == "auto":
        name_or_path = auto_calibration(current_gpu_name())[0]
    path = Path(name_or_path)
    if not path.suffix:
        path = CALIBRATION_DIR / f"{name_or_path}.json"
    if not path.is_file():
        have = ", ".join(sorted(p.stem for p in CALIBRATION_DIR.glob("*.json")))
        raise FileNotFoundError(f"no calibration {name_or_path!r} ({path}); have: {have}; "
                                f"make one with `python -m bench.calibrate --out {path}` on that machine")
    return Calibration.from_dict(json.loads(path.read_text()))


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the cost model needs of a model: N (matmul params), bytes, attention width, KV per token."""

    n_matmul: int  # the N of ppo/metrics/flops.py (no embedding lookup; the LM head counts)
    n_params: int  # every parameter (memory)
    layers: int
    hidden: int
    attn_dim: int  # num_attention_heads * head_dim
    kv_bytes_per_token: int  # K and V of every layer: bf16, or fp8 values with their fp32 row scales
    vocab: int
    n_expert_params: int = 0  # a mixture of experts: the stacked expert tensors' parameters (within n_params)
    fp8_kv: bool = False  # the engine's KV cache is fp8 (kv_bytes_per_token counts its bytes)

    @classmethod
    def of(cls, cfg, *, value_head: bool = False, fp8_kv: bool = False) -> ModelShape:
        """From a models.config.ModelConfig; value_head: a critic/reward model (score head, no LM head); fp8_kv:
        the engine's KV cache holds fp8 values and one fp32 scale per (token, head) (rollout/kv_cache.py)."""
        lm_head = cfg.vocab_size * cfg.hidden_size
        head = cfg.hidden_size * max(1, cfg.num_labels) if value_head else lm_head
        n_matmul = cfg.matmul_params() - lm_head + head
        n_params = cfg.num_params(include_embedding=False) + cfg.vocab_size * cfg.hidden_size + head
        return cls(n_matmul=n_matmul, n_params=n_params, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                   attn_dim=cfg.num_attention_heads * cfg.head_dim,
                   kv_bytes_per_token=2 * cfg.num_hidden_layers * cfg.num_key_value_heads
                   * (cfg.head_dim + 4 if fp8_kv else cfg.head_dim * BF16),
                   vocab=cfg.vocab_size, n_expert_params=cfg.expert_params() if cfg.is_moe else 0, fp8_kv=fp8_kv)


@dataclass(frozen=True, slots=True)
class Workload:
    """One step's work, from the config (lengths: the config's maxima unless given)."""

    actor: ModelShape
    critic: ModelShape | None
    ref: ModelShape | None
    reward_model: ModelShape | None
    prompts: int
    n: int
    prompt_len: int
    response_len: int
    ppo_epochs: int = 1
    critic_epochs: int = 1
    share_prompts: bool = False
    # the share of the batch the old-log-prob forward runs over (ppo.roles.step_plan.old_logp_share): 0 where the
    # update's forward or the engine's log-probs serve, the later mini-batches' share where the first's serves
    old_logp_share: float = 1.0
    is_async: bool = False
    uses_gae: bool = True
    ac: dict = field(default_factory=dict)  # role -> activation checkpointing (none | full | selective)
    micro_batch_tokens: dict = field(default_factory=dict)  # role -> max tokens per micro-batch
    max_num_seqs: int = 256
    kv_memory_fraction: float = 0.5
    free_memory_on_sleep: bool | None = True  # None: resident when it fits (ppo.roles.generation.settle_residency)
    longest_prompt: int | None = None  # the engine's slot is this + response_len (default: prompt_len)
    offload_optimizer_while_generating: bool = False  # actor.offload_optimizer_while_generating
    frozen_bytes_per_param: int = FROZEN_BYTES_PER_PARAM
    offload_optimizer: tuple[str, ...] = ()  # roles whose Adam moments live in host memory (<role>.offload_optimizer)
    # actor.lora: the actor's adapter parameters (0: full-parameter training); its base is stored frozen and the
    # reference is that base with adapters off (no weights of its own)
    lora_params: int = 0
    ep: dict = field(default_factory=dict)  # role -> expert parallelism (<role>.ep; absent: 1)

    @property
    def samples(self) -> int:
        return self.prompts * self.n

    @property
    def slot_len(self) -> int:
        """Tokens of one KV-cache slot: the engine's max_model_len (ppo.roles.generation.sized_for_prompts)."""
        return (self.longest_prompt or self.prompt_len) + self.response_len

    def tokens(self, role: str) -> int:
        """Tokens a role's forward processes per step (shared prompts: each prompt once per group)."""
        if self.share_prompts and role in ("actor", "ref"):
            return self.prompts * (self.prompt_len + self.n * self.response_len)
        return self.samples * (self.prompt_len + self.response_len)

    def ctx_tokens(self, role: str) -> float:
        """Sum over processed tokens of the keys each attends to (causal), for the attention FLOPs."""
        p, r = self.prompt_len, self.response_len
        prompt = p * (p + 1) / 2
        response = r * p + r * (r + 1) / 2
        if self.share_prompts and role in ("actor", "ref"):
            return self.prompts * (prompt + self.n * response)
        return self.samples * (prompt + response)


def build_workload(cfg, *, model, reward_model=None, prompt_len: int | None = None,
                   response_len: int | None = None, is_async: bool | None = None) -> Workload:
    """Workload of a launcher.config.schema.Config; model/reward_model: models.config.ModelConfig."""
    from launcher.config.schema import uses_critic, uses_ref

    a = cfg.actor
    # the steady state of any K >= 1 is one batch generated per step beside the scoring of another
    is_async = cfg.trainer.max_staleness > 0 if is_async is None else is_async
    samples = cfg.data.batch_size * cfg.rollout.n
    ref = uses_ref(cfg)
    from ppo.algos.rollout_correction import resolve_mode

    correction = resolve_mode(cfg.algorithm.rollout_correction, max_staleness=int(is_async))
    source = old_logp_source(max_staleness=int(is_async), rollout_correction=correction, ppo_epochs=a.ppo_epochs,
                             mini_batch_size=a.mini_batch_size, samples=samples,
                             kl_penalty_with_ref=cfg.algorithm.use_kl_penalty and ref)
    data = data_prompt_lengths(cfg) if prompt_len is None else None
    rm, rm_micro_batch_tokens = None, 0
    if cfg.reward.model is not None:
        rm = ModelShape.of(reward_model or model, value_head=True)
        rm_micro_batch_tokens = cfg.reward.model.max_tokens_per_micro_batch
    from launcher.planning.fit import BUDGET_CAPS

    # an unset budget (launcher.planning.fit sizes it at launch) reads as the first the fit tries: its cap
    budgets = {r: BUDGET_CAPS[r] if v is None else v for r, v in (
        ("actor", a.max_tokens_per_micro_batch), ("critic", cfg.critic.max_tokens_per_micro_batch),
        ("ref", cfg.ref.max_tokens_per_micro_batch), ("reward", rm_micro_batch_tokens))}
    return Workload(
        actor=ModelShape.of(model, fp8_kv=cfg.rollout.kv_cache_dtype == "fp8"),
        critic=ModelShape.of(model, value_head=True) if uses_critic(cfg) else None,
        ref=ModelShape.of(model) if ref else None, reward_model=rm,
        prompts=cfg.data.batch_size, n=cfg.rollout.n,
        prompt_len=prompt_len or (data and data[0]) or synthetic_prompt_len(cfg) or cfg.data.max_prompt_length,
        longest_prompt=data and data[1],
        response_len=response_len or cfg.rollout.max_response_length,
        ppo_epochs=a.ppo_epochs, critic_epochs=cfg.critic.ppo_epochs,
        share_prompts=cfg.trainer.share_prompts and a.pp == 1 and cfg.ref.pp == 1,
        old_logp_share=old_logp_share(source, mini_batch_size=a.mini_batch_size, samples=samples),
        is_async=is_async, uses_gae=cfg.algorithm.name == "ppo",
        ac={"actor": a.activation_checkpointing, "critic": cfg.critic.activation_checkpointing},
        micro_batch_tokens=budgets,
        max_num_seqs=cfg.rollout.max_num_seqs, kv_memory_fraction=cfg.rollout.gpu_memory_fraction,
        free_memory_on_sleep=cfg.rollout.free_memory_on_sleep,
        offload_optimizer_while_generating=a.offload_optimizer_while_generating,
        frozen_bytes_per_param=FROZEN_BYTES_PER_PARAM if cfg.model.dtype == "float32" else BF16,
        offload_optimizer=tuple(r for r in ("actor", "critic") if getattr(cfg, r).offload_optimizer),
        lora_params=_lora_params(cfg, model),
        ep={r: getattr(cfg, r).ep for r in ("actor", "critic", "ref") if getattr(cfg, r).ep > 1})


def _lora_params(cfg, model) -> int:
    lo = cfg.actor.lora
    if lo.rank <= 0:
        return 0
    from models.lora import LoRASpec, adapter_param_count

    return adapter_param_count(model, LoRASpec(rank=lo.rank, alpha=lo.alpha, target_modules=tuple(lo.target_modules)))


def data_prompt_lengths(cfg) -> tuple[int, int] | None:
    """(mean, longest) prompt tokens of data.train_files and val_files under the run's tokenizer (prompts over
    data.max_prompt_length dropped, as the trainer drops them), or None without data files or when they cannot be
    read yet (the data loader reports that)."""
    d = cfg.data
    if not d.train_files:
        return None
    return _data_prompt_lengths(tuple(d.train_files), tuple(d.val_files), cfg.model.tokenizer, cfg.model.path,
                                d.prompt_key, d.answer_key, d.max_prompt_length)


@functools.lru_cache(maxsize=8)
def _data_prompt_lengths(train, val, tokenizer, model_path, prompt_key, answer_key, max_len):
    from ppo.data.prompts import DataError, PromptDataset
    from ppo.data.tokenizer import load_tokenizer, resolve_tokenizer

    try:
        tok = load_tokenizer(resolve_tokenizer(tokenizer, model_path))
        keys = dict(tokenizer=tok, prompt_key=prompt_key, answer_key=answer_key, max_prompt_length=max_len)
        sets = [PromptDataset.from_files(list(files), **keys) for files in (train, val) if files]
    except (DataError, OSError, ValueError):
        return None
    lengths = [len(r.prompt_ids) for r in sets[0].records]
    if not lengths:
        return None
    return round(sum(lengths) / len(lengths)), max(ds.longest_prompt for ds in sets)


def synthetic_prompt_len(cfg) -> int | None:
    """Mean prompt tokens of the built-in synthetic task under the char tokenizer (+1: BOS), else None
    (real data: the config's maximum is assumed). Responses are assumed to run to the maximum length."""
    if cfg.data.train_files or cfg.model.tokenizer != "builtin:char":
        return None
    from ppo.data.tasks import get_task

    try:
        rows = get_task(cfg.data.task).generate(64, seed=0)
    except ValueError:  # a bad task name is the data loader's error to report, not the planner's
        return None
    return min(cfg.data.max_prompt_length, round(sum(len(r["prompt"]) for r in rows) / len(rows)) + 1)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A placement: pools of GPUs (roles, size), a (tp, pp, dp) per role, the generation tp, sync/async."""

    mode: str  # colocated | split
    pools: tuple[tuple[tuple[str, ...], int], ...]
    layouts: tuple[tuple[str, tuple[int, int, int]], ...]  # role -> (tp, pp, dp)
    gen_tp: int
    is_async: bool

    def layout(self, role: str) -> tuple[int, int, int]:
        return dict(self.layouts)[role]

    def pool_of(self, role: str) -> int:
        return next(i for i, (roles, _) in enumerate(self.pools) if role in roles)

    @property
    def world_size(self) -> int:
        return sum(size for _, size in self.pools)

    def describe(self) -> str:
        pools = " | ".join(f"{'+'.join(r for r in roles if r != 'rollout')}:{n}" for roles, n in self.pools)
        lay = " ".join(f"{r}={t}x{p}x{d}" for r, (t, p, d) in self.layouts)
        return f"{self.mode}{'-async' if self.is_async else '-sync'} [{pools}] {lay} gen_tp={self.gen_tp}"


# ---------------------------------------------------------------------------- stage costs


def _link_bw(cal: Calibration, group_span: int) -> float:
    """Bus bandwidth of a collective over `group_span` consecutive ranks (inside a node or across)."""
    return cal.nccl_intra_bytes_per_s if group_span <= cal.gpus_per_node else cal.nccl_inter_bytes_per_s


def allreduce_s(cal: Calibration, nbytes: float, *, ranks: int, span: int) -> float:
    if ranks <= 1:
        return 0.0
    return cal.nccl_latency_s + 2 * (ranks - 1) / ranks * nbytes / _link_bw(cal, span)


def allgather_s(cal: Calibration, nbytes_total: float, *, ranks: int, span: int) -> float:
    if ranks <= 1:
        return 0.0
    return cal.nccl_latency_s + (ranks - 1) / ranks * nbytes_total / _link_bw(cal, span)


def decode_step_s(cal: Calibration, m: ModelShape, *, rows: int, ctx: float, tp: int) -> float:
    """One decode step of `rows` sequences with `ctx` cached positions each, on a TP group of `tp`."""
    weight_bytes = (m.n_params - m.vocab * m.hidden) * BF16 / tp  # the embedding table: B rows gathered
    flops = (2 * m.n_matmul + 4 * m.layers * m.attn_dim * ctx) * rows / tp
    gemm = max(weight_bytes / (cal.hbm_bytes_per_s * cal.decode_weight_bw_fraction),
               flops / (cal.peak_flops * cal.decode_gemm_fraction))
    kv_fraction = cal.decode_kv_fp8_bw_fraction if m.fp8_kv else cal.decode_kv_bw_fraction
    kv = rows * ctx * m.kv_bytes_per_token / tp / (cal.hbm_bytes_per_s * kv_fraction)
    comm = 2 * m.layers * allreduce_s(cal, rows * m.hidden * BF16, ranks=tp, span=tp)
    return gemm + kv + m.layers * cal.decode_layer_overhead_s + comm


def kv_slots(w: Workload, cal: Calibration, *, tp: int, static_gb: float) -> int:
    """Sequences one generation replica holds at once (rollout/model_runner.py's sizing)."""
    slot_len = w.slot_len
    free = max(0.0, cal.hbm_gb - static_gb) * 1e9
    tokens = int(free * w.kv_memory_fraction) // max(1, w.actor.kv_bytes_per_token // tp)
    return max(0, min(w.max_num_seqs, tokens // slot_len))


def generation_s(w: Workload, cal: Calibration, *, gen_tp: int, gen_dp: int, slots: int) -> float:
    """Wall time of generating the step's samples: waves of `slots` sequences per replica."""
    m = w.actor
    per_replica = math.ceil(w.samples / gen_dp)
    waves = math.ceil(per_replica / max(1, slots))
    rows = math.ceil(per_replica / waves)
    p, r = w.prompt_len, w.response_len
    prefill_flops = (2 * m.n_matmul * p + 4 * m.layers * m.attn_dim * p * (p + 1) / 2) * rows / gen_tp
    prefill = prefill_flops / (cal.peak_flops * cal.mfu_prefill)
    prefill += 2 * m.layers * allreduce_s(cal, rows * p * m.hidden * BF16, ranks=gen_tp, span=gen_tp)
    decode = (r - 1) * decode_step_s(cal, m, rows=rows, ctx=p + r / 2, tp=gen_tp)
    return waves * (prefill + decode)



def reshard_s(w: Workload, cal: Calibration, *, tp: int, pp: int, dp: int, gen_tp: int) -> float:
    """The training -> generation transition: the bytes each actor rank lacks for its generation shard
    (it holds 1/(tp pp dp) of the weights) and, with actor.offload_optimizer_while_generating, the optimizer
    states to the host and back over PCIe."""
    weights = w.actor.n_params * BF16
    lacking = max(0.0, weights / gen_tp - weights / (tp * pp * dp))
    span = tp * pp * dp
    rate = cal.reshard_bytes_per_s * (1.0 if span <= cal.gpus_per_node
                                      else cal.nccl_inter_bytes_per_s / cal.nccl_intra_bytes_per_s)
    offload = (2 * w.actor.n_params * OFFLOADED_BYTES_PER_PARAM / span / cal.pcie_bytes_per_s
               if w.offload_optimizer_while_generating else 0.0)
    return lacking / rate + offload


def _pipeline_factor(tokens_per_replica: float, mb_tokens: int, pp: int) -> float:
    """1F1B: (m + pp - 1) / m stage-times for m micro-batches (ppo/workers: at least 2 pp)."""
    if pp == 1:
        return 1.0
    m = max(2 * pp, math.ceil(tokens_per_replica / mb_tokens))
    return (m + pp - 1) / m


def model_pass_s(w: Workload, cal: Calibration, role: str, m: ModelShape, *, layout: tuple[int, int, int],
                 train: bool) -> float:
    """A forward (train=False) or an update (forward+backward+optimizer, every epoch) of one role."""
    tp, pp, dp = layout
    tokens = w.tokens(role)
    attention = 4 * m.layers * m.attn_dim * w.ctx_tokens(role)
    flops = 2 * m.n_matmul * tokens + attention
    epochs = 1
    if train:  # ppo.metrics.flops's update count (6N, or 4N + 6A through LoRA adapters), full AC one more forward
        epochs = w.ppo_epochs if role == "actor" else w.critic_epochs
        adapters = w.lora_params if role == "actor" else 0
        recompute = flops if w.ac.get(role) == "full" else 0.0
        flops = epochs * (update_matmul_flops(m.n_matmul, adapters) * tokens + 3 * attention + recompute)
    mfu = cal.mfu_update if train else cal.mfu_forward
    if dp > 1:
        mfu *= cal.dp_update_efficiency if train else cal.dp_forward_efficiency
    compute = flops / (tp * pp * dp) / (cal.peak_flops * mfu)
    mb = w.micro_batch_tokens.get(role, 16384)
    micro = max(1, math.ceil(tokens / dp / mb))
    if pp > 1:
        micro = max(2 * pp, micro)
        # stage-to-stage sends of each micro-batch's activations (and gradients back)
        sent = (2 if train else 1) * epochs * micro * allgather_s(cal, 2 * tokens / dp / micro * m.hidden * BF16,
                                                                  ranks=2, span=tp * pp)
        compute += sent
    # fixed cost per layer and micro-batch (launch gaps, small kernels: the decode benchmark's per-layer
    # overhead), which is what makes deep pipelines of small micro-batches slow
    compute += micro * (m.layers / pp) * cal.decode_layer_overhead_s * (3 if train else 1) * epochs
    compute *= _pipeline_factor(tokens / dp, mb, pp)
    # TP: two all-reduces of the activations per layer forward (four with backward), not overlapped
    per_layer = (4 if train else 2) * epochs
    tp_comm = per_layer * (m.layers / pp) * allreduce_s(cal, tokens / dp * m.hidden * BF16, ranks=tp, span=tp)
    # FSDP over dp: parameters gathered per micro-batch (twice with backward), gradients reduce-scattered;
    # overlapped with the layers' compute, so only what exceeds it costs time
    gathers = micro * (3 if train else 1) * epochs
    fsdp = gathers * allgather_s(cal, m.n_params * BF16 / (tp * pp), ranks=dp, span=tp * pp * dp)
    # offloaded moments visit the GPU at each optimizer step (taken as one per epoch), both directions
    # at once over full-duplex PCIe: one direction's bytes
    offload = (epochs * m.n_params * OFFLOADED_BYTES_PER_PARAM / (tp * pp * dp) / cal.pcie_bytes_per_s
               if train and role in w.offload_optimizer else 0.0)
    return max(compute, fsdp) + tp_comm + offload


def host_s(w: Workload, cal: Calibration, *, reward_gpus: int) -> dict[str, float]:
    out = {"adv": cal.host_gae_s_per_token * w.samples * w.response_len if w.uses_gae else 0.0}
    out["reward"] = 0.0 if w.reward_model else cal.host_rule_reward_s_per_sample * w.samples / max(1, reward_gpus)
    return out


def transfer_s(w: Workload, cal: Calibration, *, world: int) -> float:
    """Samples (token ids, behaviour log-probs) to every rank and per-token results back: bytes between pools."""
    tokens = w.samples * (w.prompt_len + w.response_len)
    per_token = 8 + 4 + 4 * (1 + bool(w.ref) + bool(w.critic))
    return allgather_s(cal, tokens * per_token, ranks=world, span=world)
