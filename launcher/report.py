"""PNG reports of a run directory (headless matplotlib).

    python -m launcher.report runs/<name> [--out DIR]

Reads `metrics.jsonl` (one JSON object per step, docs/design.md "Contracts") and `util.jsonl`
(GpuMonitor samples; also `util.<anything>.jsonl` files of per-rank/per-node monitors) and writes:
  utilization.png  SM utilization and memory per GPU over time, stage bands shaded; mean
                   utilization and time share of every stage
  stages.png       stacked time per stage for every step (timing_s/<stage>), step total as dots
  throughput.png   perf/samples_per_s, perf/tokens_per_s (and MFU, GPU util when logged) over steps;
                   the actor MFU panel is left out of runs without a GPU (a FLOP rate against the
                   H200's peak means nothing there), with a note in the figure
  reward.png       reward/mean over steps (with a moving average)
  validation.png   val/reward/mean and val/pass@k over steps, overall and per data source
A missing input file or metric skips that plot with a message; a run dir that does not exist
exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: no display on cluster nodes
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

# fixed stage order and colours so every report reads the same (docs/design.md stage names)
STAGES = ["gen", "reshard", "old_log_prob", "ref", "reward", "values", "adv", "update_actor", "update_critic"]
_CMAP = plt.get_cmap("tab10")
STAGE_COLORS = {s: _CMAP(i % 10) for i, s in enumerate(STAGES)}


def _stage_color(name: str) -> Any:
    if name not in STAGE_COLORS:
        STAGE_COLORS[name] = plt.get_cmap("Set3")(len(STAGE_COLORS) % 12)
    return STAGE_COLORS[name]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file; a torn last line (run killed mid-write) is skipped."""
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def metric_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step, the last written winning, in step order: a step re-run after a restart
    supersedes the row its first attempt wrote (a resume also moves such rows to
    metrics.superseded.jsonl; this keeps older or copied files right too)."""
    by_step: dict[Any, dict[str, Any]] = {}
    for r in rows:
        by_step[r.get("step")] = r
    return sorted(by_step.values(), key=lambda r: (r.get("step") is None, r.get("step") or 0))


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for i, r in enumerate(rows):
        v = r.get(key)
        if isinstance(v, int | float):
            xs.append(r.get("step", i))
            ys.append(v)
    return xs, ys


def stage_spans(times: list[float], stages: list[str]) -> list[tuple[float, float, str]]:
    """Contiguous runs of equal stage tags -> [(t_start, t_end, stage)], each run ending at the next start."""
    spans: list[tuple[float, float, str]] = []
    for i, (t, s) in enumerate(zip(times, stages)):
        if spans and spans[-1][2] == s:
            continue
        if spans:
            spans[-1] = (spans[-1][0], t, spans[-1][2])
        spans.append((t, times[i], s))
    if spans:
        spans[-1] = (spans[-1][0], times[-1], spans[-1][2])
    return spans


def gpu_label(r: dict[str, Any]) -> str:
    """'GPU 3'; 'node07 GPU 3' or 'rank 11 GPU 3' when samples carry host / rank tags (multi-node)."""
    if "host" in r:
        return f"{r['host']} GPU {r['gpu']}"
    return f"rank {r['rank']} GPU {r['gpu']}" if "rank" in r else f"GPU {r['gpu']}"


def plot_utilization(util: list[dict[str, Any]], out: Path) -> None:
    t0 = min(r["t"] for r in util)
    series: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(util, key=lambda r: r["t"]):
        series.setdefault(gpu_label(r), []).append(r)
    labels = sorted(series, key=lambda k: (series[k][0].get("host", ""), series[k][0].get("rank", -1),
                                          series[k][0]["gpu"]))
    many = len(labels) > 16  # a 64-GPU run: keep the lines, drop the per-GPU legend
    fig = plt.figure(figsize=(12, 9))
    grid = fig.add_gridspec(3, 1, height_ratios=[2, 1, 1.1])
    ax_u = fig.add_subplot(grid[0])
    ax_m = fig.add_subplot(grid[1], sharex=ax_u)
    ax_s = fig.add_subplot(grid[2])
    for k in labels:
        ts = [r["t"] - t0 for r in series[k]]
        ax_u.plot(ts, [r["sm_util"] for r in series[k]], lw=0.6 if many else 1.0, label=None if many else k)
        ax_m.plot(ts, [r["mem_used_gb"] for r in series[k]], lw=0.6 if many else 1.0)
    # stage bands from the first GPU's samples (under split placement other GPUs may run other stages)
    ref = series[labels[0]]
    spans = stage_spans([r["t"] - t0 for r in ref], [r.get("stage", "?") for r in ref])
    for a, b, s in spans:
        if s in ("idle", "?"):
            continue
        for ax in (ax_u, ax_m):
            ax.axvspan(a, b, color=_stage_color(s), alpha=0.18, lw=0)
    shown = sorted({s for _, _, s in spans if s not in ("idle", "?")},
                   key=lambda s: (STAGES.index(s) if s in STAGES else len(STAGES), s))
    handles, _ = ax_u.get_legend_handles_labels()
    handles += [Patch(color=_stage_color(s), alpha=0.35, label=s) for s in shown]
    ax_u.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    mean = sum(r["sm_util"] for r in util) / len(util)
    ax_u.set_title(f"SM utilization of {len(labels)} GPU(s) (mean {mean:.0f}%), stages of {labels[0]} shaded")
    ax_u.set_ylabel("SM util (%)")
    ax_u.set_ylim(0, 105)
    total = max(r.get("mem_total_gb", 0.0) for r in util)
    ax_m.set_ylabel("memory used (GB)")
    if total:
        ax_m.axhline(total, color="k", ls="--", lw=0.8)
        ax_m.set_ylim(0, total * 1.05)
    ax_m.set_xlabel("time since first sample (s)")
    plot_stage_util(util, ax_s)
    for ax in (ax_u, ax_m):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def stage_util(util: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """{stage: (mean SM util %, share of samples)} over all GPUs, each sample under its own tag."""
    acc: dict[str, list[float]] = {}
    for r in util:
        acc.setdefault(r.get("stage", "?"), []).append(r["sm_util"])
    return {s: (sum(v) / len(v), len(v) / len(util)) for s, v in acc.items()}


def plot_stage_util(util: list[dict[str, Any]], ax: Any) -> None:
    """Horizontal bars: how busy the GPUs are in each stage, and how much of the time it takes."""
    stats = stage_util(util)
    order = sorted(stats, key=lambda s: (STAGES.index(s) if s in STAGES else len(STAGES), s))
    ys = list(range(len(order)))[::-1]
    ax.barh(ys, [stats[s][0] for s in order], color=["0.7" if s in ("idle", "?") else _stage_color(s) for s in order])
    for y, s in zip(ys, order):
        ax.text(stats[s][0] + 1, y, f"{stats[s][0]:.0f}%  ({100 * stats[s][1]:.0f}% of time)", va="center",
                fontsize=8)
    ax.set_yticks(ys, order, fontsize=8)
    ax.set_xlim(0, 125)
    ax.set_xlabel("mean SM util (%) while in stage")
    ax.grid(alpha=0.3, axis="x")


def plot_stages(metrics: list[dict[str, Any]], out: Path) -> bool:
    keys = {k[len("timing_s/"):] for r in metrics for k in r if k.startswith("timing_s/")} - {"step"}
    stages = [s for s in STAGES if s in keys] + sorted(keys - set(STAGES))
    if not stages:
        return False
    steps = [r.get("step", i) for i, r in enumerate(metrics)]
    fig, ax = plt.subplots(figsize=(12, 5))
    bottom = [0.0] * len(metrics)
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    width = 0.8 * min(gaps) if gaps else 0.8  # steps may be logged every k-th step
    for s in stages:
        vals = [float(r.get(f"timing_s/{s}", 0.0) or 0.0) for r in metrics]
        ax.bar(steps, vals, bottom=bottom, width=width, color=_stage_color(s), label=s, lw=0)
        bottom = [b + v for b, v in zip(bottom, vals)]
    xs, ys = _series(metrics, "timing_s/step")
    if xs:
        ax.plot(xs, ys, "k.", ms=5, label="step total (wall)")
    tot = sum(bottom) or 1.0
    share = {s: sum(float(r.get(f"timing_s/{s}", 0) or 0) for r in metrics) / tot for s in stages}
    top = ", ".join(f"{s} {100 * v:.0f}%" for s, v in sorted(share.items(), key=lambda kv: -kv[1])[:4])
    ax.set_title(f"time per stage per step (largest shares: {top})", fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("seconds")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def ran_on_gpu(metrics: list[dict[str, Any]]) -> bool:
    """The trainer records mem/peak_gb (torch's CUDA peak) every step on a GPU, never on a CPU."""
    return any("mem/peak_gb" in r for r in metrics)


def plot_throughput(metrics: list[dict[str, Any]], out: Path) -> bool:
    gpu = ran_on_gpu(metrics)
    panels = [(k, lbl) for k, lbl in (("perf/samples_per_s", "samples / s"), ("perf/tokens_per_s", "tokens / s"),
                                      ("perf/mfu/actor", "actor MFU"), ("gpu/util_mean", "GPU util (step mean)"))
              if _series(metrics, k)[0] and (gpu or k != "perf/mfu/actor")]
    if not panels:
        return False
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.8 * len(panels)), sharex=True, squeeze=False)
    if not gpu and _series(metrics, "perf/mfu/actor")[0]:
        note = "actor MFU not shown: this run had no GPU (MFU is counted against the H200's bf16 peak)"
        fig.text(0.01, 0.005, note, fontsize=8, color="0.35")
        print(f"{out.name}: {note}")
    for ax, (key, label) in zip(axes[:, 0], panels):
        xs, ys = _series(metrics, key)
        ax.plot(xs, ys, marker="o", ms=3, lw=1.2)
        ax.set_ylabel(label)
        ax.set_title(f"{key}: mean {sum(ys) / len(ys):.4g}, last {ys[-1]:.4g}", fontsize=10)
        ax.set_ylim(0, max(max(ys) * 1.1, 1e-9))
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def plot_reward(metrics: list[dict[str, Any]], out: Path, *, window: int = 10) -> bool:
    xs, ys = _series(metrics, "reward/mean")
    if not xs:
        return False
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.plot(xs, ys, marker="o", ms=3, lw=1.0, alpha=0.6, label="reward/mean")
    if len(ys) >= 3:
        w = min(window, len(ys))
        avg = [sum(ys[max(0, i - w + 1):i + 1]) / (i + 1 - max(0, i - w + 1)) for i in range(len(ys))]
        ax.plot(xs, avg, lw=2.2, label=f"moving average ({w} steps)")
    ax.set_title(f"reward/mean: first {ys[0]:.3f}, last {ys[-1]:.3f}, best {max(ys):.3f}")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("mean reward")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def plot_validation(metrics: list[dict[str, Any]], out: Path) -> bool:
    """One panel for val/reward/mean, one for each pass@k: the overall curve bold, each data source thin."""
    def wanted(k: str) -> bool:  # not val/reward/<extra key>/mean nor val/response_length/mean
        return k.startswith("val/") and (k.endswith("/reward/mean") or k.rsplit("/", 1)[-1].startswith("pass@")) \
            and (k == "val/reward/mean" or not k.startswith("val/reward/"))

    keys = sorted({k for r in metrics for k in r if wanted(k)})
    stats = sorted({k.rsplit("/", 1)[-1] if "pass@" in k else "reward/mean" for k in keys},
                   key=lambda s: (s != "reward/mean", len(s), s))
    if not stats:
        return False
    fig, axes = plt.subplots(len(stats), 1, figsize=(10, 3.2 * len(stats)), sharex=True, squeeze=False)
    for ax, stat in zip(axes[:, 0], stats):
        for key in [k for k in keys if k.endswith("/" + stat)]:
            xs, ys = _series(metrics, key)
            overall = key == f"val/{stat}"
            label = "all" if overall else key[len("val/"):-len(stat) - 1]
            ax.plot(xs, ys, marker="o", ms=3, lw=2.2 if overall else 1.0, label=f"{label} (last {ys[-1]:.3f})")
        ax.set_ylabel(f"val {stat}")
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
    axes[0, 0].set_title("validation (data.val_files) per data source")
    axes[-1, 0].set_xlabel("step (0: before training)")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def render_report(run_dir: str | Path, *, out_dir: str | Path | None = None) -> list[Path]:
    """Write every PNG whose inputs exist; returns the written paths (skips are printed)."""
    run = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    metrics_path = run / "metrics.jsonl"
    util = [r for p in sorted(run.glob("util*.jsonl")) for r in read_jsonl(p)
            if isinstance(r.get("t"), int | float) and "gpu" in r and "sm_util" in r]
    if util:
        plot_utilization(util, out / "utilization.png")
        written.append(out / "utilization.png")
    else:
        print(f"skip utilization.png: no util*.jsonl samples in {run} (GPU monitor off: no NVML on this run?)")
    metrics = metric_rows(read_jsonl(metrics_path)) if metrics_path.exists() else []
    if not metrics:
        print(f"skip stages.png, throughput.png, reward.png: {metrics_path} missing or empty")
        return written
    for name, fn, need in (("stages.png", plot_stages, "timing_s/<stage>"),
                           ("throughput.png", plot_throughput, "perf/samples_per_s or perf/tokens_per_s"),
                           ("reward.png", plot_reward, "reward/mean"),
                           ("validation.png", plot_validation, "val/reward/mean (set data.val_files)")):
        if fn(metrics, out / name):
            written.append(out / name)
        else:
            print(f"skip {name}: no {need} values in {metrics_path}")
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launcher.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="runs/<experiment_name>")
    ap.add_argument("--out", default=None, help="where to write the PNGs (default: the run dir)")
    args = ap.parse_args(argv)
    if not Path(args.run_dir).is_dir():
        print(f"error: run directory {args.run_dir} does not exist (expected runs/<trainer.experiment_name>)",
              file=sys.stderr)
        return 2
    for p in render_report(args.run_dir, out_dir=args.out):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
