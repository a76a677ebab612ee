"""GPU utilization monitor (NVML) and honest-FLOP helpers.

    mon = GpuMonitor(run_dir / "util.jsonl", interval_s=0.5)
    mon.start()
    with mon.stage("gen"):
        ...                                   # samples taken now are tagged "gen"
    metrics.update(mon.step_summary())        # {"gpu/util_mean": 0.71, "mem/peak_gb": 63.2, ...}
    mon.stop()

A background thread samples every local GPU through nvidia-ml-py (`pynvml`): SM
utilization, memory used/total and power. Each sample becomes one JSON line of
`util.jsonl` (`{"t", "gpu", "stage", "sm_util", "mem_used_gb", "mem_total_gb", "power_w"}`).
`sm_util` is NVML's utilization.gpu in percent: the share of the last sample period in which
at least one kernel ran. It is a busy fraction, not SM occupancy (one tiny kernel reads as
100%), so it exposes idle gaps (stalls between stages) but not under-filled kernels; the
FLOP-based `ppo.metrics.flops.useful_utilization` is the number that does. Lines are buffered and flushed every
`flush_interval_s`, so the training threads never wait on the file system.

Without NVML (CPU machines, no driver) the monitor logs one line
"NVML unavailable: <reason>; GPU monitor off" and every call is a cheap no-op;
`step_summary()` then returns {} and the metrics simply lack the gpu/ keys.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ppo.metrics.flops import spec_peak_flops

log = logging.getLogger(__name__)

_GB = 1e9


def _load_pynvml() -> Any:
    import pynvml  # nvidia-ml-py; imported lazily so CPU-only installs never need it

    return pynvml


def _visible_nvml_indices(count: int) -> list[int]:
    """NVML indices of the GPUs this process can use (CUDA_VISIBLE_DEVICES when numeric)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None or env.strip() == "":
        return list(range(count))
    try:
        idx = [int(x) for x in env.split(",") if x.strip()]
    except ValueError:  # GPU UUIDs or MIG names: NVML order is unknowable from here, sample all
        return list(range(count))
    return [i for i in idx if 0 <= i < count]


def smallest_gpu_memory_gb(*, nvml: Any | None = None) -> float | None:
    """The memory of the smallest GPU this process can use, in GB (1e9), read through NVML, so no CUDA context is
    made before the rank picks its device; None without NVML or a GPU."""
    try:
        nv = nvml if nvml is not None else _load_pynvml()
        nv.nvmlInit()
    except Exception:  # no driver, no library: nothing known
        return None
    try:
        indices = _visible_nvml_indices(int(nv.nvmlDeviceGetCount()))
        sizes = [nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(i)).total / _GB for i in indices]
        return min(sizes) if sizes else None
    finally:
        nv.nvmlShutdown()


