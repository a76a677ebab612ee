"""Calibrate the cost model (launcher/planning/costmodel.py) for one machine type from micro-benchmarks.

    python -m bench.calibrate --name h100 --out launcher/planning/calibration/h100.json   # on the GPU (~4 min)
    python -m bench.calibrate --from-results DIR --out launcher/planning/calibration/h200.json   # offline

--name picks the machine type: its result files (micro_files: env_check_<name>.json, ...) and the facts no
micro-benchmark measures (SPECS: memory, node size, links).
On the GPU it runs bench.env_check (matmul and copy ceilings), bench.decode_attention (KV streaming, bf16 and fp8),
bench.generate (native engine at batches 32, 64, 256: prefill and decode-step times) and bench.train_step
(the compiled PPO update and its log-prob forward), keeps their JSON lines under --workdir, and fits:
- mfu_update / mfu_forward: counted FLOPs (6N or 2N + causal attention) x tokens/s / peak;
- decode: step = max(W / (HBM fw), F / (peak fm)) + KV / (HBM fkv) + L c, with fkv from the attention
  benchmark, fm from the decode GEMMs' time in the generate run's kernel profile at 256 rows, and fw, c
  least-squares over the three batch sizes (the residuals are reported);
- activation bytes per token, layer and hidden unit: the update's peak memory minus its 8 bytes/param.
With two GPUs it also runs bench.reshard (NCCL bandwidth) and the update at dp=2 (what FSDP costs per GPU);
on one GPU the committed results for those are kept (or, absent, dp efficiency 1.0 is stated). What no
micro-benchmark measures (inter-node bandwidth, latency, PCIe, the host's GAE and rule-reward cost) is
stated in the file's "source" with where it comes from. Runs only end-to-end PPO steps never feed it:
those are what bench.costmodel_validate checks the model against.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LINKS = {  # the same in HGX H100 and H200 nodes
    "nccl_inter_bytes_per_s": (45e9, "400 Gb/s InfiniBand NDR per GPU (50 GB/s), ~90% achievable; assumed"),
    "nccl_latency_s": (15e-6, "NCCL small-message latency inside a node; assumed"),
    "pcie_bytes_per_s": (50e9, "PCIe Gen5 x16 host link; assumed"),
}
SPECS = {  # not measured by any micro-benchmark here: machine facts per machine type, each stated in the output
    "h200": {"hbm_gb": (140.0, "H200: 141 GB HBM3e, less ~1 GB of CUDA context (allocator headroom is not modelled)"),
             "gpus_per_node": (8, "HGX H200 node"), **_LINKS},
    "h100": {"hbm_gb": (79.0, "H100 SXM: 80 GB HBM3, less ~1 GB of CUDA context (allocator headroom is not modelled)"),
             "gpus_per_node": (8, "HGX H100 node"), **_LINKS},
}
# bench/results/generate_h200.json's kernel profile at 256 rows: the decode GEMMs take 1.04 ms of a step
# (docs/history/measurements.md, "Rollout"); read from a profile the committed run did not keep. A generate run that
# keeps its kernel profiles (bench.calibrate's own, since 2026-12-08) gives this number itself (decode_gemm_s).
DECODE_GEMM_S_AT_256_ROWS = {"h200": 1.04e-3}
HOST = {  # no micro-benchmark: per-unit host costs from the two end-to-end runs that time them (< 3% of a step)
    "host_gae_s_per_token": (0.0776 / (128 * 512), "timing_s/adv of placement_b_colocated-sync_h200x2 "
                             "(GAE + advantage whitening on the CPU, 128 x 512 response tokens)"),
    "host_rule_reward_s_per_sample": (0.0231 / 256, "timing_s/reward of grpo_a_h200 (rule reward, 256 samples)"),
}
MICRO = ("env_check", "decode_attention", "generate", "train_step", "reshard")  # each machine's results, required


def micro_files(name: str) -> dict[str, str]:
    """The micro-benchmarks' result files of machine `name`: MICRO's, the same update at dp=2 over two GPUs
    (train_step_dp2: optional, needs 2 GPUs) and the KV-streaming kernel over the fp8 cache (decode_attention_fp8:
    optional in offline runs)."""
    return {**{k: f"{k}_{name}.json" for k in MICRO}, "train_step_dp2": f"train_step_dp2_{name}x2.json",
            "decode_attention_fp8": f"decode_attention_fp8_{name}.json"}


# no fp8 kernel run on this machine: its fraction is the bf16 one times the fp8 kernel's efficiency relative to bf16's,
# measured on another GPU
FP8_KV_RATIO = (0.70, "decode_attention_fp8_h100.json at de6443b (one H100, 640 rows x 600 positions, unshared "
                      "launch): the fp8 cache's kernel streams 0.7215 of the copy bandwidth where bf16's streams "
                      "1.031, 0.70 of it; applied to this machine's bf16 fraction (not measured here)")
TRAIN_SWEEP = ["--model", "llama-1b", "--seq", "2048", "--batch", "4", "--sweep", "ppo:compile:none:bf16:auto",
               "--steps", "5", "--warmup", "2"]


def _load(path: Path) -> dict:
    """A micro-benchmark's result: the record's `result`, or its last run's where it keeps several (`runs`)."""
    d = json.loads(path.read_text())
    if "runs" in d and "result" not in d:
        return d["runs"][-1]["result"]
    return d.get("result", d)


