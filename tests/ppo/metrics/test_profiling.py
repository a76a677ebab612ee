"""ppo.metrics.profiling: kernels go to the stage whose window holds their start; busy time is an interval union."""

from __future__ import annotations

import gzip
import json

import torch

from ppo.metrics.profiling import LaunchIndex, StepProfiler, busy_us, kernel_kind, largest_gaps, summarise_trace
from ppo.metrics.timing import StageTimer


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_busy_is_the_union_of_overlapping_intervals():
    assert busy_us([]) == 0.0
    assert busy_us([(0, 10), (5, 12), (20, 25)]) == 17.0
    assert busy_us([(20, 25), (0, 10), (1, 2)]) == 15.0


def test_kernel_kinds():
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert kernel_kind("nvjet_tst_128x256_64x4") == "gemm"
    assert kernel_kind("flash_fwd_splitkv_kernel") == "attention"
    assert kernel_kind("ncclDevKernel_AllReduce_Sum_f32") == "nccl"
    assert kernel_kind("Memcpy DtoH (Device -> Pinned)") == "memcpy"
    assert kernel_kind("triton_poi_fused_add_mul_0") == "other"


def test_summary_attributes_kernels_to_stages_and_measures_gaps():
    events = [
        _x("user_annotation", "stage:gen", 0, 100),
        _x("user_annotation", "stage:update_actor", 200, 50),
        _x("user_annotation", "not-a-stage", 0, 1000),
        _x("kernel", "nvjet_gemm", 10, 30),
        _x("kernel", "nvjet_gemm", 50, 30),
        _x("kernel", "flash_attn", 60, 10),   # overlaps the second GEMM (another stream)
        _x("kernel", "triton_fused", 210, 20),
        _x("gpu_memcpy", "Memcpy HtoD", 150, 5),  # between stages
    ]
    s = summarise_trace(events)
    gen = s["gen"]
    assert gen["wall_ms"] == 0.1 and gen["kernels"] == 3
    assert gen["kernel_ms"] == 0.07 and gen["busy_ms"] == 0.06 and gen["gaps_ms"] == 0.04
    assert gen["kind_ms"] == {"gemm": 0.06, "attention": 0.01}
    assert gen["top"][0] == {"name": "nvjet_gemm", "calls": 2, "ms": 0.06, "share": round(0.06 / 0.07, 4)}
    upd = s["update_actor"]
    assert upd["kernels"] == 1 and upd["gaps_ms"] == 0.03
    assert s["(outside stages)"]["kernels"] == 1 and s["(outside stages)"]["wall_ms"] is None
    assert "top_cpu_ops" not in gen  # device events exist: kernels, not CPU operators


def test_largest_gaps_name_the_host_operators_that_launched_the_kernel_after_each():
    def k(name, ts, dur, corr):
        return {**_x("kernel", name, ts, dur), "args": {"correlation": corr}}

    def launch(ts, corr, tid=1):
        return {**_x("cuda_runtime", "cudaLaunchKernel", ts, 2), "args": {"correlation": corr}, "tid": tid}

    def op(name, ts, dur, tid=1):
        return {**_x("cpu_op", name, ts, dur), "tid": tid}

    events = [
        op("step", 0, 1000), op("aten::mm", 5, 10), op("loss", 100, 300), op("aten::item", 150, 200),
        op("aten::add", 380, 10), op("backward", 400, 500, tid=2), op("aten::mul", 600, 10, tid=2),
        launch(6, 1), launch(385, 2), launch(605, 3, tid=2), launch(606, 4, tid=2),
        k("gemm", 10, 100, 1),      # busy 10..110
        k("add", 390, 10, 2),       # gap 280 us, launched inside loss > aten::add
        k("mul", 610, 10, 3),       # gap 210 us, launched by backward > aten::mul (autograd thread)
        k("mul2", 625, 10, 4),      # gap 5 us: below min_us
    ]
    device = [e for e in events if e["cat"] == "kernel"]
    g = largest_gaps(device, LaunchIndex(events), min_us=20.0)
    assert g["gaps"] == 2 and g["gap_ms"] == 0.49
    assert g["top"][0] == {"us": 280.0, "before": "gemm", "after": "add", "launched_by": ["step", "loss", "aten::add"]}
    assert g["top"][1]["launched_by"] == ["backward", "aten::mul"]
    assert g["by_launcher"] == [{"op": "aten::add", "ms": 0.28, "gaps": 1}, {"op": "aten::mul", "ms": 0.21, "gaps": 1}]
    # a kernel whose launch is not in the trace is still a gap, of an unknown launcher
    assert largest_gaps([k("a", 0, 1, 9), k("b", 50, 1, 8)], LaunchIndex([]))["by_launcher"][0]["op"] == "(unknown)"


