"""Where a step's device time goes: torch.profiler around chosen steps (trainer.profile_steps), summarised per stage.

For each profiled step every rank writes, under <run dir>/profile/:
  step<N>_rank<r>.json      per stage (gen, ref, update_actor, ...): wall ms, kernel ms, busy ms (the union of the
                            kernels' intervals), the idle gaps (wall - busy), the kernel count, time by kernel
                            category (gemm, attention, nccl, memcpy, other), the top kernels, and the largest
                            idle gaps with the host operators that launched the kernel after each, and
                            where the stage's code marks phases (the update: forward, loss, backward, optimizer)
                            the kernel and idle time by the phase whose host code launched each kernel;
  step<N>_rank<r>.trace.json.gz   the chrome trace (chrome://tracing, perfetto.dev).
On CUDA the summary also counts the step's synchronising CUDA calls (`host_syncs`: item(), copies to the host,
synchronize()) by call site, the innermost frames of this repository: after each one the device runs dry and
waits for the host to launch again, which is where a launch-bound pass loses its time.

Stages are the StageTimer's: each is annotated with record_function("stage:<name>") and ends with a device
synchronise, so a kernel belongs to the stage whose window holds its start. The attribution reads the chrome
trace (its "kernel" / "gpu_memcpy" / "gpu_memset" events and "user_annotation" ranges share one clock), which is
kineto's stable output format. On CPU there are no kernels: the summary lists the stages' top CPU operators.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
import traceback
import warnings
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

STAGE_PREFIX = "stage:"
PHASE_PREFIX = "phase:"  # record_function ranges inside a stage (its summary's "phases")
AUTOGRAD_PHASE = "backward (autograd thread)"
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# substrings of kernel names, first match wins (lower case)
KERNEL_KINDS = (
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attn", "attention")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul")),
    ("memcpy", ("memcpy", "memset")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels of several streams may overlap)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


class LaunchIndex:
    """Which host operators launched a device event: the cpu_op / user_annotation ranges that hold its launch
    call (a cuda_runtime / cuda_driver event, joined to the kernel by the trace's correlation id)."""

    def __init__(self, events: list[dict]):
        self.launches = {ev.get("args", {}).get("correlation"): ev for ev in events
                         if ev.get("ph") == "X" and ev.get("cat") in ("cuda_runtime", "cuda_driver")}
        self.ops: dict = {}
        for ev in events:
            if ev.get("ph") == "X" and ev.get("cat") in ("cpu_op", "user_annotation"):
                self.ops.setdefault(ev.get("tid"), []).append(ev)
        for ops in self.ops.values():
            ops.sort(key=lambda o: o["ts"])
        self.starts = {tid: [o["ts"] for o in ops] for tid, ops in self.ops.items()}

    def holding(self, device_event: dict) -> list[dict]:
        """The operators holding the event's launch call, outermost first ([] if its launch is not in the trace)."""
        import bisect

        launch = self.launches.get(device_event.get("args", {}).get("correlation"))
        if launch is None:
            return []
        tid, t = launch.get("tid"), launch["ts"]
        ops = self.ops.get(tid, [])
        i = bisect.bisect_right(self.starts.get(tid, []), t)
        return [o for o in ops[max(0, i - 4000):i] if o["ts"] + o["dur"] >= t]

    def chain(self, device_event: dict, depth: int = 3) -> list[str]:
        """Names of the innermost `depth` operators holding the launch, outermost first ([] if unknown)."""
        return [o["name"][:80] for o in self.holding(device_event)[-depth:]]

    def phase(self, device_event: dict) -> str | None:
        """The innermost "phase:<name>" annotation holding the launch (its name); "backward (autograd thread)" for
        a launch by the autograd engine's own thread (where a CUDA backward runs: the caller's phase is not there);
        else None."""
        holding = self.holding(device_event)
        for o in reversed(holding):
            if str(o["name"]).startswith(PHASE_PREFIX):
                return o["name"][len(PHASE_PREFIX):]
        if any(str(o["name"]).startswith("autograd::engine") for o in holding):
            return AUTOGRAD_PHASE
        return None


def phase_times(device: list[dict], index: LaunchIndex) -> dict[str, dict]:
    """Device time and idle time by the phase of the host code that launched each event (record_function
    "phase:<name>" ranges inside a stage, e.g. the update's forward, loss, backward and optimizer): {phase:
    {kernel_ms, kernels, gap_ms, gaps}}, the idle time before an event counted in its launcher's phase (the device
    waited for that host code). The autograd engine's thread (a CUDA backward) is a phase of its own
    (AUTOGRAD_PHASE); events launched outside any phase count under "(other)"."""
    out: dict[str, dict] = {}
    end = None
    for ev in sorted(device, key=lambda e: e["ts"]):
        acc = out.setdefault(index.phase(ev) or "(other)", {"kernel_ms": 0.0, "kernels": 0, "gap_ms": 0.0, "gaps": 0})
        if end is not None and ev["ts"] > end:
            acc["gap_ms"] += (ev["ts"] - end) / 1e3
            acc["gaps"] += 1
        acc["kernel_ms"] += ev["dur"] / 1e3
        acc["kernels"] += 1
        end = max(end or ev["ts"], ev["ts"] + ev["dur"])
    return {k: {**v, "kernel_ms": round(v["kernel_ms"], 3), "gap_ms": round(v["gap_ms"], 3)}
            for k, v in sorted(out.items(), key=lambda kv: -(kv[1]["kernel_ms"] + kv[1]["gap_ms"]))}


def largest_gaps(device: list[dict], index: LaunchIndex, *, top: int = 12, min_us: float = 20.0) -> dict:
    """The device's idle gaps of at least `min_us` between `device` events (kernels, copies), each with the
    kernels around it and the host operators that launched the kernel after it: what the host was doing while
    the device waited. Returns {gap_ms, gaps, by_launcher: [{op, ms, gaps}], top: [{us, before, after,
    launched_by}]}, by_launcher keyed by the innermost launching operator."""
    gaps, end, last = [], None, None
    for s, e, ev in sorted(((ev["ts"], ev["ts"] + ev["dur"], ev) for ev in device), key=lambda r: r[0]):
        if end is not None and s - end >= min_us:
            gaps.append((s - end, last, ev, index.chain(ev)))
        if end is None or e > end:
            end, last = e, ev
    by_launcher: dict[str, list[float]] = {}
    for us, _, _, chain in gaps:
        acc = by_launcher.setdefault(chain[-1] if chain else "(unknown)", [0.0, 0])
        acc[0] += us / 1e3
        acc[1] += 1
    gaps.sort(key=lambda r: -r[0])
    return {"gap_ms": round(sum(g[0] for g in gaps) / 1e3, 3), "gaps": len(gaps),
            "by_launcher": [{"op": k, "ms": round(v[0], 3), "gaps": v[1]}
                            for k, v in sorted(by_launcher.items(), key=lambda kv: -kv[1][0])[:top]],
            "top": [{"us": round(us, 1), "before": b["name"][:80], "after": a["name"][:80], "launched_by": chain}
                    for us, b, a, chain in gaps[:top]]}


def summarise_trace(events: list[dict], *, top: int = 40) -> dict[str, dict]:
    """{stage: summary} from chrome-trace events (ts/dur in microseconds).

    A device event (kernel, memcpy, memset) belongs to the stage whose annotation window holds its start; the
    device events of no stage are reported under "(outside stages)". Without device events (CPU runs) a stage's
    "top" lists its CPU operators by inclusive time instead."""
    stages = sorted(((e["ts"], e["ts"] + e["dur"], e["name"][len(STAGE_PREFIX):]) for e in events
                     if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                     and str(e.get("name", "")).startswith(STAGE_PREFIX)), key=lambda s: s[0])
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    cpu_ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    index = LaunchIndex(events) if device else None

    def owner(ts: float) -> str:
        for s, e, name in stages:
            if s <= ts <= e:
                return name
        return "(outside stages)"

    out: dict[str, dict] = {}
    for s, e, name in stages:
        st = out.setdefault(name, {"wall_ms": 0.0, "windows": []})
        st["wall_ms"] += (e - s) / 1e3
        st["windows"].append((s, e))
    per_stage: dict[str, list[dict]] = {}
    for ev in device:
        per_stage.setdefault(owner(ev["ts"]), []).append(ev)
    for name, evs in per_stage.items():
        st = out.setdefault(name, {"wall_ms": None, "windows": []})
        kinds: dict[str, float] = {}
        by_name: dict[str, list[float]] = {}
        for ev in evs:
            kind = kernel_kind(ev["name"])
            kinds[kind] = kinds.get(kind, 0.0) + ev["dur"] / 1e3
            acc = by_name.setdefault(ev["name"], [0, 0.0])
            acc[0] += 1
            acc[1] += ev["dur"] / 1e3
        kernel_ms = sum(ev["dur"] for ev in evs) / 1e3
        busy = busy_us([(ev["ts"], ev["ts"] + ev["dur"]) for ev in evs]) / 1e3
        st.update(kernel_ms=round(kernel_ms, 3), busy_ms=round(busy, 3), kernels=len(evs),
                  kind_ms={k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
                  top=[{"name": n[:140], "calls": c, "ms": round(ms, 3), "share": round(ms / max(kernel_ms, 1e-9), 4)}
                       for n, (c, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]])
        if st["wall_ms"] is not None:
            st["gaps_ms"] = round(st["wall_ms"] - busy, 3)
        st["largest_gaps"] = largest_gaps(evs, index)
        phases = phase_times(evs, index)
        if set(phases) - {"(other)", AUTOGRAD_PHASE}:  # the stage's code marks phases
            st["phases"] = phases
    if not device:  # CPU: the stages' top-level operators
        for st in out.values():
            ops: dict[str, list[float]] = {}
            for ev in cpu_ops:
                if any(s <= ev["ts"] <= e for s, e in st["windows"]):
                    acc = ops.setdefault(ev["name"], [0, 0.0])
                    acc[0] += 1
                    acc[1] += ev["dur"] / 1e3
            st["top_cpu_ops"] = [{"name": n[:140], "calls": c, "inclusive_ms": round(ms, 3)}
                                 for n, (c, ms) in sorted(ops.items(), key=lambda kv: -kv[1][1])[:top]]
    for st in out.values():
        st.pop("windows", None)
        if st.get("wall_ms") is not None:
            st["wall_ms"] = round(st["wall_ms"], 3)
    return out


SYNC_WARNING = "synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode("warn")'s message
_REPO = str(Path(__file__).resolve().parents[2]) + os.sep


def call_site(stack: list[traceback.FrameSummary], depth: int = 4) -> str:
    """The innermost `depth` frames of this repository in `stack`, innermost first ("file:line fn <- ...")."""
    ours = [f for f in stack if f.filename.startswith(_REPO) and f.filename != __file__]
    return " <- ".join(f"{f.filename[len(_REPO):]}:{f.lineno} {f.name}" for f in reversed(ours[-depth:])) or "(torch)"


@contextmanager
def host_syncs(*, top: int = 25):
    """Counts the synchronising CUDA calls made inside the block, by call site (torch's sync debug mode, whose
    warnings are caught here instead of printed). Yields a dict that holds {total, sites: [{site, calls}]} after
    the block. Calls from threads without a Python frame (the autograd engine's) are not seen."""
    result: dict = {}
    counts: Counter = Counter()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
        show = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING in str(message):
                counts[call_site(traceback.extract_stack()[:-1])] += 1
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield result
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            result.update(total=sum(counts.values()),
                          sites=[{"site": k, "calls": v} for k, v in counts.most_common(top)])


class StepProfiler:
    """Profiles the steps numbered in `steps` (1-based, as metrics.jsonl counts them) on this rank; the loop
    passes its 0-based step index."""

    def __init__(self, steps, *, out_dir: Path, rank: int, device: torch.device):
        self.steps, self.out_dir, self.rank, self.device = set(steps), Path(out_dir), rank, device

    def due(self, step: int) -> bool:
        return step + 1 in self.steps

    @contextmanager
    def around(self, step: int):
        """Profile the body when `step` is due (yields whether it is); writes the summary and the trace after."""
        if not self.due(step):
            yield False
            return
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.synchronize(self.device)
        with profile(activities=activities) as prof, (host_syncs() if cuda else nullcontext({})) as syncs:
            yield True
            if cuda:
                torch.cuda.synchronize(self.device)
        self.write(step, prof, host_syncs=syncs)

    def write(self, step: int, prof, *, host_syncs: dict | None = None) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = f"step{step + 1}_rank{self.rank}"
        fd, raw = tempfile.mkstemp(suffix=".json", dir=self.out_dir)
        os.close(fd)
        try:
            prof.export_chrome_trace(raw)
            with open(raw) as f:
                events = json.load(f).get("traceEvents", [])
            summary = {"step": step + 1, "rank": self.rank, "device": str(self.device),
                       "stages": summarise_trace(events)}
            if host_syncs:
                summary["host_syncs"] = host_syncs
            with open(raw, "rb") as src, gzip.open(self.out_dir / f"{stem}.trace.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        finally:
            os.unlink(raw)
        path = self.out_dir / f"{stem}.json"
        path.write_text(json.dumps(summary, indent=1))
        return path
