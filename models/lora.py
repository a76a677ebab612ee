"""LoRA adapters on a model's linear layers, under PEFT's module names and file format.

    spec = LoRASpec(rank=16, alpha=32, target_modules=("all-linear",))
    add_adapters(model, spec, seed=0)              # q_proj ... down_proj get lora_A [r, in], lora_B [out, r]
    freeze_base(model)                             # only the adapters train
    with adapters_disabled(model):                 # the base policy (a LoRA actor's reference)
        ref_logits = model(ids)
    w = merged_weight(model.model.layers["0"].self_attn.q_proj)   # W + alpha/r * B @ A
    save_peft_adapter(peft_state_dict(model), spec, out_dir)       # adapter_config.json + adapter_model.safetensors

An adapted `nn.Linear` keeps its own `weight` (and its Hugging Face name) and gains two parameters,
`<module>.lora_A` [r, in] and `<module>.lora_B` [out, r]; its forward becomes
`linear(x, W, b) + scale * linear(linear(dropout(x), A), B)` with `scale = alpha / r`, PEFT's LoRA
(A Kaiming-uniform, B zero: the adapted model starts equal to the base). The adapters are added after
tensor parallelism, which may hand them in as DTensors laid out like their base weight
(parallel/lora.py); every function here works on plain tensors and DTensors alike. Dropout acts only
where gradients are recorded (the update's forward): scoring forwards and generation see the policy
itself, so the PPO ratio stays 1 on-policy. Adapters compute in the input's dtype (a 16-bit base runs
16-bit GEMMs) while their parameters stay fp32.
"""

from __future__ import annotations

import contextlib
import json
import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from models.mixin import with_mixin

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output head
HEAD = "lm_head"  # the output head: adapted only when named (as in PEFT; an untied head only)
PEFT_PREFIX = "base_model.model."  # PEFT's name of the wrapped model's parameters
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True, slots=True)
class LoRASpec:
    """rank r, alpha (scale = alpha / r), dropout on the adapter's input, PEFT target module names."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def modules(self) -> tuple[str, ...]:
        """The targeted projection names (all-linear expanded)."""
        return resolve_targets(self.target_modules)


def resolve_targets(targets) -> tuple[str, ...]:
    """PEFT target names -> the projections of this model family they name (all-linear: the decoder's seven;
    lm_head only when named); ValueError for an unknown one."""
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    names = (*LINEAR_NAMES, HEAD)
    if not targets:
        raise ValueError(f"LoRA target_modules is empty; name some of {', '.join(names)} or {ALL_LINEAR}")
    unknown = [t for t in targets if t not in (*names, ALL_LINEAR)]
    if unknown:
        raise ValueError(f"LoRA target_modules {unknown} are not linear layers of this model; use "
                         f"{', '.join(names)} or {ALL_LINEAR}")
    return tuple(t for t in names if t in targets or (ALL_LINEAR in targets and t != HEAD))


def adapter_param_count(cfg, spec: LoRASpec) -> int:
    """Parameters of `spec`'s adapters on a model of `cfg` (models.config.ModelConfig): r x (in + out) per
    adapted projection and layer."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    head = spec.rank * (h + cfg.vocab_size) if HEAD in spec.modules else 0
    return head + cfg.num_hidden_layers * sum(spec.rank * sum(shapes[m]) for m in spec.modules if m != HEAD)


class LoRA(nn.Module):
    """What add_adapters mixes into an adapted nn.Linear (models.mixin: a class-level forward, so one compiled
    graph serves every layer's projections)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.lora_enabled:
            return out
        if self.lora_dropout and torch.is_grad_enabled():
            x = F.dropout(x, self.lora_dropout, training=True)
        a, b = self.lora_A, self.lora_B
        return out + F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype)) * self.lora_scale


def _module_seed(seed: int, name: str) -> int:
    # per module, so that every layout (pipeline stages hold a subset of layers) draws the same A
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def add_adapters(model: nn.Module, spec: LoRASpec, *, seed: int = 0,
                 place: Callable[[nn.Linear, torch.Tensor, torch.Tensor], tuple[nn.Parameter, nn.Parameter]]
                 | None = None) -> list[str]:
    """Give every targeted linear layer of the decoder an adapter, in place; returns their module names.

    A [r, in] ~ Kaiming-uniform(a=sqrt 5) drawn from a generator seeded by (seed, module name), B [out, r] = 0,
    both fp32 on the base weight's device. place(module, A, B) -> (A, B) parameters: how a parallel layout
    holds them (parallel/lora.py's DTensors); default plain parameters."""
    if spec.rank < 1:
        raise ValueError(f"LoRA rank({spec.rank}) must be >= 1")
    targets = set(spec.modules)
    if HEAD in targets:
        cfg = getattr(model, "config", None)
        if cfg is not None and cfg.tie_word_embeddings:
            raise ValueError("LoRA on lm_head of a model whose head is tied to its embeddings: the merged head would "
                             "no longer be the embedding table; leave lm_head out of target_modules")
        if spec.dropout:
            raise ValueError(f"LoRA dropout({spec.dropout}) with lm_head targeted: the trainer applies the head as "
                             "one merged weight (parallel.runner.head_weight), which has no input to drop; use 0")
    names = []
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] not in targets or not isinstance(mod, nn.Linear):
            continue
        if hasattr(mod, "lora_A"):
            raise ValueError(f"{name} already has a LoRA adapter")
        out_f, in_f = mod.weight.shape  # a DTensor's shape is the global one
        device = (mod.weight.to_local() if hasattr(mod.weight, "to_local") else mod.weight).device
        gen = torch.Generator().manual_seed(_module_seed(seed, name))
        a = torch.empty(spec.rank, in_f)
        bound = 1.0 / math.sqrt(in_f)  # kaiming_uniform_(a=sqrt(5)) on [r, in]: U(-1/sqrt(in), 1/sqrt(in))
        a.uniform_(-bound, bound, generator=gen)
        a, b = a.to(device), torch.zeros(out_f, spec.rank, device=device)
        pa, pb = place(mod, a, b) if place is not None else (nn.Parameter(a), nn.Parameter(b))
        mod.register_parameter("lora_A", pa)
        mod.register_parameter("lora_B", pb)
        mod.lora_scale, mod.lora_dropout, mod.lora_enabled = spec.scale, spec.dropout, True
        with_mixin(mod, LoRA)
        names.append(name)
    if not names:
        raise ValueError(f"no module of the model matches LoRA target_modules {spec.target_modules}")
    return names


