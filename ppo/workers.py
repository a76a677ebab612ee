"""Role workers: a policy (actor or reference), a critic, and their shared parallel plumbing.

Each worker lives on the ranks of its role group, owns a parallelized model (TP x PP x DP
from parallel/), and works on its DP shard of the step's `Experience`, packed into
micro-batches by token budget. The same partition serves the old-log-prob recompute and
the first update epoch, so the PPO ratio is exactly 1 on-policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from models.llama import DocumentAttention
from models.logprobs import compute_token_logprobs
from parallel.apply import forward_hidden, head_shard, parallelize_model
from parallel.fsdp import gradients_synced
from parallel.vocab_parallel import vocab_parallel_token_logprobs
from ppo.batching import (
    balance_across_dp,
    gather_response_logprobs,
    micro_batches_by_tokens,
    pack,
    unpack_responses,
)
from ppo.experience import Experience, Sample

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class WorkerSpec:
    """What a worker needs to know about its placement (from the launcher's role handle)."""

    mesh: object  # DeviceMesh ("pp", "dp", "tp")
    dims: object  # ParallelDims
    device: torch.device
    dtype: torch.dtype
    ac: str = "none"
    compile: bool = False
    pp_microbatches: int = 0
    pp_schedule: str = "1F1B"
    stages_per_rank: int = 1
    share_prompts: bool = False  # pack a prompt once with its n responses (pp=1 policy workers)


def _lr_lambda(*, warmup: int, total: int, schedule: str, min_ratio: float):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "cosine":
            t = min(1.0, (step - warmup) / max(1, total - warmup))
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
        return 1.0
    return f


def build_optimizer(params, optim, *, total_steps: int, device: torch.device):
    opt = torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                            fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(warmup=optim.warmup_steps, total=total_steps,
                                                              schedule=optim.lr_schedule,
                                                              min_ratio=optim.min_lr_ratio))
    return opt, sched


