"""One runner interface for a trained model in every layout and backend.

`parallelize_model` always returns a runner: a `parallel.native_runner.LocalRunner` (pp = 1) or a
`parallel.pipeline.PipelineRunner` (pp > 1); another training backend (megatron-core)
is one more class with the same methods. This module holds the interface and what every backend shares
(MicroBatch, the hidden-state forward, heads, routing traces, parameter names). Callers (ppo/ workers, the
hybrid engine, the reshard executor, checkpoint export) never branch on the layout or on the runner's type.

    runner = parallelize_model(model, mesh=mesh, dims=dims, n_microbatches=4)
    mbs = [MicroBatch(ids_k, pos_k) for ...]                 # packed rows [1, T_k], any T_k
    if runner.microbatches is not None: assert len(mbs) == runner.microbatches
    logps = runner.forward(mbs, reduce=lambda h, k: ...)      # last stage: [fn(h_k, k)], else None
    metrics = runner.forward_backward(mbs, loss_fn=lambda h, k: (loss, {"pg_loss": ...}))
    w, vocab_start = runner.head("lm_head")                   # last stage, after a forward
    opt = runner.build_optimizer(lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0)
    grad_norm = runner.optimizer_step(opt, max_norm=1.0)      # clip + step (a backend may clip inside step)
    sd = runner.export_state_dict()                           # {HF name: full tensor} on runner.is_exporter

The `ModelRunner` protocol, precisely:

- `modules: list[nn.Module]`: this rank's model chunks (pipeline stages keep global HF names).
- `has_first`, `has_last: bool`: whether this rank holds the embedding / the final norm + heads.
- `microbatches: int | None`: the exact number of micro-batches each call must pass (a pipeline
  schedule's), or None when any number works.
- `forward(batches: Sequence[MicroBatch], *, reduce: (hidden [1, T_k, H], k) -> R) -> list[R] | None`:
  no grad; `reduce` runs on the last stage on each micro-batch's final-normed hidden states
  (never the [T, V] logits); returns [R_0, ..., R_{n-1}] on the last stage, None elsewhere.
- `forward_backward(batches, *, loss_fn: (hidden [1, T_k, H], k) -> loss | (loss, metrics))
  -> list[dict]`: one gradient-accumulating pass over all micro-batches (DP gradient
  reduction happens once, after the last); the summed losses' gradients land in the
  parameters, unscaled (normalise inside loss_fn). Returns each micro-batch's metrics on the
  last stage, [] elsewhere.
- `head(name="lm_head" | "score") -> (weight [V_local, H] or [L, H], vocab_start)`: the last
  stage's head, differentiable, after a forward inside `reduce`/`loss_fn`; under TP the
  lm_head's rows are this rank's vocab slice starting at vocab_start.
- `named_parameters() -> Iterator[(HF name, Parameter)]`: this rank's parameters under Hugging
  Face names (DTensors keep their placements; tied weights once); `parameters()`: the trainable ones.
- `training_shards() -> {HF name: local shard}`: what the reshard executor sends (tied: both names).
- `export_state_dict() -> {HF name: full tensor} | None`: collective over the runner's group;
  the whole model on the rank where `is_exporter` (group coordinate 0, 0, 0), None elsewhere.
- `build_optimizer(*, lr, betas, weight_decay, stream_from_host=False)` and `optimizer_step(optimizer, *,
  max_norm) -> grad norm`: the optimizer is the backend's (native: AdamW; clipping over every dp/tp/pp shard);
  `stream_from_host` keeps Adam's moments in pinned host memory and streams them through the device in each
  step (native: parallel/offload_optim.py), and a backend that cannot must raise rather than ignore it.
- `model_config`: the models.config.ModelConfig; `load_hf_weights(path, *, strict)`: this rank's slices
  of an HF checkpoint; `checkpoint_state(optimizer) -> dict` / `load_checkpoint_state(optimizer, state)`:
  this rank's model + optimizer state in the backend's own layout (ppo/run/state.py writes it atomically);
  `release_gradients()` / `restore_gradients()`: gradient storage leaves the GPU around generation.
  megatron-core is one more implementation: parallel/megatron_runner.py (`<role>.backend: megatron`,
  built by parallel/backends.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(slots=True)
class MicroBatch:
    """One packed micro-batch: documents concatenated in a single row."""

    input_ids: torch.Tensor  # [1, T] token ids (read by the first stage only)
    position_ids: torch.Tensor  # [1, T] restarting at 0 per document (every stage: RoPE and masks)
    layout: Any = None  # the packer's models.document_layout.DocumentLayout of position_ids, if it made one
    # a mixture of experts: the rollout engine's experts of each token [T, L_moe, k] (-1: none recorded), and
    # whether the forward must use them (routing replay) or only compare its own choice with them
    routing: torch.Tensor | None = None
    replay: bool = False


def router_trace(model_config, mb: MicroBatch):
    """The models.moe.RouterTrace of one micro-batch's forward (None for a dense model): the engine's recorded
    experts per MoE layer, replayed when mb.replay, and the load-balancing statistics."""
    if not getattr(model_config, "is_moe", False):
        return None
    from models.moe import RouterTrace

    recorded = None
    if mb.routing is not None:
        recorded = {layer: mb.routing[:, j] for j, layer in enumerate(model_config.moe_layers)}
    return RouterTrace(recorded=recorded, replay=mb.replay)


def add_router_loss(model_config, trace, loss: torch.Tensor, metrics: dict, *, scale: float):
    """loss + router_aux_loss_coef * the load-balancing loss * scale (1 / micro-batches: their mean), and the
    routing metrics: aux_loss, and router_mismatch (the fraction of (token, MoE layer) routings where the
    trainer's router alone chooses other experts than the engine recorded) where the engine recorded any."""
    aux = trace.aux_loss(model_config.num_experts)
    if aux is None:
        return loss, metrics
    metrics = {**metrics, "aux_loss": aux.detach()}
    if trace.compared is not None:
        metrics["router_mismatch"] = trace.mismatched / trace.compared.clamp(min=1)
    if model_config.router_aux_loss_coef:
        loss = loss + model_config.router_aux_loss_coef * scale * aux
    return loss, metrics


def attention_for(attn_factory: Callable | None, mb: MicroBatch):
    """attn_factory(position_ids) for one micro-batch, given the packer's layout when it has one (the
    factory then needs no device->host copy of the positions)."""
    if attn_factory is None:
        return None
    return attn_factory(mb.position_ids) if mb.layout is None else attn_factory(mb.position_ids, layout=mb.layout)


ReduceFn = Callable[[torch.Tensor, int], Any]
LossFn = Callable[[torch.Tensor, int], "torch.Tensor | tuple[torch.Tensor, dict]"]


def forward_hidden(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, *,
                   attn=None, routing=None) -> torch.Tensor:
    """[B, T] ids -> final-normed hidden [B, T, H], run through `model.__call__` (FSDP/compile hooks fire).
    routing: a mixture of experts' models.moe.RouterTrace (None: a dense model's call, unchanged)."""
    saved = model.__dict__.get("forward")
    model.forward = model.hidden_states
    try:
        if routing is not None:
            return model(input_ids, position_ids, attn=attn, routing=routing)
        return model(input_ids, position_ids, attn=attn)
    finally:
        if saved is not None:
            model.forward = saved
        else:
            del model.forward


class ModelRunner(Protocol):
    modules: list[nn.Module]

    @property
    def has_first(self) -> bool: ...
    @property
    def has_last(self) -> bool: ...
    @property
    def microbatches(self) -> int | None: ...
    @property
    def is_exporter(self) -> bool: ...
    def forward(self, batches: Sequence[MicroBatch], *, reduce: ReduceFn) -> list | None: ...
    def forward_backward(self, batches: Sequence[MicroBatch], *, loss_fn: LossFn) -> list[dict]: ...
    def head(self, name: str = "lm_head") -> tuple[torch.Tensor, int]: ...
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...
    def parameters(self) -> list[nn.Parameter]: ...
    def training_shards(self) -> dict[str, torch.Tensor]: ...
    def export_state_dict(self, *, merge_adapters: bool = True) -> dict[str, torch.Tensor] | None: ...
    def adapter_state_dict(self) -> dict[str, torch.Tensor] | None: ...
    @property
    def lora_modules(self) -> dict[str, nn.Module]: ...
    def build_optimizer(self, *, lr: float, betas: tuple[float, float], weight_decay: float,
                        stream_from_host: bool = False): ...
    def optimizer_step(self, optimizer, *, max_norm: float) -> float: ...
    @property
    def model_config(self): ...
    def load_hf_weights(self, path, *, strict: bool = True) -> None: ...
    def release_gradients(self) -> None: ...
    def restore_gradients(self) -> None: ...
    def checkpoint_state(self, optimizer=None) -> dict: ...
    def load_checkpoint_state(self, optimizer, state: dict) -> None: ...


def split_loss(res) -> tuple[torch.Tensor, dict]:
    """loss_fn's result -> (loss, metrics)."""
    return res if isinstance(res, tuple) else (res, {})


# wrapper prefixes torch.compile / checkpoint wrappers / DDP put in front of parameter names
_WRAPPERS = re.compile(r"(?<![^.])(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module|module)\.")


def hf_name(name: str) -> str:
    return _WRAPPERS.sub("", name)


def head_weight(module: nn.Module, name: str = "lm_head") -> tuple[torch.Tensor, int]:
    """(this rank's head weight, its vocab start) for `module.<name>`, differentiable.

    A head used outside the module's forward may still be sharded over dp by FSDP: those mesh
    dims are gathered (all-gather forward, reduce-scatter backward into the sharded gradient);
    a TP-sharded lm_head keeps this rank's vocab rows. A LoRA-adapted head (models/lora.py, its adapters on)
    comes merged, W + alpha/r B @ A, differentiable in A and B (its B keeps the same vocab rows).
    """
    from torch.distributed.tensor import DTensor

    from parallel.loading import local_slices

    head = getattr(module, name)
    w = head.weight
    start = (local_slices(w)[0].start or 0) if isinstance(w, DTensor) else 0
    w = _tp_local(w)
    if getattr(head, "lora_enabled", False):
        delta = _tp_local(head.lora_B).to(w.dtype) @ _tp_local(head.lora_A).to(w.dtype)
        w = w + delta * head.lora_scale
    return w, start


def _tp_local(t: torch.Tensor) -> torch.Tensor:
    """This rank's TP shard of a parameter (gathered over FSDP's dp dims, differentiably), a plain one as it is."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return t
    names = t.device_mesh.mesh_dim_names or ()
    placements = [p if n == "tp" else Replicate() for n, p in zip(names, t.placements)]
    if list(placements) != list(t.placements):
        t = t.redistribute(t.device_mesh, placements)
    return t.to_local()