def _shape(name: str):
    from launcher.planning.costmodel import ModelShape
    from models.config import preset_config

    return ModelShape.of(preset_config(name))


def fit_decode(rows: list[dict], *, m, peak: float, hbm: float, kv_fraction: float, fm: float) -> dict:
    """Least-squares (fw, c) of the decode-step model over bench.generate's native rows, the GEMM
    fraction fm given (three batch sizes cannot separate fw, fm and c: a slow-GEMM and a high-overhead
    explanation fit them equally well, and they extrapolate differently to larger models)."""
    pts = []
    for r in rows:
        step = r["decode_s"] / r["decode_steps"]
        ctx = r["prompt_len"] + r["new_tokens_per_seq"] / 2
        w = (m.n_params - m.vocab * m.hidden) * 2
        f = (2 * m.n_matmul + 4 * m.layers * m.attn_dim * ctx) * r["batch"]
        kv = r["batch"] * ctx * m.kv_bytes_per_token / (hbm * kv_fraction)
        pts.append((step, w, f, kv))
    best = None
    for i in range(30, 101):
        fw = i / 100
        base = [max(w / (hbm * fw), f / (peak * fm)) + kv for _, w, f, kv in pts]
        c = max(0.0, sum(s - b for (s, *_), b in zip(pts, base)) / len(pts) / m.layers)
        err = sum((b + m.layers * c - s) ** 2 for (s, *_), b in zip(pts, base))
        if best is None or err < best[0]:
            best = (err, fw, c, [b + m.layers * c for b in base])
    _, fw, c, pred = best
    return {"decode_weight_bw_fraction": fw, "decode_gemm_fraction": fm, "decode_layer_overhead_s": c,
            "fit": [{"batch": r["batch"], "measured_ms": round(s * 1e3, 4), "model_ms": round(p * 1e3, 4)}
                    for r, (s, *_), p in zip(rows, pts, pred)]}


def decode_gemm_s(gen: dict, *, variant: str, batch: int) -> float | None:
    """Decode GEMM seconds per step at `batch` rows from bench.generate's kernel profiles of `variant` (one
    generate of a single new token, then one of prefill + decode steps: the GEMM time between them is the decode
    steps'); None where the run kept no profile at that batch."""
    from bench.common import is_gemm

    checks = gen.get("checks", {})
    full, pre = checks.get(f"{variant}/profile_top_kernels"), checks.get(f"{variant}/profile_prefill")
    if not (isinstance(full, dict) and isinstance(pre, dict) and full.get("rows") == batch):
        return None
    gemm = [sum(r["device_ms"] for r in p["top"] if is_gemm(r["name"])) for p in (full, pre)]
    return (gemm[0] - gemm[1]) / 1e3 / full["decode_steps"]  # the single-token generate decodes nothing


