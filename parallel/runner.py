"""One runner interface for a trained model in every layout and backend.

`parallelize_model` always returns a runner: a `LocalRunner` (pp = 1) or a
`parallel.pipeline.PipelineRunner` (pp > 1); another training backend (megatron-core)
is one more class with the same methods. Callers (ppo/ workers, the hybrid engine, the
reshard executor, checkpoint export) never branch on the layout or on the runner's type.

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

import functools
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from parallel.fsdp import gradients_synced, register_sharded_parameters
from parallel.master_weights import MasterWeightAdamW, clear_grad, grad_of
from parallel.shard_adamw import ShardLocalAdamW, like


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


def _to_local(obj):
    """DTensors -> their local shards (picklable, per rank), recursively."""
    if hasattr(obj, "to_local"):
        return obj.to_local().detach().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_local(v) for v in obj)
    return obj


def _square_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The squared L2 norm of plain tensors, accumulated and returned in fp32 (16-bit main grads included:
    parallel/master_weights.py), one foreach norm per (device, dtype)."""
    by_kind: dict = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    out = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    for ts in by_kind.values():
        norms = torch._foreach_norm(ts, 2, dtype=torch.float32)
        out = out + torch.linalg.vector_norm(torch.stack([n.to(out.device) for n in norms])).square()
    return out


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


