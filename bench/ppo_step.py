"""One PPO/GRPO workload through the real launcher, summarised as one JSON line.

    python -m bench.ppo_step --config conf/bench_grpo_1b.yaml --nproc 1
    python -m bench.ppo_step --config conf/bench_ppo_1b.yaml --nproc 2 placement.mode=split
    python -m bench.ppo_step --config conf/ppo_tiny.yaml --nproc 2 trainer.device=cpu trainer.total_steps=3

Runs `torchrun launcher/main.py` (so every number comes from the production step loop), drops the
first `--warmup` steps (CUDA graph capture, allocator growth), and averages the rest of
metrics.jsonl: stage timings, samples/s, tokens/s (total and per GPU), the actor update's MFU,
useful utilization (counted model FLOPs of the whole step / time / (GPUs x the device's spec peak,
ppo.metrics.flops.spec_peak_flops)), NVML utilization and peak memory. samples/s and tokens/s are samples
(tokens) over the measured steps' wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class _Terminated(Exception):
    pass


def _raise_terminated(signum, frame):
    raise _Terminated(signal.Signals(signum).name)


def run_session(cmd: list[str], *, env: dict | None = None, timeout: float) -> tuple[str | None, str]:
    """Run `cmd` in a session of its own and return (error or None, its stderr). The whole tree is killed when
    `timeout` passes or when this process gets SIGTERM (a GPU batch's own time limit): torchrun's workers would
    otherwise outlive the bench and keep the GPU from the next one. After a SIGTERM the caller still summarises
    the steps that finished."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    try:
        _, stderr = proc.communicate(timeout=timeout)
        return (f"exit {proc.returncode}" if proc.returncode else None), stderr
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout} s"
    except _Terminated as e:
        error = f"terminated by {e}"
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _, stderr = proc.communicate()
    return error, stderr


def run_workload(config: str, *, nproc: int, overrides: list[str], warmup: int = 1, runs_dir: str | None = None,
                 name: str = "bench", timeout: int = 1800) -> dict:
    runs = Path(runs_dir or tempfile.mkdtemp(prefix="hybridrl_bench_"))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "launcher" / "main.py"), config, f"trainer.runs_dir={runs}",
           f"trainer.experiment_name={name}", "trainer.overwrite=true",
           # no final checkpoint: a 1B PPO run writes ~12 GB, and a GPU batch of runs filled a 128 GB disk
           "trainer.save_final=false", *overrides]
    t0 = time.perf_counter()
    error, stderr = run_session(cmd, env=env, timeout=timeout)
    wall = time.perf_counter() - t0
    run_dir = runs / name
    metrics = run_dir / "metrics.jsonl"
    from launcher.report import metric_rows, read_jsonl

    # a step re-run after a restart: its last row supersedes the first one
    rows = metric_rows(read_jsonl(metrics)) if metrics.exists() else []
    if error is not None:
        # the steps that finished still say something (e.g. the step before an OOM): summarised beside the error
        out = {"ok": False, "error": error, "stderr_tail": (stderr or "")[-3000:], "cmd": " ".join(cmd),
               "wall_s": round(wall, 1), "steps_done": len(rows),
               "warnings": _warnings(run_dir) if run_dir.exists() else []}
        if rows:
            out["partial"] = _summary(rows, warmup=warmup, nproc=nproc, run_dir=run_dir)
        return out
    out = {"ok": True, "wall_s": round(wall, 1), "nproc": nproc}
    out.update(_summary(rows, warmup=warmup, nproc=nproc, run_dir=run_dir))
    return out


def over_wall_time(rows: list[dict], rate_key: str) -> float | None:
    """Samples (or tokens) over the wall time of the steps, from each row's per-step rate and step time:
    sum(rate_i * t_i) / sum(t_i), not the mean of the per-step rates (a slow step weighs by its time)."""
    rows = [r for r in rows if r.get(rate_key) is not None and r.get("timing_s/step")]
    seconds = sum(r["timing_s/step"] for r in rows)
    return sum(r[rate_key] * r["timing_s/step"] for r in rows) / seconds if seconds > 0 else None


