"""The cost model against hand computations, its memory feasibility, and the calibration's derivation."""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from launcher.planning.costmodel import (
    Calibration,
    Candidate,
    ModelShape,
    Workload,
    decode_step_s,
    generation_s,
    load_calibration,
    model_pass_s,
    reshard_s,
)
from launcher.planning.stepmodel import estimate, useful_flops

ROOT = Path(__file__).resolve().parents[3]

# round numbers so that every expected value below is a short hand computation
CAL = Calibration(
    name="test", peak_flops=1e15, hbm_bytes_per_s=1e12, hbm_gb=100.0, gpus_per_node=8, mfu_update=0.5,
    mfu_forward=0.5, mfu_prefill=0.5, dp_update_efficiency=1.0, dp_forward_efficiency=1.0,
    decode_weight_bw_fraction=1.0, decode_gemm_fraction=1.0, decode_kv_bw_fraction=1.0,
    decode_kv_fp8_bw_fraction=0.5, decode_layer_overhead_s=0.0, activation_bytes_per_token_layer_hidden=10.0,
    reshard_bytes_per_s=1e11, nccl_intra_bytes_per_s=1e11, nccl_inter_bytes_per_s=1e10, nccl_latency_s=0.0,
    pcie_bytes_per_s=1e10, host_gae_s_per_token=0.0, host_rule_reward_s_per_sample=0.0)
# N = 1e9 matmul parameters; attention width 0 so that only the 2N / 6N rule counts
M = ModelShape(n_matmul=10**9, n_params=10**9, layers=10, hidden=1000, attn_dim=0, kv_bytes_per_token=1000, vocab=0)


def _workload(**kw) -> Workload:
    base = dict(actor=M, critic=M, ref=M, reward_model=None, prompts=10, n=1, prompt_len=100, response_len=100,
                micro_batch_tokens={"actor": 10**6, "critic": 10**6, "ref": 10**6})
    return Workload(**{**base, **kw})


def test_decode_step_by_hand():
    # 1e9 params x 2 bytes over 1e12 B/s = 2 ms; 100 rows x 2e9 FLOP / 1e15 = 0.2 ms: weight-bound
    # KV: 100 rows x 150 positions x 1000 B = 15 MB over 1e12 = 15 us
    assert decode_step_s(CAL, M, rows=100, ctx=150, tp=1) == pytest.approx(2e-3 + 15e-6)
    # 1000 rows: 2 TFLOP / 1e15 = 2 ms ties the weights; KV 150 MB = 150 us
    assert decode_step_s(CAL, M, rows=2000, ctx=150, tp=1) == pytest.approx(4e-3 + 300e-6)
    # an fp8 cache: its own bytes per token, streamed at its own fraction (0.5): 100 x 150 x 500 B / 0.5e12 = 15 us
    fp8 = dataclasses.replace(M, kv_bytes_per_token=500, fp8_kv=True)
    assert decode_step_s(CAL, fp8, rows=100, ctx=150, tp=1) == pytest.approx(2e-3 + 15e-6)


def test_generation_waves_by_hand():
    w = _workload(prompts=10, prompt_len=100, response_len=11)
    step = decode_step_s(CAL, M, rows=5, ctx=100 + 5.5, tp=1)
    prefill = 2e9 * 100 * 5 / (1e15 * 0.5)  # 5 rows x 100 prompt tokens x 2N at 50%
    # 10 sequences, 5 KV slots: two waves of 5, each a prefill and 10 decode steps
    assert generation_s(w, CAL, gen_tp=1, gen_dp=1, slots=5) == pytest.approx(2 * (prefill + 10 * step))


