"""Pipeline parallelism: stages of a Llama model and a `PipelineRunner` over torch.distributed.pipelining.

    stages = build_stages(model, pp=2, pp_rank=r, stages_per_rank=1)   # [(stage_idx, module)]
    runner = PipelineRunner(stages, pp_group=g, num_stages=2, n_microbatches=4, schedule="1f1b")
    losses = runner.forward_backward(input_ids, position_ids=pos, extras={"adv": adv}, loss_fn=fn)
    hidden = runner.forward(input_ids, position_ids=pos)   # [B, T, H] on the last stage, None elsewhere

A stage is the model with other stages' layers deleted (keys of `model.layers` stay the
global layer indices, so names stay Hugging Face names) and embed/norm/head set to None
where they do not belong. Every stage returns hidden states [mb, T, H]: the last stage
returns the final-normed hidden states and keeps `lm_head`, but never applies it, so
the loss can compute chunked log-probs without [mb, T, V] logits (the runner does not
know what the loss does: docs/design.md, convention 5).

Per-token loss inputs (old log-probs, advantages, masks, targets) travel as `extras`, a
dict of [B, ...] tensors split along dim 0 exactly like the inputs; `loss_fn(hidden_mb,
extras_mb)` receives the last stage's output of one micro-batch and that micro-batch's
extras (plus `extras_mb["mb_index"]`). The schedule sees only a tensor of micro-batch
indices as its target. Gradients are not rescaled by the schedule (`scale_grads=False`):
normalise inside loss_fn (e.g. divide by the token count of the whole batch). loss_fn
may return `(loss, metrics)`; the metrics of each micro-batch are kept in
`runner.last_metrics`. Without `activation_dtype` torch infers stage shapes by running
each new shape once on dummy data, loss_fn included, so loss_fn must have no side effects
beyond its result (parallelize_model always passes the dtype: no dummy runs).

position_ids go to every stage (RoPE and packed-document masks need them); on ranks
that do not hold the first stage, pass `inputs=None` and the same position_ids.

Tied embeddings (Qwen2-0.5B, Qwen3 up to 4B): the first stage's embedding and the last
stage's head are two copies of one weight. After each `forward_backward` the two ranks
swap the gradient each copy gained in that call and add the other's, so both hold the
tied weight's full gradient and, stepped alike, stay equal (what Megatron's embedding
group all-reduce does; a point-to-point exchange needs no extra process group).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from parallel.master_weights import fp32_grad, grad_of
from parallel.native_runner import NativeRunner
from parallel.runner import LossFn, MicroBatch, ReduceFn, split_loss
from parallel.sharding import pp_stage_layers

SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")
_MAX_CACHED = 4  # schedules (one per micro-batch shape and mode) kept alive


def _stage_forward(module: nn.Module, x: torch.Tensor, position_ids: torch.Tensor | None = None, *,
                   attn_factory: Callable | None = None) -> torch.Tensor:
    attn = attn_factory(position_ids) if attn_factory is not None and position_ids is not None else None
    return module.hidden_states(x, position_ids, attn=attn)


def split_stage(model: nn.Module, *, num_stages: int, stage: int, attn_factory: Callable | None = None) -> nn.Module:
    """Prune `model` in place to pipeline stage `stage` of `num_stages`; its forward returns hidden states.

    attn_factory(position_ids [mb, T]) -> attention backend, e.g. models.document_attention.DocumentAttention
    for packed rows; None means plain causal attention.
    """
    n = model.config.num_hidden_layers
    keep = {str(i) for i in pp_stage_layers(n, pp=num_stages, stage=stage)}
    for key in list(model.model.layers.keys()):
        if key not in keep:
            del model.model.layers[key]
    if stage != 0:
        model.model.embed_tokens = None
    if stage != num_stages - 1:
        model.model.norm = None
        # the output head lives on the last stage only: lm_head (causal LM) or score (value / reward model)
        for head in ("lm_head", "score"):
            if hasattr(model, head):
                setattr(model, head, None)
    # an instance attribute, so nn.Module.__call__ (and its FSDP hooks) still wraps it
    model.forward = functools.partial(_stage_forward, model, attn_factory=attn_factory)
    return model


def stage_ids(*, pp: int, pp_rank: int, stages_per_rank: int = 1) -> list[int]:
    """Stages held by `pp_rank`, looped: rank r holds r, r + pp, r + 2 pp, ... (interleaved 1F1B layout)."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def build_stages(model: nn.Module, *, pp: int, pp_rank: int, stages_per_rank: int = 1,
                 attn_factory: Callable | None = None) -> list[tuple[int, nn.Module]]:
    """[(global stage index, stage module)] of this rank; `model` itself becomes the last of them.

    Copies are made before pruning, so build the model on the meta device or at small size
    when stages_per_rank > 1 and memory matters.
    """
    num_stages = pp * stages_per_rank
    if num_stages > model.config.num_hidden_layers:
        raise ValueError(f"pp({pp}) x stages_per_rank({stages_per_rank}) = {num_stages} stages exceed "
                         f"num_hidden_layers({model.config.num_hidden_layers}); lower pp or stages_per_rank")
    ids = stage_ids(pp=pp, pp_rank=pp_rank, stages_per_rank=stages_per_rank)
    out = []
    for k, s in enumerate(ids):
        mod = model if k == len(ids) - 1 else copy.deepcopy(model)
        out.append((s, split_stage(mod, num_stages=num_stages, stage=s, attn_factory=attn_factory)))
    return out


