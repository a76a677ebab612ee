"""Hugging Face checkpoint I/O: config.json + safetensors (single file or sharded with an index).

    model = load_pretrained("/ckpt/Qwen2-0.5B", dtype=torch.bfloat16, device="cuda")
    save_pretrained(model, "runs/x/checkpoints/step_10/actor")   # AutoModelForCausalLM loads it

`load_tensors` reads only the requested tensors, and of each only the requested slice, through
`safe_open(...).get_slice`, so a TP/PP rank never reads (or holds) the whole model.

Mixture-of-experts checkpoints (Qwen3-MoE) hold one tensor per expert (`mlp.experts.<e>.gate_proj.weight`,
`up_proj`, `down_proj`), as the Hub and vLLM have them; the model keeps each layer's experts stacked
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I], transformers 5's in-memory names).
`tensor_shapes` and `load_tensors` show a checkpoint under the stacked names (a slice reads only its experts'
tensors), and `save_tensors` writes stacked tensors back one per expert.

Tied embeddings (Qwen2-0.5B style): checkpoints hold no `lm_head.weight`. A full model shares one
parameter; a pipeline stage that has `lm_head` but no `embed_tokens` holds its own copy, which
`load_tensors` fills from `model.embed_tokens.weight` when config.json says the weights are tied.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from models.config import ModelConfig, ModelConfigError
from models.llama import LlamaForCausalLM, init_weights

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"

SliceFn = Callable[[str, tuple[int, ...]], "tuple[slice, ...] | None"]


# ---------------------------------------------------------------- reading
def read_config(path: str | os.PathLike) -> ModelConfig:
    """ModelConfig of the checkpoint directory `path` (its config.json)."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise ModelConfigError(
            f"no {CONFIG_FILE} in {path}: point at a Hugging Face model directory (config.json + *.safetensors)"
        )
    try:
        with open(file) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{file} is not valid JSON ({e}); restore it from the model's source") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{file} holds a JSON {type(raw).__name__}, not an object of config fields")
    return ModelConfig.from_hf(raw)