def test_cpu_step_profile_writes_summary_and_trace(tmp_path):
    prof = StepProfiler([2], out_dir=tmp_path, rank=0, device=torch.device("cpu"))
    for step in range(3):
        timer = StageTimer(torch.device("cpu"), annotate=prof.due(step))
        with prof.around(step) as on:
            assert on == (step == 1)
            with timer("update_actor"):
                a = torch.randn(64, 64, requires_grad=True)
                (a @ a).sum().backward()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step2_rank0.json", "step2_rank0.trace.json.gz"]
    summary = json.loads((tmp_path / "step2_rank0.json").read_text())
    st = summary["stages"]["update_actor"]
    assert summary["step"] == 2 and st["wall_ms"] > 0
    assert any(op["name"] == "aten::mm" for op in st["top_cpu_ops"]), st["top_cpu_ops"]
    with gzip.open(tmp_path / "step2_rank0.trace.json.gz") as f:
        assert json.load(f)["traceEvents"]


def _sync_here():
    import warnings

    warnings.warn("called a synchronizing CUDA operation", stacklevel=1)  # what torch's sync debug mode warns


def test_host_syncs_count_the_sync_warnings_by_call_site_and_pass_the_others_on(monkeypatch):
    import warnings

    from ppo.metrics.profiling import host_syncs

    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with host_syncs() as syncs:
            for _ in range(3):
                _sync_here()
            _sync_here()
            warnings.warn("something else", stacklevel=1)
    assert modes == ["warn", 0]  # on for the block, then back to what it was
    assert syncs["total"] == 4
    here = f"tests/ppo/metrics/test_profiling.py:{_sync_here.__code__.co_firstlineno + 3} _sync_here"
    assert [s["calls"] for s in syncs["sites"]] == [3, 1]  # two call sites: the loop's and the last call's
    assert all(s["site"].startswith(here + " <- tests/ppo/metrics/test_profiling.py:") for s in syncs["sites"])
    assert [str(w.message) for w in seen] == ["something else"]  # other warnings still reach their handler


def test_phases_take_each_kernel_and_the_idle_time_before_it_by_the_host_code_that_launched_it():
    from ppo.metrics.profiling import AUTOGRAD_PHASE

    def k(name, ts, dur, corr):
        return {**_x("kernel", name, ts, dur), "args": {"correlation": corr}}

    def launch(ts, corr, tid=1):
        return {**_x("cuda_runtime", "cudaLaunchKernel", ts, 2), "args": {"correlation": corr}, "tid": tid}

    def op(name, ts, dur, tid=1, cat="cpu_op"):
        return {**_x(cat, name, ts, dur), "tid": tid}

    events = [
        op("stage:update_actor", 0, 2000, cat="user_annotation"),
        op("phase:forward", 0, 100, cat="user_annotation"), op("aten::mm", 5, 10),
        op("phase:loss", 100, 100, cat="user_annotation"), op("aten::mul", 120, 5),
        op("autograd::engine::evaluate_function: MmBackward0", 300, 50, tid=2), op("aten::mm", 305, 10, tid=2),
        op("aten::copy_", 500, 5),  # outside any phase
        launch(6, 1), launch(121, 2), launch(306, 3, tid=2), launch(501, 4),
        k("gemm", 10, 100, 1),      # forward: busy 10..110
        k("mul", 150, 10, 2),       # loss: 40 us idle before it
        k("gemm_bwd", 400, 100, 3),  # the autograd thread: 240 us idle before it
        k("copy", 500, 10, 4),      # no phase: none idle (starts as the last ends)
    ]
    phases = summarise_trace(events)["update_actor"]["phases"]
    assert phases == {AUTOGRAD_PHASE: {"kernel_ms": 0.1, "kernels": 1, "gap_ms": 0.24, "gaps": 1},
                      "forward": {"kernel_ms": 0.1, "kernels": 1, "gap_ms": 0.0, "gaps": 0},
                      "loss": {"kernel_ms": 0.01, "kernels": 1, "gap_ms": 0.04, "gaps": 1},
                      "(other)": {"kernel_ms": 0.01, "kernels": 1, "gap_ms": 0.0, "gaps": 0}}
    # a stage whose code marks no phase reports none
    assert "phases" not in summarise_trace([e for e in events if not e["name"].startswith("phase:")])["update_actor"]
