"""This rank's measurements: wall time per stage (StageTimer) and host memory (host_memory_gb)."""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch


class StageTimer:
    """Wall time per stage on this rank (device-synchronised), tagged into the GPU monitor."""

    def __init__(self, device: torch.device, monitor=None, on_stage=None, annotate: bool = False):
        """annotate: mark each stage as a profiler range "stage:<name>" (ppo.metrics.profiling reads it)."""
        self.device, self.monitor, self.on_stage, self.annotate = device, monitor, on_stage, annotate
        self.times: dict[str, float] = {}
        self.starts: dict[str, float] = {}  # perf_counter() at each stage's first start

    @contextmanager
    def __call__(self, name: str, *, sync: bool = True):
        """sync=False: the stage ends when its host work does (kernels it enqueued may still run; a later
        stage that waits for them counts that wait)."""
        if self.monitor is not None:
            self.monitor.set_stage(name)
        if self.on_stage is not None:  # the watchdog's heartbeat names the stage a stalled rank was in
            self.on_stage(name)
        t0 = time.perf_counter()
        self.starts.setdefault(name, t0)
        rf = torch.profiler.record_function(f"stage:{name}") if self.annotate else nullcontext()
        try:
            with rf:  # the synchronise inside the range: the stage's last kernels start within it
                try:
                    yield
                finally:
                    if sync and self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
            if self.monitor is not None:
                self.monitor.set_stage("idle")

    def carve(self, name: str, part: str, seconds: float) -> None:
        """Report `seconds` of stage `name` as stage `part` instead (e.g. the reshard inside gen)."""
        self.times[name] = self.times.get(name, 0.0) - seconds
        self.times[part] = self.times.get(part, 0.0) + seconds


class DeviceSpan:
    """The device time of the work enqueued inside `with span:` (CUDA events; 0 elsewhere, where work runs as
    it is enqueued). seconds() waits for that work."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None

    def __enter__(self) -> DeviceSpan:
        if self._events is not None:
            self._events[0].record()
        return self

    def __exit__(self, *exc) -> None:
        if self._events is not None:
            self._events[1].record()

    def seconds(self) -> float:
        if self._events is None:
            return 0.0
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1e3


def host_memory_gb() -> dict[str, float]:
    """{"host_rss_gb": resident set now, "host_peak_gb": its peak so far} of this process (Linux /proc and
    getrusage; pinned host buffers are resident, so offloaded optimizer states count)."""
    import resource

    page = resource.getpagesize()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * page
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return {"host_rss_gb": rss / 2**30, "host_peak_gb": max(peak, rss) / 2**30}


def compiled_graphs() -> int:
    """Graphs torch.compile (Dynamo) has compiled in this process so far: a step that raises the count paid
    for a compile or recompile (e.g. the training forward's first step with a new packed length)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