def checkpoint_index(path: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it (sharded checkpoints via model.safetensors.index.json)."""
    root = Path(path)
    if root.is_file():
        files = [root]
    elif (root / INDEX_FILE).is_file():
        with open(root / INDEX_FILE) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: root / file for name, file in weight_map.items()}
    elif (root / SINGLE_FILE).is_file():
        files = [root / SINGLE_FILE]
    else:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise ModelConfigError(f"no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors in {path}")
    index: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            index.update({name: file for name in f.keys()})
    return index


_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(.+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def stacked_experts(names: Iterable[str]) -> dict[str, list[list[str]]]:
    """Per-expert checkpoint names -> {stacked name: for each expert in order, the names it stacks}
    (gate_up_proj: [gate, up] rows of expert e; down_proj: [down])."""
    found: dict[str, dict[int, dict[str, str]]] = {}
    for n in names:
        if m := _EXPERT.match(n):
            found.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = n
    out = {}
    for prefix, experts in found.items():
        order = [experts[e] for e in range(len(experts))]
        if sorted(experts) != list(range(len(experts))) or any(len(x) != 3 for x in order):
            raise ModelConfigError(f"{prefix}: experts {sorted(experts)[:8]} ... are not 0..{len(experts) - 1} each "
                                   "with gate_proj, up_proj and down_proj")
        out[f"{prefix}.gate_up_proj"] = [[x["gate_proj"], x["up_proj"]] for x in order]
        out[f"{prefix}.down_proj"] = [[x["down_proj"]] for x in order]
    return out


def unstack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked expert tensors -> one tensor per expert under the checkpoint's names (other tensors as they are)."""
    out = {}
    for name, t in tensors.items():
        m = _STACKED.match(name)
        if m is None or t.dim() != 3:
            out[name] = t
            continue
        for e in range(t.shape[0]):
            if m[2] == "down_proj":
                out[f"{m[1]}.{e}.down_proj.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2, dim=0)
                out[f"{m[1]}.{e}.gate_proj.weight"], out[f"{m[1]}.{e}.up_proj.weight"] = gate, up
    return out


def tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Name -> full shape of every tensor in the checkpoint (reads headers only); per-expert tensors appear
    stacked (see the module docstring)."""
    by_file: dict[Path, list[str]] = {}
    for name, file in checkpoint_index(path).items():
        by_file.setdefault(file, []).append(name)
    shapes = {}
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in names})
    for stacked, parts in stacked_experts(shapes).items():
        rows = sum(shapes[n][0] for n in parts[0])
        shapes[stacked] = (len(parts), rows, *shapes[parts[0][0]][1:])
        for n in (n for part in parts for n in part):
            del shapes[n]
    return shapes


def _tied(path: Path) -> bool:
    cfg_file = (path if path.is_dir() else path.parent) / CONFIG_FILE
    if not cfg_file.is_file():
        return False
    with open(cfg_file) as f:
        return bool(json.load(f).get("tie_word_embeddings", False))


def load_tensors(
    path: str | os.PathLike,
    *,
    names: Iterable[str] | None = None,
    slices: SliceFn | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Read tensors `names` (default: all) of a safetensors checkpoint; of each only the part
    `slices(name, full_shape)` selects (None -> the whole tensor). Floating tensors are cast to `dtype`.

    A request for `lm_head.weight` in a tied-embedding checkpoint (no such tensor, config.json
    tie_word_embeddings=true) returns the embedding under that name (the last pipeline stage's copy).
    """
    root = Path(path)
    index = checkpoint_index(root)
    wanted = list(index) if names is None else list(dict.fromkeys(names))
    stacked = stacked_experts(index) if names is not None else {}
    out: dict[str, torch.Tensor] = {}
    for name in [n for n in wanted if n in stacked and n not in index]:
        out[name] = _load_stacked(root, stacked[name], slices, name, dtype=dtype, device=device)
        wanted.remove(name)
    source = {n: n for n in wanted if n in index}
    if LM_HEAD in wanted and LM_HEAD not in index and EMBED in index and _tied(root):
        source[LM_HEAD] = EMBED
    missing = [n for n in wanted if n not in source]
    if missing:
        raise ModelConfigError(
            f"{len(missing)} tensor(s) not in checkpoint {path} ({len(index)} tensors): {missing[:10]}"
            + (" ..." if len(missing) > 10 else "")
        )
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(index[source[name]], []).append(name)
    for file, file_names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in file_names:
                part = f.get_slice(source[name])
                idx = slices(name, tuple(part.get_shape())) if slices is not None else None
                t = part[idx] if idx is not None else part[:]
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                out[name] = t.to(device)
    return out


def _load_stacked(root: Path, parts: list[list[str]], slices: SliceFn | None, name: str, *,
                  dtype: torch.dtype | None, device) -> torch.Tensor:
    """One stacked expert tensor [E, rows, cols] (of it, the part `slices` selects), reading only the experts
    in the slice's first dimension."""
    first = load_tensors(root, names=parts[0])
    shape = (len(parts), sum(t.shape[0] for t in first.values()), *next(iter(first.values())).shape[1:])
    idx = slices(name, shape) if slices is not None else None
    experts = range(len(parts))[idx[0]] if idx is not None else range(len(parts))
    names = [n for e in experts for n in parts[e]]
    tensors = load_tensors(root, names=names, dtype=dtype)
    t = torch.stack([torch.cat([tensors[n] for n in parts[e]]) for e in experts])
    if idx is not None:
        t = t[(slice(None), *idx[1:])]
    return t.to(device)


# ---------------------------------------------------------------- loading into models
def _own_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict names, with a parameter shared under two names (tied lm_head) listed once."""
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _full_names(model_cls: type[nn.Module], cfg: ModelConfig) -> set[str]:
    with torch.device("meta"):
        return set(_own_tensors(model_cls(cfg)))


def load_weights(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> None:
    """Fill `model` (a full model or a pipeline stage with some layers / embed / head removed; plain
    tensors, not DTensors) in place from checkpoint `path`, casting to each parameter's dtype.

    strict: missing or unexpected names raise (listed). Names in the class's `checkpoint_init_if_missing`
    (a critic's score head) are initialised by `model.init_missing(names)`, names in `checkpoint_ignore`
    are skipped. strict=False initialises other missing modules with `init_weights` and skips unexpected
    names.
    """
    cfg: ModelConfig = model.config
    own = _own_tensors(model)
    shapes = tensor_shapes(path)
    if LM_HEAD not in shapes and EMBED in shapes and cfg.tie_word_embeddings:
        shapes[LM_HEAD] = shapes[EMBED]  # a pipeline stage's own copy of the tied head
    ignore = set(getattr(model, "checkpoint_ignore", ())) | ({LM_HEAD} if cfg.tie_word_embeddings else set())
    init_ok = set(getattr(model, "checkpoint_init_if_missing", ()))
    missing = [n for n in own if n not in shapes]
    unexpected = sorted(n for n in set(shapes) - _full_names(type(model), cfg) - ignore
                        if not n.endswith("rotary_emb.inv_freq"))  # old Llama checkpoints stored the RoPE table
    hard_missing = [n for n in missing if n not in init_ok]
    if strict and (hard_missing or unexpected):
        raise ModelConfigError(
            f"checkpoint {path} does not match {type(model).__name__}: missing {hard_missing[:10]}"
            f"{' ...' if len(hard_missing) > 10 else ''} ({len(hard_missing)}), unexpected {unexpected[:10]}"
            f"{' ...' if len(unexpected) > 10 else ''} ({len(unexpected)}); check model_cls and config.json, "
            "or pass strict=False to initialise missing weights randomly"
        )
    for name in own:
        if name in shapes and tuple(own[name].shape) != shapes[name]:
            raise ModelConfigError(
                f"tensor {name}: checkpoint shape {list(shapes[name])} != model shape {list(own[name].shape)}; "
                f"config.json of {path} does not describe this checkpoint"
            )
    if missing:
        if init_ok & set(missing):
            model.init_missing(sorted(init_ok & set(missing)))
        for name in hard_missing:
            init_weights(model.get_submodule(name.rpartition(".")[0]))
    index = checkpoint_index(path)
    stacked = stacked_experts(index)
    by_file: dict[Path, list[str]] = {}
    for name in own:
        if name in shapes:  # a tied head's stage copy lives under the embedding's name on disk
            on_disk = name if name in index else stacked[name][0][0] if name in stacked else EMBED
            by_file.setdefault(index[on_disk], []).append(name)
    with torch.no_grad():
        for names in by_file.values():  # one shard at a time: host memory peaks at one file, not the model
            for name, t in load_tensors(path, names=names).items():
                own[name].copy_(t)


def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    model_cls: type[nn.Module] = LlamaForCausalLM,
    strict: bool = True,
) -> nn.Module:
    """Build `model_cls(read_config(path))` directly in `dtype` on `device` (via the meta device, no
    random init of a 7B model) and load its weights. model_cls: LlamaForCausalLM, LlamaForValue,
    LlamaForSequenceClassification."""
    cfg = read_config(path)
    with torch.device("meta"):
        model = model_cls(cfg)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # to_empty made two parameters of the shared one
    load_weights(model, path, strict=strict)
    return model


# ---------------------------------------------------------------- saving
def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def save_pretrained(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    max_shard_size_bytes: int = 5_000_000_000,
    dtype: torch.dtype | None = None,
    extra_files: Iterable[str | os.PathLike] = (),
) -> Path:
    """Write `model` (a full, non-DTensor model) as a Hugging Face directory; see `save_tensors`."""
    tensors = {n: t.detach() for n, t in _own_tensors(model).items()}
    expected = _full_names(type(model), model.config)
    if model.config.tie_word_embeddings:
        tensors.pop(LM_HEAD, None)
        expected.discard(LM_HEAD)
    if set(tensors) != expected:
        absent = sorted(expected - set(tensors))
        raise ModelConfigError(
            f"save_pretrained needs the whole model; {len(absent)} tensors absent (e.g. {absent[:4]}): gather "
            "pipeline stages / TP shards into full tensors and call save_tensors"
        )
    arch = getattr(model, "hf_architecture", "ForCausalLM")
    return save_tensors(tensors, model.config, path, architecture=arch, max_shard_size_bytes=max_shard_size_bytes,
                        dtype=dtype, extra_files=extra_files)


def save_tensors(
    tensors: dict[str, torch.Tensor],
    config: ModelConfig,
    path: str | os.PathLike,
    *,
    architecture: str = "ForCausalLM",
    max_shard_size_bytes: int = 5_000_000_000,
    dtype: torch.dtype | None = None,
    extra_files: Iterable[str | os.PathLike] = (),
) -> Path:
    """Write full tensors in HF names + config.json to directory `path`, atomically: everything goes to a
    temporary sibling that is renamed into place, so a crash never leaves a half-written `path`. An
    existing model directory at `path` is replaced. Over `max_shard_size_bytes` the weights are split into
    model-0000i-of-0000n.safetensors + model.safetensors.index.json. `extra_files` (tokenizer files) are
    copied in. Floating tensors are cast to `dtype` when given."""
    final = Path(path)
    if final.exists() and (not final.is_dir() or (any(final.iterdir()) and not (final / CONFIG_FILE).exists())):
        raise FileExistsError(f"{final} exists and is not a model directory; refusing to replace it")
    cpu = {}
    for name, t in tensors.items():
        if _is_dtensor(t):
            raise ModelConfigError(f"{name} is a DTensor: gather it with .full_tensor() before saving")
        t = t.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        cpu[name] = t.contiguous()
    if config.tie_word_embeddings and LM_HEAD in cpu:
        # state merged from pipeline stages carries the last stage's copy of the tied head: it must
        # still equal the embedding, else the two copies' gradients were never summed
        if EMBED in cpu and not torch.equal(cpu[LM_HEAD], cpu[EMBED]):
            diff = (cpu[LM_HEAD].float() - cpu[EMBED].float()).abs().max().item()
            raise ModelConfigError(
                f"tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight (max |diff| "
                f"{diff:.3g}): with pp > 1 all-reduce the tied weight's gradient between the first and last stage "
                "(or untie the config); refusing to write a checkpoint that silently drops one copy"
            )
        del cpu[LM_HEAD]  # HF tied checkpoints carry the embedding only
    cpu = {n: t.contiguous() for n, t in unstack_experts(cpu).items()}  # one tensor per expert on disk
    shards = _plan_shards(cpu, max_shard_size_bytes)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        cfg = config.to_hf(architecture=architecture)
        floats = [t.dtype for t in cpu.values() if t.is_floating_point()]
        if floats:
            cfg["dtype"] = str(floats[0]).removeprefix("torch.")
        _write_file(tmp / CONFIG_FILE, json.dumps(cfg, indent=2, sort_keys=True).encode())
        weight_map = {}
        for i, names in enumerate(shards):
            file = SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: cpu[n] for n in names}, str(tmp / file), metadata={"format": "pt"})
            fsync_path(tmp / file)
            weight_map.update({n: file for n in names})
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for t in cpu.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            _write_file(tmp / INDEX_FILE, json.dumps(index, indent=2).encode())
        for extra in extra_files:
            shutil.copy2(extra, tmp / Path(extra).name)
        _replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _plan_shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Greedy in name order: a new shard starts when the next tensor would pass `max_bytes`."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def fsync_path(file: Path) -> None:
    """fsync a file or a directory (a directory's entries: a rename inside it becomes durable)."""
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(file: Path, data: bytes) -> None:
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _replace_dir(tmp: Path, final: Path) -> None:
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    if final.exists():
        os.rename(final, old)  # two renames: POSIX cannot atomically swap a non-empty directory
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
