"""Shared benchmark helpers: device/dtype arguments, timing, peak memory, the JSON result line.

    from bench.common import add_device_args, resolve_device, emit_json, H200_BF16_FLOPS
    args = add_device_args(argparse.ArgumentParser()).parse_args()
    device, dtype = resolve_device(args)
    ...
    emit_json({"bench": "x", "mfu": flops / s / H200_BF16_FLOPS, **run_info(device)})

The benches' `mfu` fields divide by H200_BF16_FLOPS, the 989 TFLOP/s spec peak (docs/design.md, "FLOPs and
MFU"); rooflines use the measured ceilings (790 TFLOP/s matmul; copy bandwidth per device, `hbm_bytes_per_s`).
Every bench prints exactly one JSON object as its last stdout line (`emit_json`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

H200_BF16_FLOPS = 989e12  # dense bf16 spec peak (ppo.metrics.flops): every bench's `mfu` divides by it
H200_MATMUL_CEILING_FLOPS = 790e12  # dense bf16 matmul, measured: a roofline's ceiling and a second column
H200_HBM_BYTES_PER_S = 4.3e12  # copy bandwidth, measured
# bench.env_check's measured copy bandwidth (`copy_tb_s`) by a substring of the CUDA device's name: the HBM rooflines'
# ceiling on that device (bench/results/env_check_h200.json, env_check_h100.json)
MEASURED_COPY_BYTES_PER_S: tuple[tuple[str, float], ...] = (("H200", H200_HBM_BYTES_PER_S), ("H100", 3.02e12))

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}


@functools.cache
def hbm_bytes_per_s(device_name: str | None = None) -> float:
    """The HBM rooflines' bandwidth: the measured copy bandwidth of `device_name` (default: the current CUDA device).
    A device not in MEASURED_COPY_BYTES_PER_S, the CPU included, gets the H200's, and every record states the figure
    it used (`hbm_bytes_per_s`): measure a new device with bench.env_check before reading its fractions."""
    if device_name is None and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name()
    return next((bw for key, bw in MEASURED_COPY_BYTES_PER_S if key in (device_name or "")), H200_HBM_BYTES_PER_S)


def add_device_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="bfloat16 | float32 (default: bf16 on cuda, fp32 on cpu)")
    return parser


def resolve_device(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """(device, compute dtype) from --device/--dtype; under torchrun the device is cuda:LOCAL_RANK."""
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but torch.cuda.is_available() is False; use --device cpu")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    default = "bfloat16" if device.type == "cuda" else "float32"
    key = (args.dtype or default).lower()
    if key not in DTYPES:
        raise SystemExit(f"--dtype {args.dtype!r} unknown; choose one of {sorted(DTYPES)}")
    return device, DTYPES[key]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float | None:
    """Peak allocated GPU memory since the last reset, in GB (1e9 bytes); None on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 1e9


def time_steps(step: Callable[[], object], *, device: torch.device, warmup: int, steps: int) -> list[float]:
    """Run `step` warmup + steps times; wall seconds of each timed step (device-synchronised)."""
    for _ in range(warmup):
        step()
    synchronize(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


GEMM_KERNELS = ("gemm", "cutlass", "sm90_xmma", "nvjet")  # substrings of cuBLAS / CUTLASS matmul kernel names


def is_gemm(kernel_name: str) -> bool:
    """Whether a CUDA kernel's name is a matmul's (cuBLAS, cuBLASLt's nvjet, CUTLASS)."""
    return any(k in kernel_name.lower() for k in GEMM_KERNELS)


def kernel_profile(step: Callable[[], object], *, device: torch.device, top: int = 15) -> dict:
    """One `step` under torch.profiler: where its device time goes. Returns the step's total kernel time
    and the `top` kernels by total time ({name, calls, ms, share}), plus the GEMM share of the total; on
    CUDA also the span from the first kernel's start to the last one's end, the busy time (union of the
    kernels' intervals) and the largest idle gaps with the host operators that launched the kernel after
    each (ppo.metrics.profiling.largest_gaps)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from ppo.metrics.profiling import DEVICE_CATEGORIES, LaunchIndex, busy_us, largest_gaps

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        step()
        synchronize(device)
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None) if device.type == "cuda" else ev.self_cpu_time_total
        if t and (device.type != "cuda" or ev.device_type.name == "CUDA"):
            rows.append((ev.key, ev.count, t / 1e3))
    total = sum(ms for _, _, ms in rows) or 1.0
    rows.sort(key=lambda r: -r[2])
    gemm = sum(ms for name, _, ms in rows if is_gemm(name))
    out = {"total_kernel_ms": total, "gemm_share": gemm / total,
           "top": [{"name": n[:120], "calls": c, "ms": round(ms, 3), "share": round(ms / total, 4)}
                   for n, c, ms in rows[:top]]}
    if device.type == "cuda":
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            with open(f.name) as trace:
                events = json.load(trace).get("traceEvents", [])
        kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
        if kernels:
            span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
            out.update(span_ms=round(span / 1e3, 3),
                       busy_ms=round(busy_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels]) / 1e3, 3),
                       largest_gaps=largest_gaps(kernels, LaunchIndex(events)))
    return out


def init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world size); starts a process group (under torchrun, or a world of one) if none exists.

    A world of one still gets a real group so size-1 DeviceMeshes (FSDP/TP wrappers) work.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit(root: str = REPO_ROOT) -> str | None:
    """The short commit of the tree a result was measured on, "+dirty" where tracked files differ from it
    (uncommitted edits; or a copy of the tree whose git metadata is older than its files, as the device
    machine's can be). None outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10)
        commit = out.stdout.strip()
        if out.returncode or not commit:
            return None
        diff = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=root, capture_output=True, timeout=30)
        return commit + "+dirty" if diff.returncode == 1 else commit
    except (OSError, subprocess.SubprocessError):
        return None


def git_tree(root: str = REPO_ROOT) -> str | None:
    """The short git id of the tree as its files are (every file git does not ignore): equal to `git log
    --format=%t` of the commit it was measured at when the files are that commit's, whatever the checkout's
    HEAD says. Staged into a scratch index and object store, so the checkout is left as it was. None outside a
    git checkout."""
    try:
        git_dir = subprocess.run(["git", "rev-parse", "--absolute-git-dir"], cwd=root, capture_output=True,
                                 text=True, timeout=10)
        if git_dir.returncode:
            return None
        with tempfile.TemporaryDirectory() as scratch:
            env = {**os.environ, "GIT_INDEX_FILE": os.path.join(scratch, "index"), "GIT_OBJECT_DIRECTORY": scratch,
                   "GIT_ALTERNATE_OBJECT_DIRECTORIES": os.path.join(git_dir.stdout.strip(), "objects")}
            add = subprocess.run(["git", "add", "-A", "."], cwd=root, env=env, capture_output=True, timeout=60)
            out = subprocess.run(["git", "write-tree"], cwd=root, env=env, capture_output=True, text=True, timeout=30)
        if add.returncode or out.returncode:
            return None
        return out.stdout.strip()[:7] or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_info(device: torch.device) -> dict:
    """Where and on what a result was measured (goes into every JSON line)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "git": git_commit(), "git_tree": git_tree(),
            "argv": " ".join(sys.argv[1:])}


def emit_json(result: dict) -> None:
    """Print the result as the single JSON object on the last stdout line."""
    sys.stdout.flush()
    print(json.dumps(result, default=str), flush=True)