def test_forward_and_update_by_hand():
    w = _workload()
    tokens = 10 * 200
    assert model_pass_s(w, CAL, "ref", M, layout=(1, 1, 1), train=False) == pytest.approx(2e9 * tokens / 0.5e15)
    assert model_pass_s(w, CAL, "actor", M, layout=(1, 1, 1), train=True) == pytest.approx(6e9 * tokens / 0.5e15)
    # full activation checkpointing recomputes the forward: 8N instead of 6N
    ac = _workload(ac={"actor": "full"})
    assert model_pass_s(ac, CAL, "actor", M, layout=(1, 1, 1), train=True) == pytest.approx(8e9 * tokens / 0.5e15)
    # dp=2 halves the compute (12 ms); FSDP's 3 gathers per micro-batch receive half of 2 GB each at 100 GB/s
    # (10 ms each): 30 ms of communication bounds the stage
    assert model_pass_s(w, CAL, "actor", M, layout=(1, 1, 2), train=True) == pytest.approx(0.030)
    # ten times the tokens (one micro-batch still): 120 ms of compute hides the 30 ms of gathers
    big = _workload(prompts=100)
    assert model_pass_s(big, CAL, "actor", M, layout=(1, 1, 2), train=True) == pytest.approx(6e9 * 20000 / 1e15)
    # a measured FSDP efficiency of 0.8 at dp > 1 stretches the compute by 1 / 0.8
    slow = dataclasses.replace(CAL, dp_update_efficiency=0.8)
    assert model_pass_s(big, slow, "actor", M, layout=(1, 1, 2), train=True) == pytest.approx(0.12 / 0.8)


def test_pipeline_bubble_by_hand():
    w = _workload()
    one = model_pass_s(w, CAL, "ref", M, layout=(1, 1, 1), train=False)
    # pp=2: 4 micro-batches (at least 2 pp) -> (4 + 1) / 4 of half the work, plus the stage-to-stage sends
    sends = 4 * (2 * 2000 / 4 * 1000 * 2) / 2 / 1e11
    assert model_pass_s(w, CAL, "ref", M, layout=(1, 2, 1), train=False) == pytest.approx((one / 2 + sends) * 5 / 4)


def test_reshard_by_hand():
    w = _workload()
    # tp=4 training -> gen tp=1: each rank lacks 3/4 of 2 GB = 1.5 GB at 100 GB/s
    assert reshard_s(w, CAL, tp=4, pp=1, dp=1, gen_tp=1) == pytest.approx(0.015)
    assert reshard_s(w, CAL, tp=2, pp=1, dp=1, gen_tp=2) == 0.0
    # optimizer offload: 8 bytes/param over 2 ranks, to the host and back at 10 GB/s
    offloading = dataclasses.replace(w, offload_optimizer_while_generating=True)
    assert reshard_s(offloading, CAL, tp=2, pp=1, dp=1, gen_tp=2) == pytest.approx(0.8)


def _cand(mode, pools, is_async=False):
    roles = [r for p, _ in pools for r in p if r != "rollout"]
    lay = tuple(sorted((r, (1, 1, n)) for p, n in pools for r in p if r != "rollout"))
    assert sorted(r for r, _ in lay) == sorted(roles)
    return Candidate(mode=mode, pools=tuple((tuple(p), n) for p, n in pools), layouts=lay, gen_tp=1, is_async=is_async)


def test_step_composition_by_hand():
    w = _workload()
    colo = estimate(w, CAL, _cand("colocated", [(("actor", "rollout", "ref", "critic", "reward"), 1)]))
    s = colo.stages
    assert colo.step_s == pytest.approx(sum(s.values()))
    split = estimate(w, CAL, _cand("split", [(("actor", "rollout"), 1), (("ref", "critic", "reward"), 1)]))
    s = split.stages
    score = max(s["old_log_prob"], s["ref"] + s["values"] + s["reward"])
    expect = s["gen"] + s["reshard"] + score + s["adv"] + s["transfer"] + max(s["update_actor"], s["update_critic"])
    assert split.step_s == pytest.approx(expect)
    asy = estimate(dataclasses.replace(w, is_async=True, old_logp_share=0.0), CAL,  # the behaviour log-probs serve
                   _cand("split", [(("actor", "rollout"), 1), (("ref", "critic", "reward"), 1)], is_async=True))
    s = asy.stages
    assert "old_log_prob" not in s
    first = max(s["gen"] + s["reshard"], s["ref"] + s["values"] + s["reward"])
    assert asy.step_s == pytest.approx(first + s["adv"] + s["transfer"] + max(s["update_actor"], s["update_critic"]))
    assert asy.step_s < split.step_s