class GpuMonitor:
    """Background NVML sampler writing util.jsonl and summarising each step.

    `nvml` injects an object with the pynvml functions (tests use a fake replaying a trace);
    `stage_fn` returns the current stage name, an alternative to `set_stage`/`stage`;
    `tags` (e.g. {"host": "node07"}) are added to every record, and `rank` (the global rank of
    the process running the monitor) as {"rank": rank}, so GPUs of different nodes stay apart.

    One monitor per rank watching its own GPU (`device_indices=[nvml index of local_rank]`,
    `rank=rank`) tags each GPU with the stage *its* rank runs, which is what split
    placement needs; one monitor per node on local rank 0 is cheaper when all ranks run the
    same stage (colocated). `launcher.report` reads every `util*.jsonl` of the run dir.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        interval_s: float = 0.5,
        device_indices: list[int] | None = None,
        stage_fn: Callable[[], str] | None = None,
        nvml: Any | None = None,
        flush_interval_s: float = 5.0,
        tags: dict[str, Any] | None = None,
        rank: int | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.path = Path(path)
        self.interval_s = interval_s
        self.flush_interval_s = flush_interval_s
        self._stage_fn = stage_fn
        self._tags = dict(tags or {})
        if rank is not None:
            self._tags["rank"] = rank
        self._stage = "idle"
        self._clock = clock
        self._lock = threading.Lock()
        self._buffer: list[str] = []
        self._last_flush = 0.0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._fd: int | None = None
        self._reset_summary()
        self.enabled = False
        self.disabled_reason: str | None = None
        self._nvml = None
        self._handles: list[tuple[int, Any]] = []
        self._shut_down = False
        self.sample_failures = 0
        try:
            self._nvml = nvml if nvml is not None else _load_pynvml()
            self._nvml.nvmlInit()
            indices = device_indices
            if indices is None:
                indices = _visible_nvml_indices(int(self._nvml.nvmlDeviceGetCount()))
            if not indices:
                raise RuntimeError("no GPU visible to this process")
            self._handles = [(i, self._nvml.nvmlDeviceGetHandleByIndex(i)) for i in indices]
            self.enabled = True
        except Exception as err:  # noqa: BLE001 - ImportError, NVMLError, driver missing: all mean "off"
            self.disabled_reason = f"{type(err).__name__}: {err}"
            log.warning("NVML unavailable: %s; GPU monitor off", self.disabled_reason)

    # ---- stage tagging ----
    def set_stage(self, name: str) -> None:
        self._stage = name  # a str assignment is atomic under the GIL; the sampler reads it lock-free

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        prev = self._stage
        self._stage = name
        try:
            yield
        finally:
            self._stage = prev

    @property
    def current_stage(self) -> str:
        return self._stage_fn() if self._stage_fn is not None else self._stage

    # ---- lifecycle ----
    def start(self) -> GpuMonitor:
        if not self.enabled or self._thread is not None:
            return self
        if self._shut_down:
            raise RuntimeError("GpuMonitor was stopped (NVML shut down); create a new GpuMonitor to sample again")
        self._last_flush = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpu-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10 * self.interval_s + 5)
            self._thread = None
        self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.enabled and not self._shut_down:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._shut_down = True  # stays enabled: step_summary() still reports the last samples

    def __enter__(self) -> GpuMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        failures = 0
        while True:
            stopping = self._stop.wait(self.interval_s)  # one last sample on stop: short runs get a reading
            try:
                self.sample_once()
            except Exception as err:  # noqa: BLE001 - a flaky read must not kill training
                failures += 1
                if failures == 1:  # warn once; a lost GPU would otherwise log twice a second
                    log.warning("GPU monitor sample failed (further failures are counted, not logged): %s", err)
            if stopping:
                break
            if time.monotonic() - self._last_flush >= self.flush_interval_s:
                self.flush()
        self.sample_failures = failures

    # ---- sampling ----
    def sample_once(self) -> list[dict[str, Any]]:
        """Read every GPU once, buffer the JSON lines, update the step aggregates."""
        if not self.enabled or self._shut_down:
            return []
        nv = self._nvml
        t = self._clock()
        stage = self.current_stage
        records = []
        for idx, h in self._handles:
            util = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            try:
                power_w = nv.nvmlDeviceGetPowerUsage(h) / 1000.0  # NVML reports milliwatts
            except Exception:  # noqa: BLE001 - some boards (and MIG slices) do not expose power
                power_w = None
            records.append({"t": round(t, 4), "gpu": idx, "stage": stage, "sm_util": util,
                            "mem_used_gb": round(mem.used / _GB, 4), "mem_total_gb": round(mem.total / _GB, 4),
                            "power_w": power_w, **self._tags})
        lines = [json.dumps(r) for r in records]
        with self._lock:
            self._buffer.extend(lines)
            for r in records:
                self._n += 1
                self._util_sum += r["sm_util"]
                self._peak_gb = max(self._peak_gb, r["mem_used_gb"])
                self._peak_frac = max(self._peak_frac, r["mem_used_gb"] / max(r["mem_total_gb"], 1e-9))
                if r["power_w"] is not None:
                    self._power_sum += r["power_w"]
                    self._power_n += 1
                for acc, key in ((self._stage_util, r["stage"]), (self._gpu_util, r["gpu"])):
                    s = acc.setdefault(key, [0.0, 0])
                    s[0] += r["sm_util"]
                    s[1] += 1
        return records

    def flush(self) -> None:
        with self._lock:
            lines, self._buffer = self._buffer, []
        if lines:
            if self._fd is None:  # opened on first data, so a monitor that never sampled leaves no file
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            # one O_APPEND write of whole lines: monitors of several ranks can share a file on a
            # local file system without interleaving (use one file per node on NFS/Lustre)
            data = ("\n".join(lines) + "\n").encode()
            while data:
                data = data[os.write(self._fd, data):]
        self._last_flush = time.monotonic()

    def _reset_summary(self) -> None:
        self._n = 0
        self._util_sum = 0.0
        self._peak_gb = 0.0
        self._peak_frac = 0.0
        self._power_sum = 0.0
        self._power_n = 0
        self._stage_util: dict[str, list] = {}
        self._gpu_util: dict[int, list] = {}

    def step_summary(self) -> dict[str, float]:
        """Aggregates over the samples since the previous call (one PPO step).

        Keys: gpu/util_mean (fraction 0..1, mean over samples and GPUs), gpu/util_mean/<stage>,
        gpu/<index>/util_mean (one GPU: in split placement the pools idle differently), mem/peak_gb
        and mem/peak_frac (max used over GPUs, as NVML sees it: includes the caching allocator's
        reserve), power/mean_w. {} when off or no sample was taken since the last call.
        """
        if not self.enabled:
            return {}
        with self._lock:
            if self._n == 0:
                return {}
            out = {"gpu/util_mean": self._util_sum / self._n / 100.0, "mem/peak_gb": self._peak_gb,
                   "mem/peak_frac": self._peak_frac}
            if self._power_n:
                out["power/mean_w"] = self._power_sum / self._power_n
            for name, (s, n) in sorted(self._stage_util.items()):
                out[f"gpu/util_mean/{name}"] = s / n / 100.0
            for idx, (s, n) in sorted(self._gpu_util.items()):
                out[f"gpu/{idx}/util_mean"] = s / n / 100.0
            self._reset_summary()
        return out


def _matmul_tflops(seconds: float, *, n: int = 8192) -> float:
    """Sustained bf16 matmul TFLOP/s on the current CUDA device for about `seconds`."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    iters, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):  # enqueue in chunks so the host clock check never starves the GPU
            a @ b
        iters += 20
        torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launcher.monitor", description="GpuMonitor self-check")
    ap.add_argument("--seconds", type=float, default=3.0, help="length of each timed phase")
    ap.add_argument("--interval", type=float, default=0.5, help="sampling interval (s)")
    ap.add_argument("--load", action="store_true", help="measure overhead under a bf16 matmul load on GPU 0")
    ap.add_argument("--out", default="/tmp/hybridrl_monitor_selfcheck.jsonl")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mon = GpuMonitor(args.out, interval_s=args.interval)
    if not mon.enabled:
        print(json.dumps({"metric": "monitor_selfcheck", "nvml": False, "reason": mon.disabled_reason}))
        return 0
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        mon.sample_once()
    sample_s = (time.perf_counter() - t0) / n
    mon.step_summary()
    out: dict[str, Any] = {"metric": "monitor_selfcheck", "nvml": True, "n_gpus": len(mon._handles),
                           "sample_ms": round(sample_s * 1e3, 4), "interval_s": args.interval,
                           "sampler_cpu_frac": round(sample_s / args.interval, 6)}
    mon.stop()
    if args.load:
        # the load runs on CUDA device 0 only: watch that GPU, so the mean is not diluted by idle ones
        _matmul_tflops(1.0)  # warm-up: clocks ramp and cuBLAS picks its kernel
        off_before = _matmul_tflops(args.seconds)
        with GpuMonitor(args.out, interval_s=args.interval, device_indices=[mon._handles[0][0]]) as busy:
            with busy.stage("matmul"):
                on = _matmul_tflops(args.seconds)
        off = (off_before + _matmul_tflops(args.seconds)) / 2  # off-on-off: cancels a slow clock drift
        summary = busy.step_summary()
        import torch

        peak = spec_peak_flops(torch.cuda.get_device_name(0))
        out.update({"matmul_tflops_monitor_off": round(off, 1), "matmul_tflops_monitor_on": round(on, 1),
                    "overhead_frac": round(1 - on / off, 4),
                    "frac_of_spec_peak": None if peak is None else round(on * 1e12 / peak, 4),
                    "util_mean_under_load": summary.get("gpu/util_mean/matmul"),
                    "mem_peak_gb": summary.get("mem/peak_gb")})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