def is_adapter_name(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def freeze_base(model: nn.Module) -> int:
    """requires_grad=False on every parameter but the adapters; returns the trainable count."""
    n = 0
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name))
        n += p.numel() if p.requires_grad else 0
    return n


def adapted_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """(module name, module) of every adapted linear layer."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and hasattr(mod, "lora_A"):
            yield name, mod


@contextlib.contextmanager
def adapters_disabled(modules):
    """Run the base model: every adapter of `modules` (a module or a list of them) off inside the block."""
    mods = [m for root in ([modules] if isinstance(modules, nn.Module) else modules)
            for _, m in adapted_linears(root)]
    for m in mods:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.lora_enabled = True


@torch.no_grad()
def merged_weight(mod: nn.Linear) -> torch.Tensor:
    """W + scale * B @ A in W's dtype and layout (a DTensor keeps W's placements); computed in fp32."""
    w, a, b = mod.weight, mod.lora_A, mod.lora_B
    delta = (b.float() @ a.float()) * mod.lora_scale
    if hasattr(w, "placements") and tuple(delta.placements) != tuple(w.placements):
        delta = delta.redistribute(w.device_mesh, w.placements)
    return (w.float() + delta).to(w.dtype)


def peft_state_dict(named_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our adapter tensors {"<module>.lora_A": A, ...} -> PEFT's file names
    {"base_model.model.<module>.lora_A.weight": A, ...}; other names are left out."""
    return {f"{PEFT_PREFIX}{n}.weight": t for n, t in named_tensors.items() if is_adapter_name(n)}


def from_peft_state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's adapter file names (with or without the adapter's name, e.g. ".default") -> ours."""
    out = {}
    for n, t in tensors.items():
        if not n.startswith(PEFT_PREFIX) or not n.endswith(".weight"):
            raise ValueError(f"{n!r} is not a PEFT LoRA tensor name (base_model.model.<module>.lora_A.weight)")
        n = n[len(PEFT_PREFIX):-len(".weight")].replace(".lora_A.default", ".lora_A").replace(".lora_B.default",
                                                                                            ".lora_B")
        out[n] = t
    return out


def peft_config(spec: LoRASpec, *, base_model: str | None = None) -> dict:
    """adapter_config.json of `spec` (peft.LoraConfig's fields)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": sorted(spec.modules), "bias": "none", "use_rslora": False, "use_dora": False,
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}}


def save_peft_adapter(adapters: dict[str, torch.Tensor], spec: LoRASpec, path: str | Path, *,
                      base_model: str | None = None) -> Path:
    """Write a PEFT adapter directory from our adapter tensors ({"<module>.lora_A": full tensor, ...}):
    loadable by `peft.PeftModel.from_pretrained(hf_model, path)` and by `load_peft_adapter`."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in peft_state_dict(adapters).items()}
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (path / ADAPTER_CONFIG).write_text(json.dumps(peft_config(spec, base_model=base_model), indent=2) + "\n")
    return path


def read_peft_adapter(path: str | Path) -> tuple[LoRASpec, dict[str, torch.Tensor]]:
    """(its spec, {"<module>.lora_A": tensor, ...}) of a PEFT LoRA adapter directory."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{path} is not a PEFT adapter directory ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    cfg = json.loads((path / ADAPTER_CONFIG).read_text())
    unsupported = [k for k in ("use_rslora", "use_dora") if cfg.get(k)]
    if cfg.get("peft_type", "LORA") != "LORA" or unsupported or cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"{path}: only plain LoRA adapters (one rank and alpha, no rsLoRA/DoRA) can be loaded")
    spec = LoRASpec(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), dropout=float(cfg.get("lora_dropout", 0.0)),
                    target_modules=tuple([cfg["target_modules"]] if isinstance(cfg["target_modules"], str)
                                         else cfg["target_modules"]))
    return spec, from_peft_state_dict(load_file(str(path / ADAPTER_WEIGHTS)))
