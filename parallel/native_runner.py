"""The native backend's runners: `NativeRunner`, what they share (HF-named parameters, heads, export, checkpoint
state, the optimizer and its clipping), and `LocalRunner`, the whole model on this rank (pp = 1; TP and FSDP live
inside the module). parallel/pipeline.py's PipelineRunner is the other (pp > 1). The interface they implement,
and the helpers every backend shares, are parallel/runner.py's."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from parallel.fsdp import gradients_synced, register_sharded_parameters
from parallel.master_weights import MasterWeightAdamW, clear_grad, grad_of
from parallel.runner import (
    LossFn,
    MicroBatch,
    ReduceFn,
    add_router_loss,
    attention_for,
    forward_hidden,
    head_weight,
    hf_name,
    router_trace,
    split_loss,
)
from parallel.shard_adamw import ShardLocalAdamW, like


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