def _summary(rows: list[dict], *, warmup: int, nproc: int, run_dir: Path) -> dict:
    """Means over the measured steps (all steps when there are no more than `warmup`). `compiled_steps` lists the
    steps (1-based) in which torch.compile compiled a graph: a measured one among them paid a recompile (e.g. the
    training forward's second packed length arriving after the warm-up), and `samples_per_s_no_compile` is the
    rate over the measured steps that did not. Rates are samples (tokens) over the steps' wall time."""
    first = warmup if len(rows) > warmup else 0
    measured = rows[first:]
    graphs = [0] + [r.get("compile/graphs") or 0 for r in rows]  # cumulative per step, after a 0 before step 1
    compiled = [i for i in range(1, len(graphs)) if graphs[i] > graphs[i - 1]]
    clean = [r for i, r in enumerate(rows[first:], start=first + 1)
             if i not in compiled and r.get("perf/samples_per_s") is not None]
    keys = sorted({k for r in measured for k in r})
    mean = {k: sum(r[k] for r in measured if r.get(k) is not None) / max(1, sum(r.get(k) is not None
                                                                               for r in measured))
            for k in keys}
    plan = json.loads((run_dir / "plan.json").read_text())
    out = {"steps_measured": len(measured), "compiled_steps": compiled,
           "samples_per_s_no_compile": over_wall_time(clean, "perf/samples_per_s"),
           "placement": plan["mode"], "groups": {r: g["ranks"] for r, g in plan["groups"].items()},
           "samples_per_s": over_wall_time(measured, "perf/samples_per_s"),
           # trainer.max_staleness K >= 1: the last K steps train batches generated ahead and generate none, so a
           # short run's rate flatters K; this is the rate over the measured steps that generated (the steady state)
           "samples_per_s_steady": over_wall_time([r for r in measured if r.get("async/generated_tokens", 1) > 0],
                                                  "perf/samples_per_s"),
           "tokens_per_s": over_wall_time(measured, "perf/tokens_per_s"),
           "tokens_per_s_per_gpu": (over_wall_time(measured, "perf/tokens_per_s") or 0) / nproc,
           "mfu_actor": mean.get("perf/mfu/actor"), "useful_util": mean.get("perf/useful_util"),
           "nvml_util": mean.get("gpu/util_mean"), "peak_mem_gb": mean.get("mem/peak_gb"),
           "nvml_mem_peak_gb": mean.get("gpu/mem_peak_gb"),
           # host memory of the busiest rank (GiB): resident now, and its peak over the whole run
           "host_rss_gb": mean.get("mem/host_rss_gb"),
           "host_peak_gb": max((r.get("mem/host_peak_gb") or 0.0 for r in rows), default=None),
           "nvml_util_per_gpu": [v for k, v in sorted(mean.items(), key=lambda kv: _gpu_index(kv[0]))
                                 if _gpu_index(k) >= 0],
           "step_s": mean.get("timing_s/step"), "reward_mean": mean.get("reward/mean"),
           # Python's garbage collector stalling the host inside the step (trainer.gc_freeze keeps them short)
           "gc_s": mean.get("host/gc_s"), "gc_full": mean.get("host/gc_full"),
           "optimizer_step_s": mean.get("actor/optimizer_step_s"),  # clip + step, inside timing_s/update_actor
           "response_length": mean.get("response_length/mean"),
           "timing_s": {k.split("/", 1)[1]: round(v, 4) for k, v in mean.items() if k.startswith("timing_s/")},
           "rollout_logprob_diff_max": mean.get("rollout/logprob_diff_max"),
           # bytes handed to the engine per update (metrics.jsonl's reshard/engine_bytes), every step (a LoRA actor
           # with actor.lora.sync adapters: the base in the first, the adapters alone after), and the sync mode chosen
           "engine_bytes": [r.get("reshard/engine_bytes") for r in rows], "lora_sync": _lora_sync(run_dir),
           # engine vs trainer mismatch (algorithm.rollout_correction) and DAPO sampling, step means
           "rollout_corr": {k.split("/", 1)[1]: v for k, v in mean.items() if k.startswith("rollout_corr/")},
           "dapo": {k.split("/", 1)[1]: v for k, v in mean.items() if k.startswith("dapo/")},
           # trainer.max_staleness: the version gap (its max over every step), tokens sampled per step
           "staleness_max": max((r["async/staleness_max"] for r in rows if "async/staleness_max" in r), default=None),
           "async": {k.split("/", 1)[1]: v for k, v in mean.items() if k.startswith("async/")},
           # extremes over every step (warm-up included): exactly 1.0 when the update is on-policy
           "actor_ratio_min": min((r["actor/ratio_min"] for r in rows if "actor/ratio_min" in r), default=None),
           "actor_ratio_max": max((r["actor/ratio_max"] for r in rows if "actor/ratio_max" in r), default=None),
           "controller": {k: v for k, v in mean.items() if k.startswith("controller/")},
           "run_dir": str(run_dir), "warnings": _warnings(run_dir),
           "generate_memory": _generate_memory(run_dir), "gc_freezes": _gc_freezes(run_dir),
           # the timeline: every step's stages (warm-up included), GPU and host memory
           "per_step": [{"step_s": r.get("timing_s/step"), "peak_mem_gb": r.get("mem/peak_gb"),
                         "host_rss_gb": r.get("mem/host_rss_gb"), "optimizer_step_s": r.get("actor/optimizer_step_s"),
                         "samples_per_s": r.get("perf/samples_per_s"), "gc_s": r.get("host/gc_s"),
                         "timing_s": {k.split("/", 1)[1]: round(v, 3) for k, v in r.items()
                                      if k.startswith("timing_s/") and k != "timing_s/step"}} for r in rows]}
    return out