class ShardedWorker:
    """Common plumbing: coordinates in the group, DP sharding, micro-batching, packing."""

    def __init__(self, model: nn.Module, spec: WorkerSpec):
        self.spec = spec
        mesh, dims = spec.mesh, spec.dims
        self.pp_idx, self.dp_idx, self.tp_idx = mesh.get_coordinate()
        self.dp, self.tp, self.pp = dims.dp, dims.tp, dims.pp
        self.dp_group = mesh.get_group("dp")
        self.tp_group = mesh.get_group("tp")
        self.pp_group = mesh.get_group("pp")
        self.device = spec.device
        param_dtype = spec.dtype if spec.dtype != torch.float32 else None
        n_mb = spec.pp_microbatches or 2 * dims.pp
        self.model = parallelize_model(
            # dynamic=None: the second packed length recompiles once, making only the changed dims dynamic.
            # dynamic=True (shape-generic from the start, no recompile) measured 9% slower updates on an
            # H200 (bench/results/grpo_a_dynamic_h200.json), so a warm-up step pays the recompile instead.
            model, mesh=mesh, dims=dims, ac=spec.ac, compile=spec.compile, dynamic=None, param_dtype=param_dtype,
            n_microbatches=n_mb if dims.pp > 1 else None,
            pp_schedule={"1F1B": "1f1b", "interleaved": "interleaved_1f1b"}[spec.pp_schedule],
            stages_per_rank=spec.stages_per_rank, attn_factory=DocumentAttention)
        self.n_microbatches = n_mb
        self.share_prompts = spec.share_prompts and dims.pp == 1
        self.grad_clip = 1.0
        self.optimizer_steps_in_update = 0  # an OOM retry of an update is safe only before its first step

    @property
    def is_owner(self) -> bool:
        """The rank that reports this DP shard's results: tp rank 0 of the last pipeline stage."""
        return self.tp_idx == 0 and self.pp_idx == self.pp - 1

    def parameters(self):
        mods = self.model.modules if self.pp > 1 else [self.model]
        return [p for m in mods for p in m.parameters() if p.requires_grad]

    def plan(self, exp: Experience, *, mini_batch_size: int, max_tokens: int) -> list[list[list[int]]]:
        """This DP rank's mini-batches, each a list of micro-batches (indices into exp.samples).

        Every rank holds the whole batch and computes every rank's partition (pure, deterministic),
        so all DP ranks agree on the number of micro-batches of each mini-batch: FSDP runs
        collectives per micro-batch and unequal counts would hang. Balanced tokens per rank
        (Karmarkar-Karp), token-budget micro-batches, or exactly n_microbatches rows under PP.
        The same plan serves the old-log-prob recompute and the update (ratio == 1 on-policy).
        """
        # the units planned: samples, or (shared prompts) each prompt's run of samples, costed at the
        # tokens it packs to (prompt once + every response)
        units, lengths = exp.prompt_units() if self.share_prompts else ([], [])
        if len(units) % self.dp or not units:  # not sharing, or uneven groups: plan samples (share within)
            units, lengths = [[i] for i in range(len(exp.samples))], [s.length for s in exp.samples]
        if len(lengths) % self.dp:
            raise ValueError(f"{len(lengths)} samples do not split evenly over dp={self.dp}")
        per_unit = len(exp.samples) // len(units)
        mini_batch_size = mini_batch_size // per_unit if mini_batch_size else 0
        shards = balance_across_dp(lengths, self.dp, equal_size=True)
        per_rank = max(1, mini_batch_size // self.dp) if mini_batch_size else len(shards[0])
        out = []
        for start in range(0, len(shards[0]), per_rank):
            minis = [s[start:start + per_rank] for s in shards]
            if self.pp > 1:  # the pipeline schedule wants exactly n_microbatches rows
                from ppo.batching import karmarkar_karp

                if len(minis[0]) < self.n_microbatches:
                    raise ValueError(f"a mini-batch of {len(minis[0])} samples per DP rank cannot fill "
                                     f"{self.n_microbatches} pipeline micro-batches; raise the mini-batch size")
                mine = minis[self.dp_idx]
                parts = karmarkar_karp([lengths[i] for i in mine], self.n_microbatches)
                out.append([[mine[j] for j in p] for p in parts])
                continue
            count = max(len(micro_batches_by_tokens([lengths[i] for i in m], max_tokens=max_tokens)) for m in minis)
            mine = minis[self.dp_idx]
            mbs = micro_batches_by_tokens([lengths[i] for i in mine], max_tokens=max_tokens, min_count=count)
            out.append([[mine[j] for j in mb] for mb in mbs])
        # units -> sample indices (a unit's samples stay adjacent, so the packer can share their prompt)
        return [[[i for u in mb for i in units[u]] for mb in mini] for mini in out]

    def _pack(self, samples: list[Sample], pad_id: int):
        seqs = [s.prompt_ids + s.response_ids for s in samples]
        return pack(seqs, pad_id=pad_id, prompt_lens=[len(s.prompt_ids) for s in samples], device=self.device,
                    share_prompts=self.share_prompts)

    def _pack_rows(self, groups: list[list[Sample]], pad_id: int):
        """Pipeline input: one packed row per micro-batch, padded to a common length -> [k, T]."""
        packs = [self._pack(g, pad_id) for g in groups]
        t = max(p.num_tokens for p in packs)
        ids, pos = [], []
        for p in packs:
            extra = t - p.num_tokens
            ids.append(torch.cat([p.input_ids[0], torch.full((extra,), pad_id, device=self.device)]))
            pos.append(torch.cat([p.position_ids[0], torch.arange(extra, device=self.device)]))
        return packs, torch.stack(ids), torch.stack(pos)


    def _global_denominator(self, mask: torch.Tensor, agg: str = "token-mean") -> float:
        """Token (token-mean) or sequence (seq-mean-*) count of the mini-batch over all DP ranks,
        divided by dp because FSDP averages gradients over dp: summed micro-batch losses then equal
        the global loss."""
        from ppo.core_algos import agg_count

        n = torch.tensor([float(agg_count(mask, agg))], device=self.device if self.device.type == "cuda" else "cpu")
        if self.dp > 1:
            dist.all_reduce(n, group=self.dp_group)
        return max(float(n) / self.dp, 1.0)

    def _clip(self) -> float:
        """Global grad-norm clipping: DTensor norms reduce over dp/tp, pipeline stages all-reduce."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        # DTensor grads (TP/FSDP) and plain ones (e.g. an unsharded value head) cannot share one
        # foreach norm: take each kind's norm, then combine
        parts = []
        for kind in (True, False):
            group = [g for g in grads if hasattr(g, "full_tensor") == kind]
            if group:
                n = torch.nn.utils.get_total_norm(group)
                parts.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
        norm = torch.stack([p.float() for p in parts]).square().sum().sqrt()
        if self.pp > 1:
            sq = norm.float() ** 2
            dist.all_reduce(sq, group=self.pp_group)
            norm = sq.sqrt()
        norm = float(norm)
        coef = self.grad_clip / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm



class PolicyWorker(ShardedWorker):
    """Actor (trainable) or reference (frozen) policy: log-probs of responses, PPO updates."""

    def __init__(self, model: nn.Module, spec: WorkerSpec, *, temperature: float, pad_id: int,
                 trainable: bool, optim=None, total_steps: int = 1):
        super().__init__(model, spec)
        self.temperature = temperature if temperature > 0 else 1.0
        self.pad_id = pad_id
        self.trainable = trainable
        self.optimizer = self.scheduler = None
        if trainable:
            self.grad_clip = optim.grad_clip
            self.optimizer, self.scheduler = build_optimizer(self.parameters(), optim, total_steps=total_steps,
                                                             device=self.device)
        else:
            for p in self.parameters():
                p.requires_grad_(False)

    # -- log-probs of one packed micro-batch: hidden states -> chunked (vocab-parallel) log-probs
    def _token_logprobs(self, model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, *, with_entropy: bool):
        w, vocab_start = _head(model)
        if self.tp > 1:
            return vocab_parallel_token_logprobs(hidden, w, labels, tp_group=self.tp_group, vocab_start=vocab_start,
                                                 temperature=self.temperature, with_entropy=with_entropy)
        return compute_token_logprobs(hidden, w.to(hidden.dtype), labels, temperature=self.temperature,
                                      with_entropy=with_entropy)

    def _mb_logprobs(self, packed, *, with_entropy: bool):
        """[B, R] log-probs (and entropies) of one packed micro-batch; the LM head runs on the response
        tokens' predicting positions only (never on prompt tokens)."""
        hidden = forward_hidden(self.model, packed.input_ids, packed.position_ids,
                                attn=DocumentAttention(packed.position_ids))
        return gather_response_logprobs(hidden[0], packed, lambda h, labels: self._token_logprobs(
            self.model, h, labels, with_entropy=with_entropy))

    def _pp_logprobs(self, groups: list[list[Sample]], *, with_entropy: bool):
        """One pipeline pass over n_microbatches packed rows -> [(logp [B_k, R], ent)] on the last stage."""
        packs, ids, pos = self._pack_rows(groups, self.pad_id)
        hidden = self.model.forward(ids if self.model.has_first else None, position_ids=pos)
        if hidden is None:
            return None
        out = []
        for k, p in enumerate(packs):
            logp, ent = self._token_logprobs(self.model.last_module, hidden[k, : p.num_tokens], p.labels[0],
                                             with_entropy=with_entropy)
            out.append((unpack_responses(logp[None], p),
                        unpack_responses(ent[None], p) if ent is not None else None))
        return out

    @torch.no_grad()
    def compute_logprobs(self, exp: Experience, plan: list[list[list[int]]], *,
                         with_entropy: bool = False) -> dict[str, dict[int, torch.Tensor]]:
        """{"logp": {uid: [R_i]}, "entropy": {uid: [R_i]}} for this rank's shard (owners only report).
        Uses the same mini-batch -> micro-batch partition as `update`, so the ratio is 1 on-policy."""
        out: dict[str, dict[int, torch.Tensor]] = {"logp": {}, "entropy": {}}
        for mini in plan:
            groups = [[exp.samples[i] for i in mb] for mb in mini]
            if self.pp > 1:
                results = self._pp_logprobs(groups, with_entropy=with_entropy)
            else:
                results = [self._mb_logprobs(self._pack(g, self.pad_id), with_entropy=with_entropy) for g in groups]
            if not self.is_owner or results is None:
                continue
            for g, (logp, ent) in zip(groups, results):
                logp = logp.float().cpu()  # one device->host copy per micro-batch, then split on the host
                ent = ent.float().cpu() if ent is not None else None
                for j, s in enumerate(g):
                    n = len(s.response_ids)
                    out["logp"][s.uid] = logp[j, :n]
                    if ent is not None:
                        out["entropy"][s.uid] = ent[j, :n]
        return out

    # -- PPO update
    def update(self, exp: Experience, plan: list[list[list[int]]], tensors: dict[str, torch.Tensor], *,
               epochs: int, loss_fn, step_scheduler: bool = True, agg: str = "token-mean") -> dict[str, float]:
        """PPO epochs over this rank's mini-batches.

        tensors: response-aligned [B, R] CPU tensors (old_logp, advantages, mask, + ref_logp for a
        KL loss). loss_fn(logp, entropy|None, mb_tensors, denom) -> (loss, metrics); denom is the
        global count `agg` normalises by. Returns the metrics averaged over micro-batches (keys ending
        in _max / _min: their max / min), grad_norm and lr (meaningful on owner ranks)."""
        need_ent = getattr(loss_fn, "needs_entropy", False)
        sums: dict[str, float] = {}
        count = 0
        self.optimizer_steps_in_update = 0
        for _ in range(epochs):
            for mbs in plan:
                groups = [[exp.samples[i] for i in mb] for mb in mbs]
                mbts = [{k: v[mb] for k, v in tensors.items()} for mb in mbs]
                denom = self._global_denominator(tensors["mask"][[i for mb in mbs for i in mb]], agg)
                self.optimizer.zero_grad(set_to_none=True)
                if self.pp > 1:
                    metrics_list = self._pp_update(groups, mbts, denom, loss_fn, need_ent)
                else:
                    metrics_list = []
                    for k, (g, mbt) in enumerate(zip(groups, mbts)):
                        gradients_synced(self.model, k == len(groups) - 1)  # reduce-scatter once per mini-batch
                        logp, ent = self._mb_logprobs(self._pack(g, self.pad_id), with_entropy=need_ent)
                        loss, metrics = loss_fn(logp, ent, _to(mbt, self.device, logp.shape[1]), denom)
                        loss.backward()
                        metrics_list.append(metrics)
                for m in metrics_list:
                    for k2, v in m.items():
                        sums[k2] = _reduce_metric(k2, sums.get(k2), float(v))
                    count += 1
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + self._clip() * len(metrics_list)
                self.optimizer.step()
                self.optimizer_steps_in_update += 1
        if step_scheduler:
            self.scheduler.step()
        out = {k: v if k.endswith(("_max", "_min")) else v / max(count, 1) for k, v in sums.items()}
        out["lr"] = self.optimizer.param_groups[0]["lr"]
        return out

    def _pp_update(self, groups, mbts, denom, loss_fn, need_ent) -> list[dict]:
        packs, ids, pos = self._pack_rows(groups, self.pad_id)

        def pp_loss(hidden_mb, extras):
            p = packs[extras["mb_index"]]
            logp, ent = self._token_logprobs(self.model.last_module, hidden_mb[0, : p.num_tokens], p.labels[0],
                                             with_entropy=need_ent)
            logp = unpack_responses(logp[None], p)
            ent = unpack_responses(ent[None], p) if ent is not None else None
            return loss_fn(logp, ent, _to(mbts[extras["mb_index"]], self.device, logp.shape[1]), denom)

        self.model.forward_backward(ids if self.model.has_first else None, loss_fn=pp_loss, position_ids=pos)
        return [m for m in self.model.last_metrics if m] if self.model.has_last else []



def _reduce_metric(key: str, acc: float | None, v: float) -> float:
    """Running reduction of one micro-batch metric: max / min for *_max / *_min, else a sum."""
    if acc is None:
        return v
    if key.endswith("_max"):
        return max(acc, v)
    if key.endswith("_min"):
        return min(acc, v)
    return acc + v


def _head(model: nn.Module) -> tuple[torch.Tensor, int]:
    """(this rank's [V/tp, H] head weight, its vocab start). A pipeline stage's head is used outside
    the stage's forward, so FSDP may hold it sharded over dp: gather those dims differentiably
    (all-gather forward, reduce-scatter backward into the sharded parameter's gradient)."""
    from torch.distributed.tensor import DTensor, Replicate

    w = model.lm_head.weight
    if isinstance(w, DTensor):
        names = w.device_mesh.mesh_dim_names or ()
        if any(n != "tp" and w.device_mesh.size(i) > 1 and not isinstance(p, Replicate)
               for i, (n, p) in enumerate(zip(names, w.placements))):
            placements = [p if n == "tp" else Replicate() for n, p in zip(names, w.placements)]
            w = w.redistribute(w.device_mesh, placements)
            from parallel.loading import local_slices

            return w.to_local(), local_slices(w)[0].start or 0
    return head_shard(model)


def _to(tensors: dict[str, torch.Tensor], device: torch.device, width: int) -> dict[str, torch.Tensor]:
    """Response-aligned [B, R_max] CPU tensors -> [B, width] on the device (width = longest response)."""
    return {k: v[:, :width].to(device) for k, v in tensors.items()}


class CriticWorker(ShardedWorker):
    """Value model: per-token values of responses and clipped value-loss updates."""

    def __init__(self, model: nn.Module, spec: WorkerSpec, *, pad_id: int, optim, total_steps: int):
        super().__init__(model, spec)
        self.pad_id = pad_id
        self.optimizer, self.scheduler = build_optimizer(self.parameters(), optim, total_steps=total_steps,
                                                         device=self.device)
        self.grad_clip = optim.grad_clip

    def _mb_values(self, packed):
        values = self.model(packed.input_ids, packed.position_ids, attn=DocumentAttention(packed.position_ids))
        return unpack_responses(values.float(), packed)

    @torch.no_grad()
    def compute_values(self, exp: Experience, plan: list[list[list[int]]]):
        out: dict[int, torch.Tensor] = {}
        for mini in plan:
            for mb in mini:
                samples = [exp.samples[i] for i in mb]
                values = self._mb_values(self._pack(samples, self.pad_id))
                if self.is_owner:
                    values = values.cpu()
                    for j, s in enumerate(samples):
                        out[s.uid] = values[j, : len(s.response_ids)]
        return {"values": out}

    def update(self, exp: Experience, plan: list[list[list[int]]], tensors: dict[str, torch.Tensor], *,
               epochs: int, loss_fn, agg: str = "token-mean") -> dict[str, float]:
        sums: dict[str, float] = {}
        count = 0
        self.optimizer_steps_in_update = 0
        for _ in range(epochs):
            for mbs in plan:
                denom = self._global_denominator(tensors["mask"][[i for mb in mbs for i in mb]], agg)
                self.optimizer.zero_grad(set_to_none=True)
                for k, mb in enumerate(mbs):
                    gradients_synced(self.model, k == len(mbs) - 1)
                    values = self._mb_values(self._pack([exp.samples[i] for i in mb], self.pad_id))
                    loss, metrics = loss_fn(values, _to({k2: v[mb] for k2, v in tensors.items()}, self.device,
                                                        values.shape[1]), denom)
                    loss.backward()
                    for k2, v in metrics.items():
                        sums[k2] = sums.get(k2, 0.0) + float(v)
                    count += 1
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + self._clip() * len(mbs)
                self.optimizer.step()
                self.optimizer_steps_in_update += 1
        self.scheduler.step()
        return {k: v / max(count, 1) for k, v in sums.items()}


def model_dtype(name: str) -> torch.dtype:
    return DTYPES[name]

