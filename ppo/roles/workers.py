"""Role workers' shared parallel plumbing (the policy and critic workers themselves: ppo/roles/actor_critic.py).

Each worker lives on the ranks of its role group, owns a parallelized model behind the
`parallel.runner.ModelRunner` interface (any TP x PP x DP layout, any backend: the workers
never branch on either), and works on its DP shard of the step's `Experience`, packed into
micro-batches by token budget. The same partition serves the old-log-prob recompute and
the first update epoch, so the PPO ratio is exactly 1 on-policy.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from models.document_attention import DocumentAttention
from parallel.backends import build_runner
from parallel.runner import MicroBatch, ModelRunner
from ppo.batch.experience import Experience
from ppo.batch.micro_batches import plan_micro_batches
from ppo.batch.packing import pack_prompt_responses, pack_routing
from ppo.batch.step_batch import DeviceRows, StepBatch
from ppo.settings import OptimizerSettings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class WorkerSpec:
    """What a worker needs to know about its placement (from the launcher's role handle)."""

    mesh: object  # DeviceMesh ("pp", "dp", "tp")
    dims: object  # ParallelDims
    device: torch.device
    dtype: torch.dtype
    expert_mesh: object = None  # DeviceMesh ("edp", "ep") of an expert-parallel layout (dims.ep > 1)
    ac: str = "none"
    compile: bool = False
    pp_microbatches: int = 0
    pp_schedule: str = "1F1B"
    stages_per_rank: int = 1
    share_prompts: bool = False  # pack a prompt once with its n responses (policy workers)
    # never trained (reference, reward model): stored in the compute dtype, with no fp32 master copy.
    # FSDP's mixed precision would cast the masters to that dtype for every forward anyway, so the
    # outputs are the same and half the bytes stay free (a 7B reference: 13.5 GB instead of 27 + 13.5)
    frozen: bool = False
    backend: str = "native"  # native | megatron (parallel/backends.py)
    # FSDP2 even at dp = 1 (an optimizer streamed from host memory streams FSDP's fp32 parameter shards); otherwise
    # mixed precision at dp = 1 is bf16 weights with fp32 main grads and masters (parallel/master_weights.py)
    fsdp_masters: bool = False
    lora: object = None  # models.lora.LoRASpec: adapters on the model, the base frozen (the actor's, native only)
    lora_seed: int = 0  # the adapters' A initialisation
    lora_init: dict | None = None  # full adapter tensors to start from (actor.lora.init_from's)
    # a mixture of experts: the forwards use the experts the rollout engine recorded (actor.router_replay)
    router_replay: bool = False


def _lr_lambda(*, warmup: int, total: int, schedule: str, min_ratio: float):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "cosine":
            t = min(1.0, (step - warmup) / max(1, total - warmup))
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
        return 1.0
    return f


def build_optimizer(runner: ModelRunner, optim: OptimizerSettings, *, total_steps: int):
    """The runner's (backend's) optimizer over its trainable parameters, and the LR schedule. With
    optim.stream_from_host (`<role>.offload_optimizer`) Adam's moments live in pinned host memory and stream
    through the GPU in each step."""
    opt = runner.build_optimizer(lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                                 stream_from_host=optim.stream_from_host)
    n = sum(p.numel() for g in opt.param_groups for p in g["params"])
    logging.getLogger("hybridrl").info("optimizer %s over %.3g parameters%s", type(opt).__name__, n,
                                       ": moments in host memory" if optim.stream_from_host else "")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(warmup=optim.warmup_steps, total=total_steps,
                                                              schedule=optim.lr_schedule,
                                                              min_ratio=optim.min_lr_ratio))
    return opt, sched


