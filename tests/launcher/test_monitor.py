"""GpuMonitor against a fake NVML replaying a recorded trace; the no-NVML path; FLOP helpers."""

import json
import logging
import os
import time
from types import SimpleNamespace

import pytest

from launcher.monitor import GpuMonitor, main, smallest_gpu_memory_gb

# (sm_util %, mem_used GB) per sample for two GPUs: a gen phase then a training phase
TRACE = {
    0: [(35, 40.0), (40, 42.0), (95, 70.0), (90, 71.5)],
    1: [(30, 38.0), (45, 41.0), (85, 66.0), (80, 69.0)],
}
TOTAL_GB = 141.0


class FakeNvml:
    """The handful of pynvml functions GpuMonitor calls, replaying TRACE sample by sample."""

    def __init__(self, trace=TRACE, *, fail_init=False, power=True):
        self.trace, self.fail_init, self.power = trace, fail_init, power
        self.calls = {i: 0 for i in trace}
        self.shutdown = False

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdown = True

    def nvmlDeviceGetCount(self):
        return len(self.trace)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def _row(self, h):
        rows = self.trace[h]
        return rows[min(self.calls[h], len(rows) - 1)]

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self._row(h)[0], memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):
        used = self._row(h)[1]
        self.calls[h] += 1  # memory is the last per-sample read before power; advance the replay
        return SimpleNamespace(used=int(used * 1e9), total=int(TOTAL_GB * 1e9), free=0)

    def nvmlDeviceGetPowerUsage(self, h):
        if not self.power:
            raise RuntimeError("Not Supported")
        return 500_000 + 1000 * h


def test_replayed_trace_tags_stages_and_summarises(tmp_path):
    path = tmp_path / "util.jsonl"
    mon = GpuMonitor(path, nvml=FakeNvml(), device_indices=[0, 1])
    assert mon.enabled
    # no thread: samples are driven by hand for determinism (the thread calls the same sample_once)
    with mon.stage("gen"):
        mon.sample_once()
        mon.sample_once()
    s1 = mon.step_summary()
    mon.set_stage("update_actor")
    mon.sample_once()
    mon.sample_once()
    s2 = mon.step_summary()
    mon.stop()

    assert s1["gpu/util_mean"] == pytest.approx((35 + 40 + 30 + 45) / 4 / 100)
    assert s1["gpu/util_mean/gen"] == pytest.approx(s1["gpu/util_mean"])
    assert (s1["gpu/0/util_mean"], s1["gpu/1/util_mean"]) == (pytest.approx(0.375), pytest.approx(0.375))
    assert s1["mem/peak_gb"] == pytest.approx(42.0)
    assert s1["mem/peak_frac"] == pytest.approx(42.0 / TOTAL_GB)
    assert s1["power/mean_w"] == pytest.approx(500.5)
    assert s2["gpu/util_mean"] == pytest.approx((95 + 90 + 85 + 80) / 4 / 100)
    assert (s2["gpu/0/util_mean"], s2["gpu/1/util_mean"]) == (pytest.approx(0.925), pytest.approx(0.825))
    assert s2["mem/peak_gb"] == pytest.approx(71.5)
    assert "gpu/util_mean/gen" not in s2  # the summary window restarted

    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == 8  # 4 samples x 2 GPUs, all flushed by stop()
    assert [r["stage"] for r in rows[:8]] == ["gen"] * 4 + ["update_actor"] * 4
    assert {r["gpu"] for r in rows} == {0, 1}
    assert rows[0]["sm_util"] == 35 and rows[0]["mem_total_gb"] == pytest.approx(TOTAL_GB)
    assert mon._nvml.shutdown and mon.sample_once() == []  # stopped: NVML released


def test_stage_fn_and_missing_power(tmp_path):
    stage = {"name": "ref"}
    mon = GpuMonitor(tmp_path / "u.jsonl", nvml=FakeNvml(power=False), stage_fn=lambda: stage["name"])
    recs = mon.sample_once()
    assert [r["stage"] for r in recs] == ["ref", "ref"] and recs[0]["power_w"] is None
    assert "power/mean_w" not in mon.step_summary()
    assert mon.step_summary() == {}  # no samples since the last call


def test_background_thread_writes_and_flushes(tmp_path):
    path = tmp_path / "util.jsonl"
    mon = GpuMonitor(path, nvml=FakeNvml(), interval_s=0.01, flush_interval_s=0.02)
    with mon:
        mon.set_stage("gen")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (not path.exists() or len(path.read_text().splitlines()) < 4):
            time.sleep(0.01)
        assert len(path.read_text().splitlines()) >= 4  # flushed while still running
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert all(r["stage"] in ("idle", "gen") for r in rows)
    assert mon._nvml.shutdown