class NativeRunner:
    """What the native runners share: HF-named parameters, heads, export, the optimizer.

    Subclasses set `modules`, `mesh` (("pp", "dp", "tp") DeviceMesh or None on one process)
    and `pp_group` (None without pipeline stages) and implement forward / forward_backward.
    """

    modules: list[nn.Module]
    mesh: Any
    pp_group: dist.ProcessGroup | None
    # counts writes of the weights other than optimizer steps (loads, a LoRA warm-up's merge into the base): an
    # engine holding a LoRA actor's frozen base gets it again when this moves (rollout/hybrid.py)
    base_version: int = 0
    backend = "native"  # what a checkpoint records (ppo/run/relayout.py reshards native states only)

    @property
    def last_module(self) -> nn.Module | None:
        return self.modules[-1] if self.has_last else None

    @property
    def is_exporter(self) -> bool:
        return self.mesh is None or all(c == 0 for c in self.mesh.get_coordinate())

    @property
    def model_config(self):
        """The models.config.ModelConfig of the model (every stage carries it)."""
        return self.modules[0].config

    def release_gradients(self) -> None:
        """Drop gradient storage while the GPU generates (hybrid engine); the next backward recreates it."""
        for m in self.modules:
            for p in m.parameters():
                clear_grad(p)

    def restore_gradients(self) -> None:
        """Native gradients are recreated by the next backward: nothing to bring back."""

    def load_hf_weights(self, path, *, strict: bool = True) -> None:
        """This rank's slices of a Hugging Face checkpoint into every stage (strict=False keeps tensors the
        checkpoint lacks, e.g. a critic's value head when loading a causal LM)."""
        from parallel.loading import load_sharded_weights

        for m in self.modules:
            load_sharded_weights(m, path, strict=strict)
        self.base_version += 1

    def checkpoint_state(self, optimizer=None) -> dict:
        """This rank's parameters (local shards under HF names) and optimizer state, cloned (picklable).

        `slices` ({name: [global shape, offsets]}) and `optim_names` (the optimizer's parameters in order) make
        the state loadable at another layout (parallel/reshard_state.py). The parameters saved are the
        full-precision weights: an optimizer's fp32 masters where it keeps them
        (parallel/master_weights.py), which then leave its saved state. The format is FSDP2's layout's (fp32
        parameters, AdamW moments) either way, so a run resumes in the other layout too."""
        from parallel.reshard_state import chunk_index

        masters = optimizer.masters() if isinstance(optimizer, MasterWeightAdamW) else {}
        named = list(self.named_parameters())
        # slices: where each local shard sits in its full tensor, so another layout can rebuild its own shards
        # (parallel/reshard_state.py)
        state = {"params": {n: _to_local(masters.get(p, p.data)) for n, p in named}, "slices": chunk_index(named)}
        if optimizer is not None:
            names = {id(p): n for n, p in named}
            state["optim_names"] = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
            optim = optimizer.state_dict()
            if masters:
                optim = {**optim, "state": {i: {k: v for k, v in st.items() if k != "master"}
                                            for i, st in optim["state"].items()}}
            state["optim"] = _to_local(optim)
        return state

    def load_checkpoint_state(self, optimizer, state: dict) -> None:
        """Copy saved local shards into the live (possibly DTensor) parameters and optimizer state (and the saved
        full-precision parameters into an optimizer's fp32 masters)."""
        params = dict(self.named_parameters())
        with torch.no_grad():
            for n, p in params.items():
                dst = p.data.to_local() if hasattr(p.data, "to_local") else p.data
                dst.copy_(state["params"][n])
        self.base_version += 1
        if optimizer is None or "optim" not in state:
            return
        saved = state["optim"]
        if getattr(optimizer, "states_on_host", False):  # parallel/offload_optim.py: its loader pins them on the host
            optimizer.load_state_dict(saved)
            return
        # rebuild optimizer state tensors with each parameter's own placement (DTensor or plain)
        order = [p for g in optimizer.param_groups for p in g["params"]]
        new_state = {}
        for idx, st in saved["state"].items():
            p = order[int(idx)]
            new_state[idx] = {k: like(p, v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                              for k, v in st.items()}
        optimizer.load_state_dict({"state": new_state, "param_groups": saved["param_groups"]})
        if isinstance(optimizer, MasterWeightAdamW):
            names = {p: n for n, p in params.items()}
            optimizer.set_masters({p: like(p, state["params"][names[p]]) for p in order if p in names})

    def head(self, name: str = "lm_head") -> tuple[torch.Tensor, int]:
        if not self.has_last:
            raise RuntimeError("only the last pipeline stage holds the heads")
        return head_weight(self.modules[-1], name)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for m in self.modules:
            for n, p in m.named_parameters():
                yield hf_name(n), p

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters() if p.requires_grad]

    def training_shards(self) -> dict[str, torch.Tensor]:
        """HF name -> this rank's local shard (`to_local()` of DTensors, no copy), FSDP resharded first. A LoRA
        model's adapted weights come merged (W + scale * B @ A), its adapter tensors left out."""
        out = self._local_shards()
        if self.lora_modules:
            out = self._merge_adapters(out)
        return out

    def lora_shards(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """A LoRA model's (frozen base, adapters) as HF name -> this rank's local shard, nothing merged: what an
        engine applying the adapters itself takes (rollout/hybrid.py, sync "adapters")."""
        from models.lora import is_adapter_name

        shards = self._local_shards()
        return ({n: t for n, t in shards.items() if not is_adapter_name(n)},
                {n: t for n, t in shards.items() if is_adapter_name(n)})

    def _local_shards(self) -> dict[str, torch.Tensor]:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        out = {}
        for mod in self.modules:
            for m in mod.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()  # a root left gathered after forward would otherwise hand out full tensors
            for name, p in mod.named_parameters(remove_duplicate=False):  # tied head: both names, one tensor
                t = p.to_local() if isinstance(p, DTensor) else p
                out[hf_name(name)] = t.detach()
        return out

    @functools.cached_property
    def lora_modules(self) -> dict[str, nn.Module]:
        """{HF module name: adapted linear layer} of this rank's LoRA adapters (models/lora.py); empty without."""
        from models.lora import adapted_linears

        return {hf_name(n): m for mod in self.modules for n, m in adapted_linears(mod)}

    def _merge_adapters(self, shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The generation engine's weights of a LoRA model: each adapted weight merged (W + scale * B @ A, on the
        trainer's device, in this rank's layout), the adapter tensors left out. Collective over the layout's mesh
        (DTensor gathers an FSDP-sharded A)."""
        from models.lora import is_adapter_name, merged_weight

        out = {n: t for n, t in shards.items() if not is_adapter_name(n)}
        for name, mod in self.lora_modules.items():
            w = merged_weight(mod)
            out[f"{name}.weight"] = w.to_local() if hasattr(w, "to_local") else w
        return out

    def export_state_dict(self, *, merge_adapters: bool = True) -> dict[str, torch.Tensor] | None:
        """{HF name: full CPU tensor} of the whole model on the exporter rank, None elsewhere.

        Collective over the runner's group: each stage's tensors are gathered over dp/tp
        (DTensor.full_tensor), then the stages of the (dp 0, tp 0) ranks meet on pp rank 0. With LoRA
        adapters: the policy as a plain Hugging Face model (each adapted weight merged, W + scale * B @ A in
        fp32, the adapters left out); merge_adapters=False: the base weights and the "<module>.lora_A/B"
        tensors as they are.
        """
        from parallel.loading import full_state_dict

        mine = {hf_name(k): v for m in self.modules for k, v in full_state_dict(m).items()}
        if merge_adapters and self.lora_modules:
            from models.lora import is_adapter_name

            for name, mod in self.lora_modules.items():
                w = mine[f"{name}.weight"]
                delta = mine[f"{name}.lora_B"].float() @ mine[f"{name}.lora_A"].float()
                mine[f"{name}.weight"] = (w.float() + delta * mod.lora_scale).to(w.dtype)
            mine = {n: t for n, t in mine.items() if not is_adapter_name(n)}
        return self._on_exporter(mine)

    def adapter_state_dict(self) -> dict[str, torch.Tensor] | None:
        """{"<module>.lora_A" / ".lora_B": full CPU tensor} of the LoRA adapters on the exporter rank (empty
        without adapters), None elsewhere; collective like export_state_dict, gathering the adapters only."""
        from models.lora import is_adapter_name
        from parallel.loading import full_state_dict

        return self._on_exporter({hf_name(k): v for m in self.modules
                                  for k, v in full_state_dict(m, only=is_adapter_name).items()})

    def _on_exporter(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """This stage's full tensors -> every stage's on the exporter rank (pp rank 0 of dp 0, tp 0), None
        elsewhere."""
        if self.pp_group is None:
            return mine if self.is_exporter else None
        _, dp_idx, tp_idx = self.mesh.get_coordinate()
        if dp_idx or tp_idx:
            return None
        parts = [None] * dist.get_world_size(self.pp_group)
        dst = dist.get_global_rank(self.pp_group, 0)
        dist.gather_object(mine, parts if dist.get_rank() == dst else None, dst=dst, group=self.pp_group)
        if not self.is_exporter:
            return None
        return {k: v for part in parts for k, v in part.items()}

    def build_optimizer(self, *, lr: float, betas: tuple[float, float], weight_decay: float,
                        stream_from_host: bool = False):
        """AdamW over this rank's trainable parameters: fp32 masters in its state when they are 16-bit with main
        grads (parallel/master_weights.py); with `stream_from_host`, Adam's moments in pinned host memory,
        streamed through the device in each step (FSDP layout only)."""
        for m in self.modules:  # after a forward FSDP2 may have the gathered parameters registered
            register_sharded_parameters(m)
        params, kw = self.parameters(), dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        main_grads = any(hasattr(p, "main_grad") for p in params)
        if stream_from_host:
            if main_grads:
                raise ValueError("an optimizer streamed from host memory streams FSDP's fp32 parameter shards: build "
                                 "the runner with fsdp=True (16-bit parameters with fp32 main grads have none)")
            from parallel.offload_optim import HostOffloadAdamW

            return HostOffloadAdamW(params, **kw)
        return (MasterWeightAdamW if main_grads else ShardLocalAdamW)(params, **kw, fused=self._device().type == "cuda")

    def optimizer_step(self, optimizer, *, max_norm: float) -> float:
        """Clip to a global grad norm over every shard (dp/tp DTensors, pp stages), then step. `optimizer` is
        build_optimizer's (a ShardLocalAdamW: it applies the clip coefficient in its update). A non-finite norm
        skips the step: the norm is reduced over every rank of the model's groups, so every rank skips it."""
        params, grads = [], []
        for p in self.parameters():
            if (g := grad_of(p)) is not None:
                params.append(p)
                grads.append(g)
        norm, coef = 0.0, 1.0
        if grads or self.pp_group is not None:
            twice = self._counted_twice()  # a tied weight's pipeline copy: same gradient as the first stage's
            norm = self._grad_norm([g for p, g in zip(params, grads) if p is not twice])
            coef = min(1.0, max_norm / (norm + 1e-6))
        if not math.isfinite(norm):
            return norm  # NaN / inf gradients: weights and optimizer state untouched
        optimizer.step(grad_scale=coef)  # the clip inside the update (on CUDA no pass of its own)
        return norm

    def _counted_twice(self) -> nn.Parameter | None:
        """A parameter whose gradient another rank of the pp group also holds (and counts); None here."""
        return None

    def _grad_norm(self, grads: list[torch.Tensor]) -> float:
        """Global L2 norm of `grads` (one host sync). DTensor gradients count through their local shards: each
        shard's squared norm, divided by its replica count (a Replicate placement holds the same values on every
        rank of that mesh dim), summed over the DTensor's mesh; plain tensors (e.g. an unsharded value head) count
        as they are; the pp group adds the stages up. Local tensors, because DTensor dispatch of the foreach
        norm, stack and vector norm cost ~3 ms of host time per step on the H200 machine while the device,
        done with backward, waited (bench profiles: largest_gaps)."""
        device = self._device()
        sq = torch.zeros((), dtype=torch.float32, device=device)
        plain = [g for g in grads if not hasattr(g, "to_local")]
        if plain:
            sq = sq + _square_norm(plain).to(device)
        by_mesh: dict = {}  # mesh -> {replica count: local shards}
        for g in grads:
            if not hasattr(g, "to_local"):
                continue
            if any(p.is_partial() for p in g.placements):
                raise RuntimeError(f"gradient with a Partial placement {g.placements}: reduce it before the norm")
            replicas = math.prod(g.device_mesh.size(d) for d, p in enumerate(g.placements) if p.is_replicate())
            by_mesh.setdefault(g.device_mesh, {}).setdefault(replicas, []).append(g.to_local())
        for mesh, groups in by_mesh.items():
            part = sum(_square_norm(ts).to(device) / r for r, ts in groups.items())
            for d in range(mesh.ndim):
                if mesh.size(d) > 1:
                    dist.all_reduce(part, group=mesh.get_group(d))
            sq = sq + part
        if self.pp_group is not None:
            dist.all_reduce(sq, group=self.pp_group)
        return float(sq.sqrt())

    def _device(self) -> torch.device:
        p = next(p for m in self.modules for p in m.parameters())
        return (p.to_local() if hasattr(p, "to_local") else p).device


class LocalRunner(NativeRunner):
    """The whole model on this rank (pp = 1; TP and FSDP live inside the module)."""

    def __init__(self, model: nn.Module, *, mesh=None, attn_factory: Callable | None = None,
                 expert_parallel=None, dp: int = 1):
        """expert_parallel: parallel.expert_parallel.ExpertParallel of an expert-parallel model (its experts'
        gradients are reduced after the last micro-batch, as FSDP reduces the others over the `dp` ranks)."""
        self.modules = [model]
        self.mesh = mesh
        self.pp_group = None
        self.attn_factory = attn_factory
        self.expert_parallel = expert_parallel
        self.dp = dp

    has_first = True
    has_last = True
    microbatches = None

    @property
    def module(self) -> nn.Module:
        return self.modules[0]

    def _hidden(self, mb: MicroBatch, trace=None) -> torch.Tensor:
        return forward_hidden(self.modules[0], mb.input_ids, mb.position_ids, attn=attention_for(self.attn_factory, mb),
                              routing=trace)

    @torch.no_grad()
    def forward(self, batches: Sequence[MicroBatch], *, reduce: ReduceFn) -> list:
        cfg = self.model_config
        return [reduce(self._hidden(mb, router_trace(cfg, mb)), k) for k, mb in enumerate(batches)]

    def forward_backward(self, batches: Sequence[MicroBatch], *, loss_fn: LossFn) -> list[dict]:
        out = []
        cfg = self.model_config
        for k, mb in enumerate(batches):
            gradients_synced(self.modules[0], k == len(batches) - 1)  # reduce-scatter once, after the last
            trace = router_trace(cfg, mb)
            # the phases a step profile attributes kernels and idle time to (ppo/metrics/profiling.py)
            with record_function("phase:forward"):
                hidden = self._hidden(mb, trace)
            with record_function("phase:loss"):
                loss, metrics = split_loss(loss_fn(hidden, k))
                if trace is not None:  # a mixture of experts: its load-balancing loss joins the actor's
                    loss, metrics = add_router_loss(cfg, trace, loss, metrics, scale=1.0 / len(batches))
            with record_function("phase:backward"):
                loss.backward()
            out.append(metrics)
        if self.expert_parallel is not None:
            self.expert_parallel.reduce_gradients(dp=self.dp)
        return out
