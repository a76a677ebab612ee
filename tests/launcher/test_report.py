"""launcher.report on synthetic run directories."""

import json
import math
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg

from launcher.report import main, read_jsonl, render_report, stage_spans, stage_util

ROOT = Path(__file__).resolve().parents[2]
STAGE_TIMES = {"gen": 4.0, "reshard": 0.3, "old_log_prob": 0.8, "ref": 0.7, "reward": 0.2, "values": 0.6,
               "adv": 0.05, "update_actor": 2.5, "update_critic": 2.0}


def make_run(d: Path, *, steps=30, util=True, reward=True, torn=False) -> Path:
    d.mkdir(parents=True)
    rows = []
    for s in range(1, steps + 1):
        r = {"step": s, "response_length/mean": 100 + s, "actor/pg_loss": -0.01 * s}
        if reward:
            r["reward/mean"] = 0.2 + 0.6 * (1 - math.exp(-s / 10)) + 0.03 * math.sin(s)
        r.update({f"timing_s/{k}": v * (1 + 0.05 * math.sin(s + i)) for i, (k, v) in enumerate(STAGE_TIMES.items())})
        r["timing_s/step"] = sum(v for k, v in r.items() if k.startswith("timing_s/")) + 0.4
        r["perf/samples_per_s"] = 256 / r["timing_s/step"]
        r["perf/tokens_per_s"] = 256 * 600 / r["timing_s/step"]
        rows.append(r)
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    if torn:
        text += '{"step": 31, "reward/me'
    (d / "metrics.jsonl").write_text(text)
    if util:
        lines, t = [], 1000.0
        for _ in range(3):
            for stage, dur in STAGE_TIMES.items():
                for k in range(max(1, int(dur / 0.5))):
                    for g in range(2):
                        busy = {"gen": 45, "update_actor": 92, "update_critic": 88}.get(stage, 70)
                        lines.append(json.dumps({"t": t, "gpu": g, "stage": stage, "sm_util": busy - 7 * g + k % 3,
                                                 "mem_used_gb": 40 + 30 * (stage.startswith("update")) + g,
                                                 "mem_total_gb": 141.0, "power_w": 500.0}))
                    t += 0.5
        (d / "util.jsonl").write_text("\n".join(lines) + "\n")
    return d


def test_full_report_renders_four_readable_pngs(tmp_path, capsys):
    run = make_run(tmp_path / "runs" / "demo", torn=True)
    written = render_report(run)
    assert sorted(p.name for p in written) == ["reward.png", "stages.png", "throughput.png", "utilization.png"]
    for p in written:
        img = mpimg.imread(p)
        assert img.shape[0] > 300 and img.shape[1] > 800 and img.std() > 0.05  # not blank
    skips = [line for line in capsys.readouterr().out.splitlines() if "skip" in line]
    assert skips == [f"skip validation.png: no val/reward/mean (set data.val_files) values in {run}/metrics.jsonl"]


def test_missing_inputs_are_skipped_with_a_message(tmp_path, capsys):
    run = make_run(tmp_path / "r", util=False, reward=False)
    written = render_report(run, out_dir=tmp_path / "png")
    assert sorted(p.name for p in written) == ["stages.png", "throughput.png"]
    out = capsys.readouterr().out
    assert "skip utilization.png: no util*.jsonl" in out and "skip reward.png: no reward/mean" in out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert render_report(empty) == []
    assert "metrics.jsonl missing or empty" in capsys.readouterr().out


def test_cli_exit_codes(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    run = make_run(tmp_path / "ok", util=False)
    proc = subprocess.run([sys.executable, "-m", "launcher.report", str(run)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and (run / "reward.png").exists()  # (the refusal: main() above returns 2)


def test_stage_spans_and_torn_jsonl(tmp_path):
    assert stage_spans([0, 1, 2, 3, 4], ["gen", "gen", "ref", "ref", "gen"]) == [
        (0, 2, "gen"), (2, 4, "ref"), (4, 4, "gen")]
    util = [{"stage": "gen", "sm_util": 40}, {"stage": "gen", "sm_util": 60}, {"stage": "ref", "sm_util": 90},
            {"stage": "idle", "sm_util": 0}]
    assert stage_util(util) == {"gen": (50.0, 0.5), "ref": (90.0, 0.25), "idle": (0.0, 0.25)}
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3, "x"')
    assert read_jsonl(p) == [{"step": 1}, {"step": 2}]


def test_per_node_util_files_are_merged(tmp_path):
    run = make_run(tmp_path / "r", util=False)
    for host in ("node0", "node1"):
        rows = [{"t": 10.0 + i, "gpu": g, "host": host, "stage": "gen" if i < 5 else "update_actor",
                 "sm_util": 50.0 + g, "mem_used_gb": 10.0, "mem_total_gb": 80.0} for i in range(10) for g in range(2)]
        (run / f"util.{host}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    from launcher import report

    seen = {}
    real = report.plot_utilization
    report.plot_utilization = lambda util, out: (seen.setdefault("labels", {report.gpu_label(r) for r in util}),
                                                 real(util, out))
    try:
        written = render_report(run)
    finally:
        report.plot_utilization = real
    assert "utilization.png" in {p.name for p in written}
    assert seen["labels"] == {"node0 GPU 0", "node0 GPU 1", "node1 GPU 0", "node1 GPU 1"}


def test_validation_png_and_no_mfu_panel_on_cpu(tmp_path, capsys):
    from launcher.report import plot_throughput, plot_validation

    rows = [{"step": 0, "val/reward/mean": 0.2, "val/pass@1": 0.2, "val/pass@4": 0.5, "val/a/reward/mean": 0.1,
             "val/a/pass@1": 0.1, "val/a/pass@4": 0.4, "val/b/reward/mean": 0.3, "val/b/pass@1": 0.3,
             "val/b/pass@4": 0.6, "val/reward/acc/mean": 0.2}]
    rows += [{"step": s, "perf/samples_per_s": 10.0 + s, "perf/tokens_per_s": 100.0, "perf/mfu/actor": 2.5e-6}
             for s in range(1, 5)]
    rows += [{"step": 4, "val/reward/mean": 0.6, "val/pass@1": 0.6, "val/pass@4": 0.9}]
    assert plot_validation(rows, tmp_path / "validation.png")
    assert mpimg.imread(tmp_path / "validation.png").shape[0] > 900  # three panels: reward/mean, pass@1, pass@4
    assert plot_throughput(rows, tmp_path / "cpu.png")
    assert "actor MFU not shown: this run had no GPU" in capsys.readouterr().out
    gpu = [{**r, "mem/peak_gb": 40.0} for r in rows]
    assert plot_throughput(gpu, tmp_path / "gpu.png")
    assert "MFU not shown" not in capsys.readouterr().out
    # three panels on the GPU run (samples/s, tokens/s, MFU), two on the CPU one
    assert mpimg.imread(tmp_path / "gpu.png").shape[0] > mpimg.imread(tmp_path / "cpu.png").shape[0]
    assert not plot_validation(rows[1:5], tmp_path / "none.png")