def _lora_sync(run_dir: Path) -> str | None:
    """The actor.lora.sync mode rank 0 logged (ppo.roles.generation: "actor.lora.sync=adapters (auto: ...)"), None
    without LoRA."""
    log = run_dir / "logs" / "rank_0.log"
    m = re.search(r"actor\.lora\.sync=(\w+)", log.read_text()) if log.exists() else None
    return m.group(1) if m else None


def _gpu_index(key: str) -> int:
    """The GPU index of a per-GPU monitor key "gpu/<index>/util_mean", else -1."""
    parts = key.split("/")
    per_gpu = len(parts) == 3 and parts[0] == "gpu" and parts[1].isdigit() and parts[2] == "util_mean"
    return int(parts[1]) if per_gpu else -1


def _rank0_records(run_dir: Path, marker: str) -> list[str]:
    """The text after `marker` of every line of rank 0's log that holds it ([] without a log)."""
    log = run_dir / "logs" / "rank_0.log"
    if not log.exists():
        return []
    return [ln.split(marker, 1)[1].strip() for ln in log.read_text(errors="replace").splitlines() if marker in ln]


def _generate_memory(run_dir: Path) -> list[str]:
    """Rank 0's last hybrid-engine cycle, phase by phase (release training state, gather, wake_up, ...,
    restore), from its log: GPU memory allocated / reserved / peak in GB and seconds into the cycle."""
    lines = _rank0_records(run_dir, " hybrid ")
    starts = [i for i, ln in enumerate(lines) if ln.startswith("start ")]
    return lines[starts[-1]:] if starts else []


def _gc_freezes(run_dir: Path) -> list[str]:
    """Rank 0's trainer.gc_freeze records: after which step, how many objects, and how long the full collection
    before the freeze took (what one of Python's automatic full collections costs at that point)."""
    return [r for r in _rank0_records(run_dir, " gc: ") if r.startswith("after step")]


def _warnings(run_dir: Path, limit: int = 12) -> list[str]:
    """Distinct WARNING lines of the ranks' logs (fallbacks, OOM retries), without timestamps."""
    seen: list[str] = []
    for log in sorted((run_dir / "logs").glob("rank_*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "WARNING" in line:
                msg = line.split("WARNING", 1)[1].strip()[:300]
                if msg not in seen:
                    seen.append(msg)
    return seen[:limit]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.ppo_step", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--runs-dir", default=None)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds before the run is killed (its row says so)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    from bench.common import git_commit, git_tree
    from ppo.metrics.flops import spec_peak_flops

    result = run_workload(args.config, nproc=args.nproc, overrides=args.overrides, warmup=args.warmup,
                          runs_dir=args.runs_dir, timeout=args.timeout)
    import torch

    result.update(bench="ppo_step", config=args.config, overrides=args.overrides, git_commit=git_commit(),
                  git_tree=git_tree(), gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  peak_flops_per_gpu=spec_peak_flops(torch.cuda.get_device_name())
                  if torch.cuda.is_available() else None)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