def _local_grad(p: nn.Parameter) -> torch.Tensor:
    """The gradient tensor this rank holds (its fp32 main grad if it has one; a DTensor's local shard under
    TP / FSDP)."""
    g = grad_of(p)
    return g.to_local() if hasattr(g, "to_local") else g


def _device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device if not hasattr(p, "to_local") else p.to_local().device
    return torch.device("cpu")


class PipelineRunner(NativeRunner):
    """Runs forward/backward of this rank's stages with a torch.distributed.pipelining schedule.

    The `parallel.runner.ModelRunner` methods (`forward`, `forward_backward` over packed
    micro-batches) pad the micro-batches to one length and run them as the rows of one batch;
    `forward_rows` / `forward_backward_rows` take that [B, T] batch directly.

    Stage objects and schedules are built per distinct input shape and cached (the last few).
    With `activation_dtype` the stages declare their [mb, T, H] activations; without it torch
    infers them with a dummy forward/backward on the first step of each shape.
    """

    def __init__(self, stages: list[tuple[int, nn.Module]], *, pp_group: dist.ProcessGroup, num_stages: int,
                 n_microbatches: int, schedule: str = "1f1b", activation_dtype: torch.dtype | None = None,
                 mesh=None):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
        if len(stages) > 1 and schedule != "interleaved_1f1b":
            raise ValueError(f"{len(stages)} stages per rank need schedule='interleaved_1f1b', got {schedule!r}")
        if schedule == "1f1b" and n_microbatches < num_stages:
            raise ValueError(f"1F1B needs n_microbatches({n_microbatches}) >= stages({num_stages})")
        self.stages = stages
        self.modules = [m for _, m in stages]
        self.mesh = mesh  # ("pp", "dp", "tp") DeviceMesh: export picks its (dp 0, tp 0) ranks
        self.pp_group = pp_group
        self.num_stages = num_stages
        self.n_microbatches = n_microbatches
        self.schedule = schedule
        self.device = _device_of(stages[0][1])
        # known activation dtype: stage shapes are declared (no dummy forward/backward per new shape)
        self.activation_dtype = activation_dtype
        self.hidden_size = stages[0][1].config.hidden_size
        self.last_metrics: list[dict] = []
        self._cache: dict[tuple, object] = {}
        self._loss_fn: Callable | None = None
        self._extras: list[dict[str, torch.Tensor]] = []

    @property
    def has_first(self) -> bool:
        return self.stages[0][0] == 0

    @property
    def has_last(self) -> bool:
        return self.stages[-1][0] == self.num_stages - 1

    @property
    def microbatches(self) -> int:
        return self.n_microbatches

    def _schedule_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        idx = int(target.reshape(-1)[0])
        mb = dict(self._extras[idx])
        mb["mb_index"] = idx
        res = self._loss_fn(output, mb)
        if isinstance(res, tuple):
            loss, metrics = res
            self.last_metrics[idx] = metrics
            return loss
        return res

    def _get_schedule(self, shape: tuple[int, int], *, training: bool):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        key = (shape, training)
        if key in self._cache:
            return self._cache[key]
        while len(self._cache) >= _MAX_CACHED:  # each schedule holds receive buffers for its shape
            self._cache.pop(next(iter(self._cache)))
        pstages = [PipelineStage(m, s, self.num_stages, self.device, group=self.pp_group,
                                 **self._stage_meta(s, shape, training=training)) for s, m in self.stages]
        loss = self._schedule_loss if training else None
        kw = dict(n_microbatches=self.n_microbatches, loss_fn=loss, scale_grads=False)
        if self.schedule == "interleaved_1f1b":
            sched = ScheduleInterleaved1F1B(pstages, **kw)
        elif self.schedule == "1f1b" and training:
            sched = Schedule1F1B(pstages[0], **kw)
        else:
            sched = ScheduleGPipe(pstages[0], **kw)  # forward-only runs have no 1F1B interleaving to do
        self._cache[key] = sched
        return sched

    def _stage_meta(self, stage: int, batch_shape: tuple[int, int], *, training: bool) -> dict:
        """Declared input/output metadata of one stage for micro-batches of batch_shape [B, T]."""
        if self.activation_dtype is None:
            return {}  # torch infers them with a dummy forward/backward on the first step of each shape
        mb, t = batch_shape[0] // self.n_microbatches, batch_shape[1]
        # requires_grad marks which activations get a gradient sent back in training
        hidden = torch.empty(mb, t, self.hidden_size, dtype=self.activation_dtype, device="meta",
                             requires_grad=training)
        inp = torch.empty(mb, t, dtype=torch.long, device="meta") if stage == 0 else hidden
        return {"input_args": (inp,), "output_args": (hidden,)}

    def _kwargs(self, inputs, position_ids):
        if self.has_first and inputs is None:
            raise ValueError("this rank holds the first stage: pass the input ids")
        if position_ids is None or position_ids.dim() != 2:
            raise ValueError("pass position_ids [B, T] on every pipeline rank (they also fix the micro-batch shapes)")
        b = position_ids.shape[0]
        if b % self.n_microbatches:
            raise ValueError(f"batch({b}) must be divisible by n_microbatches({self.n_microbatches})")
        args = (inputs,) if self.has_first else ()
        # every rank must agree on the cache key, so it is built from position_ids only
        return args, {"position_ids": position_ids}, tuple(position_ids.shape)

    def forward_backward_rows(self, inputs: torch.Tensor | None, *, loss_fn: Callable,
                         position_ids: torch.Tensor,
                         extras: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """One training pass over all micro-batches; gradients accumulate in the stage parameters.

        inputs [B, T] ids (first stage; None elsewhere), position_ids [B, T] (all stages),
        extras {name: [B, ...]} (last stage). Returns the per-micro-batch losses on the
        last stage's rank, [] elsewhere.
        """
        args, kwargs, shape = self._kwargs(inputs, position_ids)
        extras = extras or {}
        self._extras = [dict(zip(extras, parts)) for parts in
                        zip(*[torch.tensor_split(v, self.n_microbatches) for v in extras.values()])] \
            if extras else [{} for _ in range(self.n_microbatches)]
        self._loss_fn = loss_fn
        self.last_metrics = [{} for _ in range(self.n_microbatches)]
        sched = self._get_schedule(shape, training=True)
        losses: list[torch.Tensor] = []
        target = torch.arange(self.n_microbatches) if self.has_last else None
        tied = self._tied_copy()
        before = _local_grad(tied).clone() if tied is not None and grad_of(tied) is not None else None
        sched.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        if tied is not None:
            self._add_peer_tied_grad(tied, before)
        return losses if self.has_last else []

    def _tied_copy(self) -> nn.Parameter | None:
        """This rank's copy of a tied embedding/head weight that trains: the first stage's embedding or the
        last stage's head (a value model has no head: nothing is tied there); None on other ranks."""
        module = self.stages[0][1]
        if not (module.config.tie_word_embeddings and hasattr(module, "lm_head")):
            return None
        if self.has_first and self.has_last:  # cannot happen with pp > 1; a single rank keeps one tensor
            return None
        if self.has_first:
            p = module.model.embed_tokens.weight
        elif self.has_last:
            p = self.last_module.lm_head.weight
        else:
            return None
        return p if p.requires_grad else None

    def _counted_twice(self) -> nn.Parameter | None:
        """The last stage's copy of a tied weight: after the exchange it holds the first stage's gradient, which
        the global grad norm counts there."""
        return self._tied_copy() if self.has_last else None

    def _add_peer_tied_grad(self, p: nn.Parameter, before: torch.Tensor | None) -> None:
        """Send this call's gradient of the tied copy to the other end of the pipeline and add theirs (into an
        fp32 main grad where the parameter has one)."""
        grad = fp32_grad(p)
        delta = grad - before if before is not None else grad.clone()
        peer_idx = dist.get_world_size(self.pp_group) - 1 if self.has_first else 0
        peer = dist.get_global_rank(self.pp_group, peer_idx)
        theirs = torch.empty_like(delta)
        ops = [dist.P2POp(dist.isend, delta, peer, group=self.pp_group),
               dist.P2POp(dist.irecv, theirs, peer, group=self.pp_group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        grad.add_(theirs)

    @torch.no_grad()
    def forward_rows(self, inputs: torch.Tensor | None, *, position_ids: torch.Tensor) -> torch.Tensor | None:
        """Forward only (log-prob / value recompute): [B, T] ids -> last stage's [B, T, H] hidden, None elsewhere."""
        args, kwargs, shape = self._kwargs(inputs, position_ids)
        sched = self._get_schedule(shape, training=False)
        out = sched.step(*args, **kwargs)
        return out if self.has_last else None

    # ---- the ModelRunner interface: packed micro-batches of any lengths -> rows of one length
    def _rows(self, batches: list[MicroBatch]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        if len(batches) != self.n_microbatches:
            raise ValueError(f"the pipeline schedule takes exactly {self.n_microbatches} micro-batches, "
                             f"got {len(batches)}")
        lens = [mb.position_ids.shape[-1] for mb in batches]
        t = max(lens)
        ids, pos = [], []
        for mb, n in zip(batches, lens):
            dev = mb.position_ids.device
            # the padding is a document of its own (positions restart at 0): it never attends to real tokens
            ids.append(torch.cat([mb.input_ids.reshape(-1), torch.zeros(t - n, dtype=torch.long, device=dev)]))
            pos.append(torch.cat([mb.position_ids.reshape(-1), torch.arange(t - n, device=dev)]))
        return torch.stack(ids), torch.stack(pos), lens

    @torch.no_grad()
    def forward(self, batches, *, reduce: ReduceFn) -> list | None:
        ids, pos, lens = self._rows(list(batches))
        hidden = self.forward_rows(ids if self.has_first else None, position_ids=pos)
        if hidden is None:
            return None
        return [reduce(hidden[k: k + 1, :n], k) for k, n in enumerate(lens)]

    def forward_backward(self, batches, *, loss_fn: LossFn) -> list[dict]:
        ids, pos, lens = self._rows(list(batches))
        metrics: list[dict] = [{} for _ in lens]

        def row_loss(hidden_mb, extras):
            k = extras["mb_index"]
            loss, metrics[k] = split_loss(loss_fn(hidden_mb[:, : lens[k]], k))
            return loss

        self.forward_backward_rows(ids if self.has_first else None, loss_fn=row_loss, position_ids=pos)
        return metrics if self.has_last else []