class ShardedWorker:
    """Common plumbing: coordinates in the group, DP sharding, micro-batching, packing, the update loop."""

    def __init__(self, model: nn.Module | None, spec: WorkerSpec, *, runner: ModelRunner | None = None):
        """runner: an existing runner to drive instead of building one of `model` (a LoRA actor's reference)."""
        self.spec = spec
        mesh, dims = spec.mesh, spec.dims
        self.pp_idx, self.dp_idx, self.tp_idx = mesh.get_coordinate()
        self.dp, self.tp = dims.dp, dims.tp
        self.dp_group = mesh.get_group("dp")
        self.tp_group = mesh.get_group("tp")
        self.device = spec.device
        param_dtype = spec.dtype if spec.dtype != torch.float32 else None
        self.runner: ModelRunner = runner or build_runner(
            # dynamic=None: the second packed length recompiles once, making only the changed dims dynamic.
            # dynamic=True (shape-generic from the start, no recompile) measured 9% slower updates on an
            # H200 (bench/results/grpo_a_dynamic_h200.json), so a warm-up step pays the recompile instead.
            model, backend=spec.backend, mesh=mesh, dims=dims, ac=spec.ac, compile=spec.compile, dynamic=None,
            param_dtype=param_dtype, frozen=spec.frozen,
            n_microbatches=spec.pp_microbatches or 2 * dims.pp,
            pp_schedule={"1F1B": "1f1b", "interleaved": "interleaved_1f1b"}[spec.pp_schedule],
            stages_per_rank=spec.stages_per_rank, attn_factory=DocumentAttention,
            fsdp=True if spec.fsdp_masters else None, lora=spec.lora, lora_seed=spec.lora_seed,
            expert_mesh=spec.expert_mesh)
        if runner is None and spec.lora_init is not None:
            from parallel.lora import load_adapters

            load_adapters(self.runner, spec.lora_init)
        self.share_prompts = spec.share_prompts
        self.router_replay = spec.router_replay
        # a given runner (a LoRA actor's reference) drives a dense model: LoRA on a mixture of experts is refused
        self.moe = model is not None and bool(getattr(model.config, "is_moe", False))
        self.grad_clip = 1.0
        self.optimizer = self.scheduler = None
        self.optimizer_steps_in_update = 0  # an OOM retry of an update is safe only before its first step
        # the last update's optimizer steps skipped for a non-finite gradient norm (the same on every rank of the
        # model's groups: the norm is reduced over them) and the first non-finite quantity this rank saw, or None
        self.nonfinite_skipped = 0
        self.first_nonfinite: str | None = None

    @property
    def is_owner(self) -> bool:
        """The rank that reports this DP shard's results: tp rank 0 of the last pipeline stage."""
        return self.tp_idx == 0 and self.runner.has_last

    def parameters(self):
        return self.runner.parameters()

    def plan(self, exp: Experience, *, mini_batch_size: int, max_tokens: int) -> list[list[list[int]]]:
        """This DP rank's mini-batches, each a list of micro-batches (indices into exp.samples).

        ppo.batch.micro_batches.plan_micro_batches over the samples (or, sharing prompts, each prompt's run of
        samples), with exactly the runner's micro-batch count when its schedule fixes one
        (`runner.microbatches`, a pipeline's). The same plan serves the old-log-prob recompute and
        the update (ratio == 1 on-policy).
        """
        key = ("plan", self.share_prompts, self.dp, self.dp_idx, mini_batch_size, max_tokens, self.runner.microbatches)
        return exp.derive(key, lambda: self._plan(exp, mini_batch_size=mini_batch_size, max_tokens=max_tokens))

    def _plan(self, exp: Experience, *, mini_batch_size: int, max_tokens: int) -> list[list[list[int]]]:
        # the units planned: samples, or (shared prompts) each prompt's run of samples, costed at the
        # tokens it packs to (prompt once + every response)
        units, lengths = exp.prompt_units() if self.share_prompts else ([], [])
        if len(units) % self.dp or not units:  # not sharing, or uneven groups: plan samples (share within)
            units, lengths = [[i] for i in range(len(exp.samples))], [s.length for s in exp.samples]
        per_unit = len(exp.samples) // len(units)
        out = plan_micro_batches(lengths, dp=self.dp, rank=self.dp_idx, max_tokens=max_tokens,
                                 mini_batch_size=mini_batch_size // per_unit if mini_batch_size else 0,
                                 fixed_count=self.runner.microbatches)
        # units -> sample indices (a unit's samples stay adjacent, so the packer can share their prompt)
        return [[[i for u in mb for i in units[u]] for mb in mini] for mini in out]

    def _pack(self, exp: Experience, mb: list[int], pad_id: int):
        """One micro-batch packed, once per step for every pass that plans it alike (the reference's
        forward and the update, when their token budgets match)."""
        def make():
            samples = [exp.samples[i] for i in mb]
            return pack_prompt_responses([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                         pad_id=pad_id, device=self.device, share_prompts=self.share_prompts)

        return exp.derive(("pack", tuple(mb), pad_id, self.share_prompts, str(self.device)), make)

    def _packs(self, exp: Experience, mbs: list[list[int]], pad_id: int):
        """Packed micro-batches of one mini-batch and their runner inputs, both packed on first access:
        a runner that walks the micro-batches in order packs k + 1 while the GPU still runs k (one that
        needs every shape up front, like the pipeline schedule, simply packs them all first)."""
        packs = LazyList(len(mbs), lambda k: self._pack(exp, mbs[k], pad_id))
        return packs, LazyList(len(mbs), lambda k: MicroBatch(
            packs[k].input_ids, packs[k].position_ids, packs[k].layout, routing=self._routing(exp, mbs[k], packs[k]),
            replay=self.router_replay))

    def _routing(self, exp: Experience, mb: list[int], packed) -> torch.Tensor | None:
        """A mixture of experts' recorded experts at each packed position (ppo.batch.packing.pack_routing), when
        the engine recorded them for every sample of the micro-batch; None otherwise (and for dense models)."""
        if not self.moe:
            return None
        samples = [exp.samples[i] for i in mb]
        if any(s.routed_experts is None for s in samples):
            return None
        return exp.derive(("routing", tuple(mb), self.share_prompts, str(self.device)), lambda: pack_routing(
            [s.prompt_ids for s in samples], [s.routed_experts for s in samples], num_tokens=packed.num_tokens,
            share_prompts=self.share_prompts, device=self.device))

    def _enqueue_forwards(self, exp: Experience, plan: list[list[list[int]]], pad_id: int,
                          reduce) -> list[tuple[list[int], object]]:
        """The no-grad forwards of every mini-batch in `plan`, enqueued: (micro-batch sample indices,
        reduce(packed, hidden) on the device) of each micro-batch, on the ranks of the last pipeline stage
        (every TP rank; empty elsewhere). Only owners report them (`reported`)."""
        outputs = []
        for mini in plan:
            packs, batches = self._packs(exp, mini, pad_id)
            results = self.runner.forward(batches, reduce=lambda h, k, packs=packs: reduce(packs[k], h))
            if results is not None:
                outputs.extend(zip(mini, results))
        return outputs

    def reported(self, outputs: list) -> list:
        """What this rank reports of a pass's outputs: all of them on the DP shard's owner, none elsewhere
        (so that each sample's result is merged exactly once)."""
        return outputs if self.is_owner else []

    def _global_denominator(self, mask: torch.Tensor, agg: str = "token-mean") -> float:
        """Token (token-mean) or sequence (seq-mean-*) count of the mini-batch over all DP ranks,
        divided by dp because FSDP averages gradients over dp: summed micro-batch losses then equal
        the global loss."""
        from ppo.algos.core_algos import agg_count

        n = float(agg_count(mask, agg))  # the mask is on the host: no device round trip (two syncs) at dp = 1
        if self.dp > 1:
            total = torch.tensor([n], device=self.device if self.device.type == "cuda" else "cpu")
            dist.all_reduce(total, group=self.dp_group)
            n = float(total)
        return max(n / self.dp, 1.0)

    def _train(self, exp: Experience, plan: list[list[list[int]]], batch: StepBatch, *,
               epochs: int, pad_id: int, mb_loss, agg: str = "token-mean") -> dict[str, float]:
        """Epochs x mini-batches (one optimizer step each) x micro-batches (gradient accumulation).

        mb_loss(packed, hidden [1, T, H], mb_batch (the micro-batch's rows of `batch`, [B_k, R] on the device),
        denom) -> (loss, metrics); denom is the mini-batch's global count of batch.mask that `agg` normalises by
        (tokens or sequences). Returns the metrics averaged over micro-batches (LOSS_TERMS: summed per optimizer
        step, see _loss_terms; keys ending in _max / _min:
        their max / min; router_mismatch over the micro-batches before the first optimizer step, where the policy
        is still the one that generated) and grad_norm (meaningful on owner ranks)."""
        sums: dict[str, float] = {}
        count = unmoved = 0
        self.optimizer_steps_in_update = self.nonfinite_skipped = 0
        self.first_nonfinite = None
        for _ in range(epochs):
            for mbs in plan:
                with record_function("phase:prepare"):
                    packs, batches = self._packs(exp, mbs, pad_id)
                    # every micro-batch's [B_k, R] rows queued for the device now, one pinned copy each (no sync)
                    mbts = [batch.rows(mb, self.device) for mb in mbs]
                    denom = self._global_denominator(batch.mask[[i for mb in mbs for i in mb]], agg)
                    self.optimizer.zero_grad(set_to_none=True)

                def loss_fn(hidden, k, packs=packs, mbts=mbts, denom=denom):
                    return mb_loss(packs[k], hidden, mbts[k], denom)

                metrics_list = metric_floats(self.runner.forward_backward(batches, loss_fn=loss_fn))
                for m in metrics_list:
                    if self.optimizer_steps_in_update:  # the engine's routing is compared with its own policy's only
                        m = {k2: v for k2, v in m.items() if k2 != "router_mismatch"}
                    for k2, v in m.items():
                        sums[k2] = _reduce_metric(k2, sums.get(k2), float(v))
                    count += 1
                    unmoved += "router_mismatch" in m
                t = time.perf_counter()
                with record_function("phase:optimizer"):  # a step profile's phase (ppo/metrics/profiling.py)
                    grad_norm = self.runner.optimizer_step(self.optimizer, max_norm=self.grad_clip)
                if not math.isfinite(grad_norm):  # the runner did not step (every rank of the model alike)
                    self.nonfinite_skipped += 1
                    if self.first_nonfinite is None:
                        self.first_nonfinite = _first_nonfinite(metrics_list, grad_norm,
                                                                optimizer_step=self.optimizer_steps_in_update + 1)
                if self.device.type == "cuda":  # the step's kernels (and an offloaded optimizer's copies) are done
                    torch.cuda.synchronize(self.device)
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + grad_norm * len(metrics_list)
                # clip + step, seconds per optimizer step (weighted like the other metrics)
                sums["optimizer_step_s"] = sums.get("optimizer_step_s", 0.0) + (time.perf_counter() - t) * len(
                    metrics_list)
                self.optimizer_steps_in_update += 1
        out = {k: v if k.endswith(("_max", "_min")) else v / max(count, 1) for k, v in sums.items()}
        if "router_mismatch" in sums:
            out["router_mismatch"] = sums["router_mismatch"] / unmoved
        out.update(self._loss_terms(sums))
        return out

    def _loss_terms(self, sums: dict[str, float]) -> dict[str, float]:
        """The loss metrics (LOSS_TERMS) of an update: a micro-batch's is its share of the mini-batch's loss (over
        the global denominator), so the shares are summed per optimizer step, averaged over the optimizer steps
        and over the DP ranks (each rank's sum is the loss of its own samples scaled to the mini-batch): the
        same figure at any micro-batch count and layout (one all-reduce of a few floats per update)."""
        keys = [k for k in LOSS_TERMS if k in sums]
        if not keys:
            return {}
        vals = torch.tensor([sums[k] / max(self.optimizer_steps_in_update, 1) for k in keys], dtype=torch.float64)
        if self.dp > 1:
            vals = vals.to(self.device if self.device.type == "cuda" else "cpu")
            dist.all_reduce(vals, group=self.dp_group)
            vals = vals.cpu() / self.dp
        return dict(zip(keys, vals.tolist(), strict=True))


def _first_nonfinite(metrics_list: list[dict], grad_norm: float, *, optimizer_step: int) -> str:
    """The first non-finite quantity of a skipped optimizer step: a micro-batch's loss (on the last pipeline
    stage), else the gradient norm."""
    for k, m in enumerate(metrics_list):
        for key, v in m.items():
            if key.endswith("loss") and not math.isfinite(float(v)):
                return f"{key}={float(v)} in micro-batch {k + 1} of optimizer step {optimizer_step}"
    return f"grad_norm={grad_norm} in optimizer step {optimizer_step}"


# micro-batch metrics that are shares of the mini-batch's loss (normalised by its global denominator): summed per
# optimizer step, not averaged over micro-batches (Worker._loss_terms)
LOSS_TERMS = ("pg_loss", "kl_loss", "vf_loss")


def metric_floats(metrics_list: list[dict]) -> list[dict[str, float]]:
    """Micro-batch metrics (floats or 0-d device tensors, left unsynchronised by the losses) as floats, read
    through one copy per device (one sync), not one per value: after it the host launches the optimizer step
    and the next mini-batch onto an idle device, so every extra round trip there is idle GPU time."""
    by_device: dict[torch.device, list[tuple[int, str, torch.Tensor]]] = {}
    for j, m in enumerate(metrics_list):
        for k, v in m.items():
            if isinstance(v, torch.Tensor):
                by_device.setdefault(v.device, []).append((j, k, v))
    out = [{k: v for k, v in m.items() if not isinstance(v, torch.Tensor)} for m in metrics_list]
    for items in by_device.values():
        flat = torch.stack([v.detach().reshape(()).to(torch.float64) for _, _, v in items]).tolist()
        for (j, k, _), x in zip(items, flat, strict=True):
            out[j][k] = x
    return [{k: out[j][k] for k in m} for j, m in enumerate(metrics_list)]  # each dict in its own key order


def _reduce_metric(key: str, acc: float | None, v: float) -> float:
    """Running reduction of one micro-batch metric: max / min for *_max / *_min, else a sum."""
    if acc is None:
        return v
    if key.endswith("_max"):
        return max(acc, v)
    if key.endswith("_min"):
        return min(acc, v)
    return acc + v


class LazyList(Sequence):
    """n items, item k built by make(k) on first access and kept."""

    def __init__(self, n: int, make):
        self._items, self._make = [None] * n, make

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, k: int):
        if self._items[k] is None:
            self._items[k] = self._make(k)
        return self._items[k]