def test_useful_flops_by_hand():
    # PPO, one epoch, old-log-prob forward, rule reward: 2N per generated and prefilled token, and per trained
    # token 6N + 6N updates + 2N old log-probs, reference and values = 18N (20N with a reward model)
    w = _workload()
    assert useful_flops(w) == pytest.approx(2e9 * (10 * 100 + 10 * 100) + 18e9 * 10 * 200)
    assert useful_flops(_workload(reward_model=M)) == pytest.approx(2e9 * 2000 + 20e9 * 2000)


def test_memory_rejects_what_cannot_fit():
    w = _workload()
    ok = estimate(w, CAL, _cand("colocated", [(("actor", "rollout", "ref", "critic", "reward"), 1)]))
    assert ok.reject is None and max(ok.peak_gb) < CAL.hbm_gb
    big = ModelShape(n_matmul=10**10, n_params=10**10, layers=10, hidden=1000, attn_dim=0, kv_bytes_per_token=1000,
                     vocab=0)
    est = estimate(_workload(actor=big, critic=big, ref=big), CAL,
                   _cand("colocated", [(("actor", "rollout", "ref", "critic", "reward"), 1)]))
    # actor and critic states alone: 2 x 16 bytes x 1e10 = 320 GB on one 100 GB GPU
    assert est.reject is not None and "GB per GPU > 100 GB" in est.reject and "actor_states 160.0" in est.reject


def test_lora_memory_by_hand():
    """actor.lora: the base frozen (4 bytes/param at fp32), 16 bytes per adapter parameter, no reference weights."""
    from launcher.planning.stepmodel import pool_memory

    cand = _cand("colocated", [(("actor", "rollout", "ref", "reward"), 1)])
    full, _, _ = pool_memory(_workload(critic=None), CAL, cand, 0)
    lora, _, _ = pool_memory(_workload(critic=None, lora_params=10**7), CAL, cand, 0)
    assert full["actor_states"] == 16.0 and full["ref_states"] == 4.0
    assert lora["actor_states"] == pytest.approx(4.0 + 0.16) and lora["ref_states"] == 0.0


def test_lora_workload_counts_the_adapters():
    from launcher.config.load import load_config
    from launcher.planning.costmodel import build_workload
    from models.config import preset_config
    from models.lora import LoRASpec, adapter_param_count

    cfg = load_config(str(ROOT / "conf" / "grpo_tiny.yaml"),
                      ["actor.lora.rank=8", "actor.lora.target_modules=[q_proj,down_proj]"])
    model = preset_config("tiny")
    w = build_workload(cfg, model=model)
    # q_proj 64 -> 64, down_proj 176 -> 64, four layers: 4 x 8 x (128 + 240)
    spec = LoRASpec(rank=8, alpha=16, target_modules=("q_proj", "down_proj"))
    assert w.lora_params == adapter_param_count(model, spec) == 4 * 8 * (128 + 240)


def test_calibration_file_is_derived_from_the_committed_micro_benchmarks():
    from bench.calibrate import derive

    committed = json.loads((ROOT / "launcher/planning/calibration/h200.json").read_text())
    # the file names the committed micro-benchmark results it was fitted from; they must reproduce it
    files = committed["source"]["files"]
    assert all((ROOT / f).is_file() for f in files.values()), files
    again = derive({k: ROOT / f for k, f in files.items()}, name="h200")
    for key, value in committed.items():
        if key != "source":
            assert again[key] == pytest.approx(value), key
    cal = load_calibration("h200")
    assert cal.peak_flops == committed["peak_flops"] and math.isclose(cal.mfu_update, committed["mfu_update"])
    with pytest.raises(FileNotFoundError, match="bench.calibrate"):
        load_calibration("no-such-machine")