def test_sample_cost_is_negligible(tmp_path):
    # our own overhead per sample (fake NVML costs ~0); real NVML reads are ~10-50 us per call
    mon = GpuMonitor(tmp_path / "u.jsonl", nvml=FakeNvml({i: [(50, 10.0)] for i in range(8)}))
    n = 500
    t0 = time.perf_counter()
    for _ in range(n):
        mon.sample_once()
    per_sample = (time.perf_counter() - t0) / n
    mon.flush()
    # 8 GPUs at 0.5 s interval: a 2 ms sample would be 0.4% of one core; measured ~0.05 ms
    assert per_sample < 2e-3, f"one 8-GPU sample took {per_sample * 1e3:.3f} ms"


def test_no_nvml_logs_once_and_is_off(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="launcher.monitor"):
        mon = GpuMonitor(tmp_path / "util.jsonl", nvml=FakeNvml(fail_init=True))
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and msgs[0].startswith("NVML unavailable: RuntimeError: NVML Shared Library Not Found")
    assert msgs[0].endswith("GPU monitor off")
    assert not mon.enabled
    with mon:
        with mon.stage("gen"):
            assert mon.sample_once() == []
    assert mon.step_summary() == {}
    assert not (tmp_path / "util.jsonl").exists()


def test_the_smallest_visible_gpus_memory_sizes_the_launch(monkeypatch):
    """launcher.planning.fit bounds the micro-batch budgets by it: NVML's total of the GPUs CUDA_VISIBLE_DEVICES
    names, None without NVML or a GPU."""
    class Sizes(FakeNvml):
        def nvmlDeviceGetMemoryInfo(self, h):
            return SimpleNamespace(used=0, total=int((80.0 if h == 1 else 141.0) * 1e9), free=0)

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = Sizes()
    assert smallest_gpu_memory_gb(nvml=nvml) == 80.0 and nvml.shutdown
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert smallest_gpu_memory_gb(nvml=Sizes()) == 141.0
    assert smallest_gpu_memory_gb(nvml=FakeNvml(fail_init=True)) is None
    assert smallest_gpu_memory_gb(nvml=FakeNvml({})) is None


def test_no_gpu_visible_is_off(tmp_path):
    mon = GpuMonitor(tmp_path / "u.jsonl", nvml=FakeNvml({}))
    assert not mon.enabled and "no GPU visible" in mon.disabled_reason


def test_selfcheck_cli_prints_one_json_line(capsys):
    assert main(["--seconds", "0.2"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["metric"] == "monitor_selfcheck"
    if last["nvml"]:  # on a GPU machine: real sampling cost
        assert last["n_gpus"] >= 1 and last["sample_ms"] > 0
    else:
        assert "NVML" in last["reason"] or "GPU" in last["reason"]


def test_per_rank_monitors_share_one_file(tmp_path):
    path = tmp_path / "util.jsonl"
    mons = [GpuMonitor(path, nvml=FakeNvml({r: [(10 * r, 1.0)]}), device_indices=[r], rank=r, tags={"host": "n0"},
                       interval_s=0.001, flush_interval_s=0.005) for r in range(3)]
    for m in mons:
        m.start()
    time.sleep(0.3)
    for m in mons:
        m.stop()
    rows = [json.loads(x) for x in path.read_text().splitlines()]  # every line whole: no interleaving
    assert {r["rank"] for r in rows} == {0, 1, 2} and {r["host"] for r in rows} == {"n0"}
    assert all(r["gpu"] == r["rank"] and r["sm_util"] == 10 * r["rank"] for r in rows)


def test_failing_reads_warn_once_and_never_raise(tmp_path, caplog):
    class Lost(FakeNvml):
        def nvmlDeviceGetUtilizationRates(self, h):
            raise RuntimeError("GPU is lost")

    with caplog.at_level(logging.WARNING, logger="launcher.monitor"):
        with GpuMonitor(tmp_path / "u.jsonl", nvml=Lost(), interval_s=0.005) as mon:
            time.sleep(0.1)
    assert mon.sample_failures > 3
    assert [r.getMessage() for r in caplog.records if "failed" in r.getMessage()] == [
        "GPU monitor sample failed (further failures are counted, not logged): GPU is lost"]


@pytest.mark.gpu
def test_real_nvml_sees_a_matmul_load(tmp_path):
    import torch

    idx = int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0)
    mon = GpuMonitor(tmp_path / "util.jsonl", interval_s=0.1, device_indices=[idx])
    assert mon.enabled, mon.disabled_reason
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with mon:
        with mon.stage("load"):
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.5:
                for _ in range(20):
                    a @ a
                torch.cuda.synchronize()
    s = mon.step_summary()
    assert s["gpu/util_mean/load"] > 0.5 and s["mem/peak_gb"] > 0.1, s
    rows = [json.loads(x) for x in (tmp_path / "util.jsonl").read_text().splitlines()]
    assert len(rows) >= 5 and all(r["gpu"] == idx for r in rows)