def derive(files: dict[str, Path], *, name: str = "h200") -> dict:
    """The calibration dict of machine `name` (SPECS' facts) from its micro-benchmarks' JSON results
    (micro_files' keys -> paths)."""
    if name not in SPECS:
        raise ValueError(f"no machine facts for {name!r} (memory, node size, links): add them to bench.calibrate."
                         f"SPECS (have {', '.join(SPECS)})")
    spec = SPECS[name]
    env, att, gen, train, resh = (_load(files[k]) for k in MICRO)  # train_step_dp2, decode_attention_fp8: optional
    from ppo.metrics.flops import spec_peak_flops

    # the field's convention: every fraction of peak against the device's dense bf16 spec peak (989 TFLOP/s on
    # H100/H200 SXM); the measured matmul ceiling stays in the source for reference
    measured, hbm = env["matmul_tflops"] * 1e12, env["copy_tb_s"] * 1e12
    peak = spec_peak_flops(env.get("gpu")) or measured
    m = _shape(gen.get("model", "llama-1b"))
    kv_fraction = sum(r["best"]["hbm_fraction"] for r in att["rows"]) / len(att["rows"])
    if files.get("decode_attention_fp8") and Path(files["decode_attention_fp8"]).is_file():
        fp8 = _load(files["decode_attention_fp8"])["rows"]
        fp8_fraction, fp8_why = sum(r["best"]["hbm_fraction"] for r in fp8) / len(fp8), "measured (files)"
    else:
        fp8_fraction, fp8_why = kv_fraction * FP8_KV_RATIO[0], FP8_KV_RATIO[1]
    native = sorted((r for r in gen["results"] if r["engine"].startswith("native") and "decode_s" in r),
                    key=lambda r: r["batch"])
    variant = native[-1]["engine"]
    native = [dict(r, prompt_len=gen["prompt_len"], new_tokens_per_seq=gen["new_tokens"])
              for r in native if r["engine"] == variant]
    rows256 = 256 * (2 * m.n_matmul + 4 * m.layers * m.attn_dim * (gen["prompt_len"] + gen["new_tokens"] / 2))
    gemm_s = decode_gemm_s(gen, variant=variant, batch=256)
    gemm_why = (f"from this run's kernel profiles at 256 rows ({files['generate']}): "
                f"{gemm_s * 1e3 if gemm_s else 0:.3f} ms of decode GEMMs per step")
    if gemm_s is None:
        if name not in DECODE_GEMM_S_AT_256_ROWS:
            raise ValueError(f"{files['generate']} kept no kernel profile at 256 rows and no decode GEMM time is "
                             f"stated for {name!r}: run bench.generate with its profile (bench.calibrate's own does)")
        gemm_s = DECODE_GEMM_S_AT_256_ROWS[name]
        gemm_why = (f"from the kernel profile: {gemm_s * 1e3} ms of decode GEMMs per step at 256 rows "
                    f"(generate_h200.json, docs/history/measurements.md 'Rollout')")
    fm = round(rows256 / gemm_s / peak, 3)
    decode = fit_decode(native, m=m, peak=peak, hbm=hbm, kv_fraction=kv_fraction, fm=fm)
    big = native[-1]
    p = gen["prompt_len"]
    prefill_flops = (2 * m.n_matmul * p + 4 * m.layers * m.attn_dim * p * (p + 1) / 2) * big["batch"]
    ppo = next(r for r in train["results"] if r.get("mode") == "ppo" and r.get("compile") and "mfu" in r
               and r.get("attn", "auto") == "auto")
    seq_len = train["seq"] / ppo.get("seqs_per_row", 1)
    ctx = (seq_len + 1) / 2
    update_fpt = 6 * m.n_matmul + 12 * m.layers * m.attn_dim * ctx
    forward_fpt = 2 * m.n_matmul + 4 * m.layers * m.attn_dim * ctx
    tokens = train["batch"] * train["seq"]
    act = (ppo["peak_mem_gb"] * 1e9 - 8 * m.n_params) / (m.layers * tokens * m.hidden)
    dp_eff = {"update": 1.0, "forward": 1.0}
    if files.get("train_step_dp2") and Path(files["train_step_dp2"]).is_file():
        two = _load(files["train_step_dp2"])
        row = next(r for r in two["results"] if r.get("mode") == "ppo" and "mfu" in r)
        dp_eff = {"update": round(row["tokens_per_s"] / two["dp"] / ppo["tokens_per_s"], 4),
                  "forward": round(row["logprob_tokens_per_s"] / two["dp"] / ppo["logprob_tokens_per_s"], 4)}
    cal = {
        "name": name, "peak_flops": peak, "hbm_bytes_per_s": hbm,
        "mfu_update": round(ppo["tokens_per_s"] * update_fpt / peak, 4),
        "mfu_forward": round(ppo["logprob_tokens_per_s"] * forward_fpt / peak, 4),
        "mfu_prefill": round(prefill_flops / big["prefill_s"] / peak, 4),
        "dp_update_efficiency": dp_eff["update"], "dp_forward_efficiency": dp_eff["forward"],
        "decode_weight_bw_fraction": decode["decode_weight_bw_fraction"],
        "decode_gemm_fraction": decode["decode_gemm_fraction"],
        "decode_kv_bw_fraction": round(kv_fraction, 4),
        "decode_kv_fp8_bw_fraction": round(fp8_fraction, 4),
        "decode_layer_overhead_s": round(decode["decode_layer_overhead_s"], 8),
        "activation_bytes_per_token_layer_hidden": round(act, 2),
        "reshard_bytes_per_s": round(resh["bytes_received_per_rank"][0] / resh["seconds"], -6),
        "nccl_intra_bytes_per_s": round(resh["allgather_GBps"] * 1e9, -6),
    }
    cal.update({k: v for k, (v, _) in {**spec, **HOST}.items()})
    cal["source"] = {
        "how": "python -m bench.calibrate (derived from the micro-benchmark results listed in files)",
        "files": {k: str(v) for k, v in files.items() if Path(v).is_file()},
        "decode_fit": decode["fit"],
        "dp_efficiency": (f"bench.train_step at dp=2 over dp=1 ({files['train_step_dp2']})"
                          if dp_eff != {"update": 1.0, "forward": 1.0} else
                          f"not measured (needs 2 GPUs: python -m bench.calibrate on 2 x {name}): 1.0, "
                          "i.e. FSDP costs only its overlapped gathers"),
        "decode_kv_fp8_bw_fraction": fp8_why,
        "decode_gemm_fraction": gemm_why,
        "stated_not_measured": {k: why for k, (_, why) in spec.items()},
        "host_from_end_to_end_runs": {k: why for k, (_, why) in HOST.items()},
        "flop_convention": ("matmul N (ppo/metrics/flops.py) plus causal attention 4 L d ctx per token forward, "
                            "x3 update; fractions of peak_flops, the device's dense bf16 spec peak ("
                            + ("the table in ppo/metrics/flops.py" if peak != measured else
                               "unknown device: the measured matmul ceiling") + ")"),
        "matmul_ceiling_flops": measured,
    }
    return cal


