"""bench.ppo_step's summary of a run's metrics rows: rates over the measured steps' wall time (not means of
per-step rates), and which steps compiled."""

import json
from pathlib import Path

import pytest

from bench.ppo_step import _summary


def test_summary_flags_a_measured_step_that_recompiled(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps({"mode": "colocated", "groups": {"actor": {"ranks": [0]}}}))
    # warm-up steps 1-2 compile; measured step 4 recompiles (a new packed length after the warm-up)
    speeds, graphs = [5.0, 100.0, 150.0, 30.0, 154.0], [40, 44, 44, 46, 46]
    rows = [{"step": i + 1, "perf/samples_per_s": s, "compile/graphs": g, "timing_s/step": 256 / s}
            for i, (s, g) in enumerate(zip(speeds, graphs))]
    out = _summary(rows, warmup=2, nproc=1, run_dir=tmp_path)
    assert out["steps_measured"] == 3 and out["compiled_steps"] == [1, 2, 4]
    # 256 samples a step: samples over the steps' wall time, so the slow recompiling step weighs by its time
    assert out["samples_per_s"] == pytest.approx(3 * 256 / (256 / 150.0 + 256 / 30.0 + 256 / 154.0))
    assert out["samples_per_s"] < (150.0 + 30.0 + 154.0) / 3  # the mean of the rates overstates it
    assert out["samples_per_s_no_compile"] == pytest.approx(2 * 256 / (256 / 150.0 + 256 / 154.0))
    rows = [{k: v for k, v in r.items() if k != "compile/graphs"} for r in rows]  # runs from before the metric
    out = _summary(rows, warmup=2, nproc=1, run_dir=tmp_path)
    assert out["compiled_steps"] == [] and out["samples_per_s_no_compile"] == out["samples_per_s"]


def test_steady_rate_leaves_out_the_last_steps_that_generate_nothing(tmp_path):
    """K = 2: the run's last two steps train batches generated ahead and generate none (async/generated_tokens 0),
    so they run faster; samples_per_s_steady is the rate over the measured steps that generated."""
    (tmp_path / "plan.json").write_text(json.dumps({"mode": "split", "groups": {"actor": {"ranks": [0]}}}))
    speeds, generated = [10.0, 50.0, 50.0, 50.0, 80.0, 80.0], [9, 9, 9, 9, 0, 0]
    rows = [{"step": i + 1, "perf/samples_per_s": s, "timing_s/step": 128 / s, "async/generated_tokens": g}
            for i, (s, g) in enumerate(zip(speeds, generated))]
    out = _summary(rows, warmup=1, nproc=2, run_dir=tmp_path)
    assert out["samples_per_s_steady"] == pytest.approx(50.0) and out["samples_per_s"] > 55
    sync = [{k: v for k, v in r.items() if k != "async/generated_tokens"} for r in rows]  # K = 0: every step
    assert _summary(sync, warmup=1, nproc=2, run_dir=tmp_path)["samples_per_s_steady"] == pytest.approx(
        _summary(sync, warmup=1, nproc=2, run_dir=tmp_path)["samples_per_s"])


def test_a_sigterm_kills_the_workload_tree_and_still_returns(tmp_path):
    """A GPU batch's time limit SIGTERMs the bench: the torchrun tree it started (its own session) must die with
    it, or its workers keep the GPU from the next bench; the bench still returns its summary."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "grandchild.pid"
    script = tmp_path / "driver.py"  # not bench.py: that would shadow the package
    # the "workload": a child that starts a grandchild (as torchrun starts its workers), both sleeping
    workload = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
                f"time.sleep(120)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    script.write_text("import sys\nfrom bench.ppo_step import run_session\n"
                      f"error, _ = run_session([sys.executable, '-c', {workload!r}], timeout=100)\n"
                      "print('RESULT', error, flush=True)\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    bench = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline and bench.poll() is None:
        time.sleep(0.1)
    grandchild = int(pid_file.read_text())
    bench.send_signal(signal.SIGTERM)
    out, _ = bench.communicate(timeout=60)
    assert bench.returncode == 0 and "RESULT terminated by SIGTERM" in out, out
    time.sleep(0.5)
    try:  # killed (and reaped by init, or a zombie at most: never running)
        state = Path(f"/proc/{grandchild}/stat").read_text().split(")")[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z"), state