class PendingResults:
    """A scoring pass whose forwards are enqueued on the device: result() waits for them (once) and returns
    their per-sample host tensors. logp_rows: a policy's log-probs as they are on the device, on the ranks
    that computed them (DeviceRows), for an update on the same ranks to read without the wait."""

    def __init__(self, finish, *, logp_rows: DeviceRows | None = None):
        self._finish, self._value = finish, None
        self.logp_rows = logp_rows

    def result(self) -> dict[str, dict[int, torch.Tensor]]:
        if self._finish is not None:
            self._value, self._finish = self._finish(), None
        return self._value


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Device tensors -> fp32 CPU copies of the same shapes, through one concatenated copy (one sync)."""
    flat = torch.cat([t.float().reshape(-1) for t in tensors]).cpu()
    return [x.view(t.shape) for x, t in zip(torch.split(flat, [t.numel() for t in tensors]), tensors)]


def model_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def export_hf(worker, path, *, architecture: str) -> bool:
    """Write the worker's whole model as a Hugging Face directory at `path` (transformers loads it;
    a critic saves as a 1-label *ForSequenceClassification: trunk + value head). Collective over the
    worker's group, any layout; the group's exporter rank writes. Returns whether this rank wrote."""
    from models.hf_io import save_tensors

    sd = worker.runner.export_state_dict()
    if sd is None:
        return False
    save_tensors(sd, worker.runner.model_config, path, architecture=architecture)
    return True


def export_peft_adapter(worker, path, *, base_model: str | None) -> bool:
    """Write a LoRA worker's adapters as a PEFT adapter directory at `path` (adapter_config.json +
    adapter_model.safetensors: `peft.PeftModel.from_pretrained(base, path)` loads it). Collective over the
    worker's group; the exporter rank writes. Returns whether this rank wrote."""
    from models.lora import save_peft_adapter

    sd = worker.runner.adapter_state_dict()
    if sd is None:
        return False
    save_peft_adapter(sd, worker.spec.lora, path, base_model=base_model)
    return True