def test_another_machine_is_calibrated_from_its_own_files_and_facts(tmp_path):
    """bench.calibrate --name h100: its own result files (micro_files) and machine facts (SPECS), the decode GEMM
    time read from its generate run's kernel profiles; a machine without facts, or a generate run without a profile
    where no GEMM time is stated, is refused."""
    from bench.calibrate import SPECS, derive, micro_files

    committed = json.loads((ROOT / "launcher/planning/calibration/h200.json").read_text())
    src = {k: ROOT / f for k, f in committed["source"]["files"].items()}
    files = {}
    for key, name in micro_files("h100").items():
        if key in src:
            files[key] = tmp_path / name
            files[key].write_text(src[key].read_text())
    gen = json.loads(files["generate"].read_text())
    variant = "native-triton+compile"
    kernels = [{"name": "nvjet_sm90_tst_256x128", "device_ms": 40.0, "calls": 1}, {"name": "_decode_kernel",
                                                                                   "device_ms": 9.0, "calls": 1}]
    prefill = [{"name": "nvjet_sm90_tst_256x128", "device_ms": 8.0, "calls": 1}]
    gen["result"]["checks"] = {f"{variant}/profile_top_kernels": {"rows": 256, "decode_steps": 31, "top": kernels},
                               f"{variant}/profile_prefill": {"rows": 256, "decode_steps": 1, "top": prefill}}
    files["generate"].write_text(json.dumps(gen))
    h100 = derive(files, name="h100")
    assert h100["name"] == "h100" and h100["hbm_gb"] == SPECS["h100"]["hbm_gb"][0] == 79.0
    # (40 - 8) ms of GEMMs over 31 decode steps: ~1.03 ms a step, against the H200's stated 1.04
    assert h100["decode_gemm_fraction"] == pytest.approx(committed["decode_gemm_fraction"] * 1.04 / (32 / 31), abs=2e-3)
    assert "kernel profiles" in h100["source"]["decode_gemm_fraction"]
    with pytest.raises(ValueError, match="add them to bench.calibrate.SPECS"):
        derive(files, name="a100")
    gen["result"]["checks"] = {}
    files["generate"].write_text(json.dumps(gen))
    with pytest.raises(ValueError, match="kept no kernel profile"):
        derive(files, name="h100")


def test_auto_calibration_is_the_gpus_own_where_one_exists(tmp_path, monkeypatch):
    """placement.calibration=auto (the default): a launch's cost model is of the GPU it runs on where that machine
    type has a calibration file, else the H200's, with the reason in the launch's auto line (resolve_calibration,
    launcher/main.py, beside the memory fit's lines)."""
    import launcher.planning.costmodel as cm
    from launcher.config.load import load_config

    assert cm.auto_calibration("NVIDIA H200")[0] == "h200"
    name, why = cm.auto_calibration("NVIDIA H100 80GB HBM3")
    assert name == "h200" and "bench.calibrate --name h100" in why  # no h100.json committed yet
    monkeypatch.setattr(cm, "CALIBRATION_DIR", tmp_path)
    for machine in ("h100", "h200"):
        (tmp_path / f"{machine}.json").write_text((ROOT / "launcher/planning/calibration/h200.json").read_text())
    h100 = "NVIDIA H100 80GB HBM3"
    assert cm.auto_calibration(h100) == ("h100", f"the calibration of this GPU ({h100})")
    assert cm.auto_calibration("NVIDIA A100-SXM4-80GB")[0] == "h200" and cm.auto_calibration(None)[0] == "h200"
    cfg = load_config(str(ROOT / "conf/ppo_tiny.yaml"), [])  # a CPU run: no GPU visible
    assert cfg.placement.calibration == "auto" and cm.load_calibration("auto").name == "h200"
    assert cm.resolve_calibration(cfg) == ["placement.calibration=h200 (auto: no GPU visible here: the h200 "
                                           "calibration)"] and cfg.placement.calibration == "h200"
    named = load_config(str(ROOT / "conf/ppo_tiny.yaml"), ["placement.calibration=h100"])
    assert cm.resolve_calibration(named) == [] and named.placement.calibration == "h100"  # an explicit one wins
