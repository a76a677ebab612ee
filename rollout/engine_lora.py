"""LoRA adapters inside the native engine's GEMMs: the frozen base is loaded once, each update sends only the
adapters (actor.lora.sync=adapters; rollout/hybrid.py).

    adapters = EngineAdapters(model, spec, device=dev, dtype=torch.bfloat16)   # after fuse_projections
    adapters.load("model.layers.0.self_attn.q_proj.lora_A", a_shard)          # HF adapter names, this TP rank's
    adapters.finish(fused_groups)                                              # fold norm weights into new A's

Every adapted projection computes `W x + B' (A x)` with B' = alpha/r * B. The buffers are static (allocated once,
never freed by sleep, written in place by each load), so the decode step's CUDA graphs capture them once and
every later update reaches the graphed decode without a re-capture. A fused GEMM (q|k|v, gate|up) gets one
adapter pair over its targeted members: A stacked [k r, in] (one GEMM for all of them) and B block-diagonal
[out, k r] (the rows of member i read only its own r columns). Under tensor parallelism the adapters arrive
split like their base (parallel/sharding.py): a column-parallel projection's B by rows, a row-parallel one's A by
columns, so a row-parallel adapter's partial product joins the base's partial sum before the one all-reduce.
With rollout.fold_norms the input norm's weight is folded into the stacked A like into the base weight
(rollout/folded_norms.py: the GEMM then reads the unnormalised rows, whose row scale is applied after it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.lora import LoRASpec

FUSED_MEMBERS = {"qkv_weight": ("q_proj", "k_proj", "v_proj"), "gate_up_weight": ("gate_proj", "up_proj")}
FUSED_ADAPTER = {"qkv_weight": "qkv_lora", "gate_up_weight": "gate_up_lora"}


def lora_delta(x: torch.Tensor, adapter: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """B' (A x) of rows x [..., in] with adapter (A [k r, in], B' [out, k r]) -> [..., out]."""
    a, b = adapter
    return F.linear(F.linear(x, a), b)


class AdaptedLinear(nn.Linear):
    """The engine's plain projection with an adapter: W x + b + B' (A x). `lora` is set by EngineAdapters."""

    lora: tuple[torch.Tensor, torch.Tensor]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + lora_delta(x, self.lora)


class EngineAdapters:
    """The static adapter buffers of the engine's local model, by the trainer's HF adapter names."""

    def __init__(self, model: nn.Module, spec: LoRASpec, *, device, dtype):
        self.spec, self.scale, r = spec, spec.scale, spec.rank
        self.views: dict[str, torch.Tensor] = {}  # HF adapter name -> the view of a static buffer it is copied into
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.fold_into: dict[str, tuple[object, str]] = {}  # lora_A name -> (fused module, fused weight attribute)
        self.loaded: set[str] = set()  # ever (the buffers persist across sleep)
        self.unfolded: set[str] = set()  # A's loaded since the last finish() that a folded norm weight must scale
        targets = set(spec.modules)
        adapted = [(n, m) for n, m in model.named_modules()
                   if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in targets]
        if not adapted:
            raise ValueError(f"no projection of the engine's model matches LoRA target_modules {spec.target_modules}")
        parents = dict(model.named_modules())
        fused: dict[tuple[str, str], list[tuple[str, nn.Linear]]] = {}
        for name, lin in adapted:
            parent_name, _, attr = name.rpartition(".")  # lm_head: the model itself ("")
            parent = parents[parent_name]
            group = next((g for g, members in FUSED_MEMBERS.items()
                          if attr in members and getattr(parent, g, None) is not None), None)
            if group is not None:
                fused.setdefault((parent_name, group), []).append((name, lin))
                continue
            out_f, in_f = lin.weight.shape
            a = torch.zeros(r, in_f, device=device, dtype=dtype)
            b = torch.zeros(out_f, r, device=device, dtype=dtype)
            if type(lin) is nn.Linear:
                lin.__class__ = AdaptedLinear
            lin.lora = (a, b)  # RowParallelLinear applies it before its all-reduce
            self._add(name, a, b)
        for (parent_name, group), members in fused.items():
            parent = parents[parent_name]
            order = FUSED_MEMBERS[group]
            members.sort(key=lambda m: order.index(m[0].rsplit(".", 1)[-1]))
            rows = dict(zip(order, _row_ranges([lin.weight.shape[0] for lin in
                                                (getattr(parent, m) for m in order if hasattr(parent, m))])))
            in_f = members[0][1].weight.shape[1]
            a = torch.zeros(len(members) * r, in_f, device=device, dtype=dtype)
            b = torch.zeros(sum(getattr(parent, m).weight.shape[0] for m in order), len(members) * r,
                            device=device, dtype=dtype)
            for i, (name, _) in enumerate(members):
                start, stop = rows[name.rsplit(".", 1)[-1]]
                self._add(name, a[i * r:(i + 1) * r], b[start:stop, i * r:(i + 1) * r])
                self.fold_into[f"{name}.lora_A"] = (parent, group)
            setattr(parent, FUSED_ADAPTER[group], (a, b))

    def _add(self, module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        for suffix, view in (("lora_A", a), ("lora_B", b)):
            self.views[f"{module}.{suffix}"] = view
            self.shapes[f"{module}.{suffix}"] = tuple(view.shape)

    def __contains__(self, name: str) -> bool:
        return name in self.views

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.views.values())

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        """One adapter tensor (this TP rank's shard of A [r, in] or B [out, r]) into its buffer; B is scaled."""
        dst = self.views[name]
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(f"{name}: got shape {tuple(tensor.shape)}, this rank's shard is {tuple(dst.shape)}")
        dst.copy_(tensor)
        if name.endswith(".lora_B"):
            dst.mul_(self.scale)
        self.loaded.add(name)
        if name in self.fold_into:
            self.unfolded.add(name)

    @torch.no_grad()
    def finish(self, fused_groups) -> None:
        """Before a generate: every adapter must have arrived at least once (an adapter that never reached the
        engine fails here, not silently); A's loaded since the last call get their fused GEMM's folded norm."""
        missing = sorted(set(self.views) - self.loaded)
        if missing:
            raise RuntimeError(f"{len(missing)} LoRA adapter tensors never loaded into the engine (e.g. "
                               f"{missing[:2]}); update_weights must carry every adapter (actor.lora.sync=adapters)")
        norms = {(id(g.module), g.attr): g.norm for g in fused_groups if g.norm is not None}
        for name in self.unfolded:
            module, attr = self.fold_into[name]
            norm = norms.get((id(module), attr))
            if norm is not None:
                self.views[name].mul_(norm.to(self.views[name].dtype)[None, :])
        self.unfolded.clear()


def _row_ranges(sizes: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out
