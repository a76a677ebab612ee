"""Atomic, resumable checkpoints: `<run_dir>/checkpoints/step_N/`.

    save_checkpoint(run_dir, step, rank=rank, world_size=world, per_rank_state={"optim": opt.state_dict(),
                    "rng": capture_rng_state()}, shared_state={"sampler": ..., "controller": ctl.state_dict()},
                    model_states={"actor": full_actor_sd}, model_configs={"actor": cfg.to_hf()}, keep_last=3)
    ckpt = find_latest_checkpoint(run_dir)          # None, or the newest *complete* step_N
    per_rank, shared = load_checkpoint(ckpt, rank=rank)

Layout of a complete checkpoint:

    step_N/COMPLETE                 manifest (JSON: step, world_size, roles, every file's size and SHA-256)
    step_N/shared.pt                rank 0's shared state (sampler position, KL/batch controllers, step, ...)
    step_N/rank_<r>.pt              each rank's own state (optimizer shard, RNG states, ...); native runner
                                    states name each shard's place in its full tensor, so another layout
                                    can load them (ppo/run/relayout.py)
    step_N/<role>/config.json       a Hugging Face directory per model role (actor/, critic/, ...):
    step_N/<role>/model*.safetensors  full weights in HF names, sharded like save_pretrained
    step_N/actor_adapter/           a LoRA actor's PEFT adapter directory (its actor/ holds the merged weights)

Protocol (all ranks call `save_checkpoint`): rank 0 clears debris of an earlier crashed save;
barrier; every rank creates `step_N.tmp-staging/` and writes and fsyncs its files there;
barrier; rank 0 checks all rank files arrived, writes the manifest last, fsyncs and renames
the directory to `step_N` (rename is atomic on POSIX); barrier. A crash anywhere before the
rename leaves only a `*.tmp-*` directory, which is never picked and is removed by the next
successful save; existing checkpoints are never touched except by `keep_last` pruning of
older ones. Multi-node runs need `run_dir` on a shared file system. A rank that fails
mid-save leaves the others waiting in the barrier until the process group's timeout ends
the job; the previous checkpoint stays intact.

Loading checks the files it reads against the manifest's sizes and SHA-256 (`verify_checkpoint`;
each rank hashed its own file when saving) and unpickles with `weights_only=True`, so per-rank
state holds tensors and plain containers only (RNG states included); anything else raises
CheckpointError. Choosing among damaged checkpoints is ppo/run/resume.py's job.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from models.config import ModelConfig
from models.hf_io import fsync_path, save_tensors

MANIFEST = "COMPLETE"
FORMAT_VERSION = 2  # 2: files carry {"size", "sha256"} (1: sizes only, still readable)
_STEP_RE = re.compile(r"^step_(\d+)$")


ADAPTER_ROLE = "actor_adapter"  # a LoRA actor's adapters: adapter_config.json + adapter_model.safetensors

class CheckpointError(Exception):
    """A checkpoint that is damaged (a file missing, truncated or with other content than the
    manifest's checksum) or unsafe to unpickle. `path` and `reason` say which and why."""

    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(f"checkpoint {path}: {reason}")
        self.path, self.reason = Path(path), reason


# ---- RNG ----
def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and (when present) every CUDA device's RNG state."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    name, keys, pos, has_gauss, cached = np.random.get_state()
    # plain types only: per-rank state is loaded with torch.load(weights_only=True)
    state["numpy"] = (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        keys = keys.numpy().astype(np.uint32) if isinstance(keys, torch.Tensor) else keys
        np.random.set_state((name, keys, pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        for i in range(min(len(cuda), torch.cuda.device_count())):
            torch.cuda.set_rng_state(cuda[i], device=i)


# ---- file helpers ----
def _torch_save_synced(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def sha256_file(path: str | os.PathLike, *, chunk: int = 16 * 2**20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def hf_weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of an HF directory; raises FileNotFoundError naming what is missing."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [f for f in files if not (d / f).exists()]
        if missing:
            raise FileNotFoundError(f"{d}: shards listed in model.safetensors.index.json are missing: {missing}")
        return [d / f for f in files]
    if (d / "model.safetensors").exists():
        return [d / "model.safetensors"]
    raise FileNotFoundError(f"{d}: no model.safetensors or model.safetensors.index.json")


def load_hf_weights(model_dir: str | os.PathLike, *, device: str = "cpu") -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in hf_weight_files(model_dir):
        state.update(load_file(str(f), device=device))
    return state


# ---- discovery ----
def read_manifest(path: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of a complete checkpoint, or None when it is incomplete or damaged."""
    p = Path(path)
    try:
        manifest = json.loads((p / MANIFEST).read_text())
        for rel, entry in manifest["files"].items():
            if (p / rel).stat().st_size != _size_of(entry):
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return manifest


def _size_of(entry: Any) -> int:
    return entry["size"] if isinstance(entry, dict) else entry


def verify_checkpoint(path: str | os.PathLike, *, files: list[str] | None = None) -> str | None:
    """Why the checkpoint (or the given files of it) is damaged, or None when every file is
    present with its manifest size and SHA-256. Reads the files (content checksums)."""
    p = Path(path)
    try:
        manifest = json.loads((p / MANIFEST).read_text())
        listed = manifest["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} manifest (the save never finished, or the manifest was deleted)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {MANIFEST} manifest ({type(e).__name__}: {e})"
    for rel in files if files is not None else sorted(listed):
        entry = listed.get(rel)
        if entry is None:
            return f"{rel} is not listed in the manifest"
        f = p / rel
        if not f.exists():
            return f"{rel} is missing"
        size = f.stat().st_size
        if size != _size_of(entry):
            return f"{rel} has {size} bytes, the manifest says {_size_of(entry)} (truncated or overwritten)"
        if isinstance(entry, dict) and entry.get("sha256") and sha256_file(f) != entry["sha256"]:
            return f"{rel} has other content than when it was saved (SHA-256 mismatch)"
    return None


def step_dirs(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Every `step_N` directory of a run, complete or not, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name)))


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run (manifest present, sizes match), oldest first."""
    return [p for _, p in step_dirs(run_dir) if read_manifest(p) is not None]


def find_latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


# ---- save ----
def _default_barrier(world_size: int, group: Any) -> Callable[[], None]:
    if world_size == 1:
        return lambda: None
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(f"save_checkpoint with world_size={world_size} needs torch.distributed initialised "
                           "or an explicit barrier= callable")
    return lambda: dist.barrier(group=group)


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    rank: int,
    world_size: int,
    per_rank_state: dict[str, Any],
    shared_state: dict[str, Any] | None = None,
    model_states: dict[str, dict[str, torch.Tensor]] | None = None,
    model_configs: dict[str, dict[str, Any]] | None = None,
    group: Any = None,
    barrier: Callable[[], None] | None = None,
    keep_last: int | None = None,
    max_shard_bytes: int = 5 * 2**30,
    export: Callable[[Path], list[str]] | None = None,
) -> Path:
    """Collective: every rank of `group` calls it. Returns the final `step_N` path.

    `per_rank_state` is written by each rank; `shared_state`, `model_states` ({role: full state
    dict in HF names}) and `model_configs` ({role: HF config.json dict}) only by rank 0 (other
    ranks' values are ignored). `export(staging_dir) -> roles` is called on every rank (a collective
    export of parallelized models, each role's directory written by whichever rank holds it) and
    returns the same list of roles it wrote on every rank. `barrier` defaults to `dist.barrier(group)`;
    `keep_last` keeps the newest K complete checkpoints (never fewer than 1).
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last({keep_last}) must be >= 1: the newest complete checkpoint is never deleted")
    barrier = barrier or _default_barrier(world_size, group)
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step}"
    # one staging name every rank knows without communicating (pids differ per rank) and without
    # listing directories (NFS caches listings; mkdir and open by name go to the server)
    tmp = root / f"step_{step}.tmp-staging"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"step_{step}.tmp-*"):  # left by a crashed save of this step
            shutil.rmtree(stale)
    barrier()
    tmp.mkdir(parents=True, exist_ok=True)
    _torch_save_synced(per_rank_state, tmp / f"rank_{rank}.pt")
    # each rank hashes its own file (in parallel); rank 0 folds the digests into the manifest
    (tmp / f"rank_{rank}.pt.sha256").write_text(sha256_file(tmp / f"rank_{rank}.pt"))
    if rank == 0:
        _torch_save_synced(shared_state or {}, tmp / "shared.pt")
        for role, sd in (model_states or {}).items():
            _save_role(sd, tmp / role, config=(model_configs or {}).get(role), max_shard_bytes=max_shard_bytes)
    exported = export(tmp) if export is not None else []
    barrier()
    if rank == 0:
        missing = [r for r in range(world_size) if not (tmp / f"rank_{r}.pt").exists()]
        if missing:
            raise RuntimeError(f"checkpoint step {step}: rank files {missing} missing from {tmp}; "
                               "is run_dir on a file system shared by all nodes?")
        _write_manifest(tmp, step=step, world_size=world_size, roles=sorted({*(model_states or {}), *exported}))
        for d in [p for p in tmp.rglob("*") if p.is_dir()] + [tmp]:
            fsync_path(d)
        if final.exists():  # re-saving a step (resumed before it): swap, then drop the old copy
            old = root / f"step_{step}.old-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_path(root)
        _prune(root, keep_last=keep_last)
    barrier()  # nobody proceeds (or resumes) before step_N exists
    return final


def _save_role(state: dict[str, torch.Tensor], out: Path, *, config: dict[str, Any] | None,
               max_shard_bytes: int) -> None:
    """One role's HF directory through models.hf_io.save_tensors (the one writer the loaders are tested
    against), from the role's HF config.json dict."""
    if config is None:
        raise ValueError(f"model_states[{out.name!r}] needs its HF config in model_configs")
    arch = (config.get("architectures") or ["ForCausalLM"])[0]
    arch = arch[arch.index("For"):] if "For" in arch else "ForCausalLM"  # LlamaForCausalLM -> ForCausalLM
    save_tensors(state, ModelConfig.from_hf(config), out, architecture=arch, max_shard_size_bytes=max_shard_bytes)
    for f in [p for p in out.rglob("*") if p.is_file()]:
        _fsync_file(f)


def _write_manifest(tmp: Path, *, step: int, world_size: int, roles: list[str]) -> None:
    digests = {}
    for side in tmp.glob("rank_*.pt.sha256"):
        digests[side.name[: -len(".sha256")]] = side.read_text().strip()
        side.unlink()
    files = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            rel = str(p.relative_to(tmp))
            files[rel] = {"size": p.stat().st_size, "sha256": digests.get(rel) or sha256_file(p)}
    manifest = {"format_version": FORMAT_VERSION, "step": step, "world_size": world_size, "roles": roles,
                "time": time.time(), "files": files}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _prune(root: Path, *, keep_last: int | None) -> None:
    # staging dirs of crashed saves (this save is renamed already) and copies left by an interrupted swap
    for stale in [*root.glob("step_*.tmp-*"), *root.glob("step_*.old-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    if keep_last is None:
        return
    for old in list_checkpoints(root.parent)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def seal_directory(path: str | os.PathLike) -> None:
    """A manifest (every file's size and SHA-256) for a directory a resume reads beside the checkpoints: the SFT
    warm-up's reference weights (`<run>/sft_warmup`). Rank 0, after the directory is written."""
    p = Path(path)
    _write_manifest(p, step=-1, world_size=0, roles=[p.name])
    fsync_path(p)


def verify_sealed(path: str | os.PathLike) -> None:
    """Raise CheckpointError when a sealed directory's files differ from its manifest (a directory written before
    directories were sealed has none: accepted)."""
    p = Path(path)
    if not (p / MANIFEST).exists():
        return
    if (reason := verify_checkpoint(p)) is not None:
        raise CheckpointError(p, reason)


# ---- load ----
def load_checkpoint(path: str | os.PathLike, *, rank: int, map_location: str = "cpu") -> tuple[dict, dict]:
    """-> (this rank's per_rank_state, shared_state) of a complete checkpoint."""
    p = Path(path)
    manifest = read_manifest(p)
    if manifest is None:
        raise FileNotFoundError(f"{p} is not a complete checkpoint (no valid {MANIFEST} manifest); "
                                "use find_latest_checkpoint(run_dir) to pick the newest complete one")
    if rank >= manifest["world_size"]:
        raise ValueError(f"{p} was written by {manifest['world_size']} ranks, cannot load rank {rank}: per-rank "
                         f"state (optimizer shards, RNG) needs the same world size; resume with "
                         f"{manifest['world_size']} ranks, or start a new run from the exported HF weights")
    files = [f"rank_{rank}.pt", "shared.pt"]
    reason = verify_checkpoint(p, files=files)
    if reason is not None:
        raise CheckpointError(p, reason)
    return tuple(safe_torch_load(p / f, map_location=map_location) for f in files)


def checkpoint_world_size(path: str | os.PathLike) -> int:
    """The number of ranks that wrote a complete checkpoint."""
    manifest = read_manifest(path)
    if manifest is None:
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no valid {MANIFEST} manifest)")
    return int(manifest["world_size"])


def load_shared_state(path: str | os.PathLike, *, map_location: str = "cpu") -> dict:
    """rank 0's shared state (sampler position, controllers, step, layout) of a complete checkpoint, checksummed."""
    p = Path(path)
    checkpoint_world_size(p)
    if (reason := verify_checkpoint(p, files=["shared.pt"])) is not None:
        raise CheckpointError(p, reason)
    return safe_torch_load(p / "shared.pt", map_location=map_location)


def load_rank_states(path: str | os.PathLike, *, world_size: int) -> list[dict]:
    """Every saved rank's per-rank state, memory-mapped (a rank resuming onto another layout touches only the
    shards it needs). Sizes are checked against the manifest here; their SHA-256 was checked when the checkpoint
    was selected (ppo/run/resume.py spreads the rank files over the resuming ranks)."""
    p = Path(path)
    if read_manifest(p) is None:
        raise FileNotFoundError(f"{p} is not a complete checkpoint (no valid {MANIFEST} manifest)")
    return [safe_torch_load(p / f"rank_{r}.pt", mmap=True) for r in range(world_size)]


def safe_torch_load(path: Path, *, map_location: str = "cpu", mmap: bool = False) -> Any:
    """torch.load with weights_only=True: tensors and plain containers only, so a crafted file
    cannot run code when it is unpickled (a checkpoint is data, never a program)."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(path.parent, f"refusing to unpickle {path.name}: it holds objects other than tensors "
                                           f"and plain containers, which could run code on load "
                                           f"(torch.load weights_only=True said: {first})") from None


def load_model_state(path: str | os.PathLike, role: str, *, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Full state dict (HF names) of one model role of a complete checkpoint."""
    p = Path(path)
    manifest = read_manifest(p)
    if manifest is None:
        raise FileNotFoundError(f"{p} is not a complete checkpoint (no valid {MANIFEST} manifest)")
    if role not in manifest["roles"]:
        raise KeyError(f"{p} has no {role!r} weights; roles saved: {manifest['roles']}")
    reason = verify_checkpoint(p, files=[f for f in manifest["files"] if f.startswith(role + "/")])
    if reason is not None:
        raise CheckpointError(p, reason)
    return load_hf_weights(p / role, device=device)