def _run(cmd: list[str], out: Path) -> Path:
    """Run one micro-benchmark; its last stdout line (one JSON object) goes to `out`."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True, cwd=ROOT, env=env)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    out.write_text(json.dumps({"command": "python -m " + " ".join(cmd),
                               "result": json.loads(res.stdout.strip().splitlines()[-1])}))
    return out


def measure(workdir: Path, fallback: Path, *, name: str) -> dict[str, Path]:
    """Run the micro-benchmarks of one GPU of machine `name`; NCCL/reshard come from `fallback`'s committed results
    unless 2+ GPUs are present (this machine's, else the H200's: the same NVLink 4 in HGX H100 and H200 nodes)."""
    import torch

    own, h200 = micro_files(name), micro_files("h200")
    files = {
        "env_check": _run(["bench.env_check"], workdir / own["env_check"]),
        "decode_attention": _run(["bench.decode_attention", "--batches", "32,64,256", "--contexts", "256,384"],
                                 workdir / own["decode_attention"]),
        # its kernel profiles (prefill alone, then prefill + decode) give the decode GEMM time (decode_gemm_s)
        "generate": _run(["bench.generate", "--model", "llama-1b", "--engine", "native", "--batches", "32,64,256",
                          "--native-variants", "triton+compile", "--repeats", "1", "--no-check"],
                         workdir / own["generate"]),
        "train_step": _run(["bench.train_step", *TRAIN_SWEEP], workdir / own["train_step"]),
        "decode_attention_fp8": _run(["bench.decode_attention", "--kv-dtype", "fp8", "--batches", "32,64,256",
                                      "--contexts", "256,384"], workdir / own["decode_attention_fp8"]),
    }
    for key in ("reshard", "train_step_dp2"):
        files[key] = fallback / own[key] if (fallback / own[key]).is_file() else fallback / h200[key]
    if torch.cuda.device_count() >= 2:
        files["train_step_dp2"] = _run(["torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                                        "bench.train_step", *TRAIN_SWEEP, "--dp", "2"], workdir / own["train_step_dp2"])
        files["reshard"] = _run(["torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                                 "bench.reshard", "--model", "llama-1b", "--train-tp", "2", "--gen-tp", "1",
                                 "--device", "cuda"], workdir / own["reshard"])
    return files


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the calibration JSON here (default: print only)")
    ap.add_argument("--name", default="h200", choices=sorted(SPECS), help="the machine type (SPECS: its facts)")
    ap.add_argument("--from-results", default=None, help="derive from this directory's committed results")
    ap.add_argument("--workdir", default=None, help="where the GPU run keeps the micro-benchmarks' JSON")
    args = ap.parse_args(argv)
    if args.from_results:
        src = Path(args.from_results)
        files = {k: src / v for k, v in micro_files(args.name).items()}
    else:
        work = Path(args.workdir or tempfile.mkdtemp(prefix="calibrate_"))
        work.mkdir(parents=True, exist_ok=True)
        files = measure(work, ROOT / "bench" / "results", name=args.name)
    cal = derive(files, name=args.name)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(cal, indent=2) + "\n")
    print(json.dumps(cal))
    return cal


if __name__ == "__main__":
    main()
