"""Generation throughput: native engine vs Hugging Face generate, against the HBM roofline.

    python -m bench.generate --model llama-1b --batches 32,64,256 --prompt-len 128 --new-tokens 256 \
        --engine both --device cuda --dtype bfloat16
    python -m bench.generate --model tiny --device cpu --batches 4 --new-tokens 16 --engine both \
        --native-variants auto,bmm   # CPU check (add auto+compile to check compile; slow on CPU)

Random-init weights, random prompts, ignore_eos (fixed lengths), temperature 1 sampling. The roofline
of one decode step is (bytes of all weights read + KV bytes of every active context) / 4.3 TB/s,
summed over the decode steps; `roofline_fraction` = measured new tokens/s over roofline tokens/s
(the measured time includes prefill). The embedding table is not counted as read (a decode step
gathers B of its rows); `roofline_fraction_all_weights` counts it, as issue 4 does (2-5% higher).
`roofline_fraction_with_prefill_all_weights` adds the prefill's own floor to that roofline's time: its FLOPs (2 N
per prompt token, causal attention, the LM head once per row) at the device's dense bf16 spec peak (a CUDA device
in ppo.metrics.flops' table; None elsewhere), since the measured time includes the prefill.
Native engines report the median of --repeats timed runs. The last stdout line is one JSON object;
after each engine variant a partial one ("partial": true) goes to stderr, so a timeout still leaves
the finished part. A mixture of experts' step reads only the experts its rows go to (step_weight_params):
    python -m bench.generate --model qwen3-30b-a3b-6l --engine native --batches 32,256 --native-variants auto
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch

from bench.common import hbm_bytes_per_s
from bench.hf_engine import HFEngine
from models import build_model, preset_config
from models.config import ModelConfig
from ppo.metrics.flops import flops_per_token, spec_peak_flops
from rollout import NativeEngine, RolloutConfig, SamplingParams
from rollout.kv_cache import kv_bytes_per_token


def decode_roofline(cfg: ModelConfig, *, batch: int, prompt_len: int, new_tokens: int, dtype: torch.dtype,
                    all_weights: bool = False, samples_per_prompt: int = 1,
                    kv_dtype: torch.dtype | None = None) -> dict:
    """HBM-roofline tokens/s of generating `new_tokens` for `batch` sequences of `prompt_len`.

    Decode step s (1..new_tokens-1) reads every weight once (the embedding table only for B rows:
    not counted, unless tied to lm_head, or with all_weights=True, the issue's convention, which
    gives a ~2% lower roofline for llama-1b) and the KV of prompt_len + s positions per sequence.
    With n samples per prompt the prompt's KV counts once per group of n (the least any engine must
    read; one reading it per sample is held to that ceiling too). kv_dtype: the cache's, when not the weights'
    (an fp8 cache counts its values and their row scales)."""
    item = torch.empty((), dtype=dtype).element_size()
    embed = 0 if cfg.tie_word_embeddings or all_weights else cfg.vocab_size * cfg.hidden_size
    weight_bytes = (step_weight_params(cfg, batch=batch) - embed) * item
    per_tok = kv_bytes_per_token(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                                 head_dim=cfg.head_dim, dtype=kv_dtype or dtype)
    steps = range(1, new_tokens)
    kv_bytes = sum((batch * s + -(-batch // samples_per_prompt) * prompt_len) * per_tok for s in steps)
    total = len(steps) * weight_bytes + kv_bytes
    seconds = total / hbm_bytes_per_s()
    return {"roofline_tokens_per_s": batch * new_tokens / seconds if seconds else float("inf"),
            "roofline_decode_s": seconds,
            "bytes_per_decode_step_gb": total / max(1, len(steps)) / 1e9,
            "weight_gb": weight_bytes / 1e9, "kv_gb_per_token_x1e6": per_tok * 1e6 / 1e9}


def prefill_floor_s(cfg: ModelConfig, *, batch: int, prompt_len: int, peak_flops: float,
                    samples_per_prompt: int = 1) -> float:
    """The least time the prompts' prefill takes at `peak_flops`: each prompt once (its n samples share it), 2 N_body
    per token plus causal attention, and the LM head once per row (the first sampled token's logits)."""
    prompts = -(-batch // samples_per_prompt)
    per_token = flops_per_token(cfg.matmul_params(lm_head=False), layers=cfg.num_hidden_layers,
                                attn_width=cfg.num_attention_heads * cfg.head_dim, context=(prompt_len + 1) / 2,
                                train=False)
    return (prompts * prompt_len * per_token + batch * 2 * cfg.vocab_size * cfg.hidden_size) / peak_flops


def step_weight_params(cfg: ModelConfig, *, batch: int) -> float:
    """Parameters one decode step of `batch` rows reads: every one, except that a mixture of experts reads only
    the experts its rows go to, E * (1 - (1 - k / E) ** batch) per MoE layer in expectation under uniform routing
    (Qwen3-30B-A3B at 256 rows: all 128; at 32 rows: 112)."""
    if not cfg.is_moe:
        return cfg.num_params()
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    untouched = e * (1 - k / e) ** batch
    return cfg.num_params() - len(cfg.moe_layers) * untouched * 3 * cfg.hidden_size * cfg.moe_intermediate_size


def random_model(name: str, *, device, dtype, seed: int):
    """Random-init model built directly on the device (normal(0, 0.02), norms at 1)."""
    model = build_model(preset_config(name), dtype=dtype, device=device, init=False)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if name_.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.model.inv_freq = model.model.inv_freq.to(device)
    return model.eval().requires_grad_(False)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed_generate(engine, prompts, params, device) -> tuple[list, float, float | None]:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    _sync(device)
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 1e9 if torch.device(device).type == "cuda" else None
    return outs, wall, peak


def check_against_trainer(engine, model, prompts, *, new_tokens: int) -> dict:
    """Greedy agreement (engine token == trainer argmax, teacher-forced) and max |log-prob diff| of
    greedy and T=1 sampled tokens against the trainer forward in the same dtype."""
    out = {}
    for tag, params in (("greedy", SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)),
                        ("sampled", SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True,
                                                   seed=0))):
        comps = engine.generate(prompts, params)
        agree, diffs = [], []
        for c in comps:
            ids = torch.tensor([c.prompt_ids + c.token_ids], device=next(model.parameters()).device)
            with torch.no_grad():
                logits = model(ids)[0, len(c.prompt_ids) - 1: -1].float()
            toks = torch.tensor(c.token_ids, device=logits.device)
            ref = torch.log_softmax(logits, -1).gather(1, toks[:, None])[:, 0].cpu()
            diffs.append((ref - torch.tensor(c.logprobs)).abs().max().item())
            agree.append((logits.argmax(-1) == toks).float().mean().item())
        out[f"{tag}_logprob_maxdiff"] = max(diffs)
        if tag == "greedy":
            out["greedy_agreement"] = sum(agree) / len(agree)
    return out


def profile_decode(engine, prompts, *, new_tokens: int, top: int = 25) -> dict:
    """Device kernels of one generate with eager launches (each kernel attributed): the top kernels by
    device time, and the kernel launches and device time per decode step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.runner.use_graphs
    engine.runner.use_graphs = False
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True)
    try:
        engine.stats.update(decode_steps=0)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, params)
            torch.cuda.synchronize()
    finally:
        engine.runner.use_graphs = graphs
    steps = max(1, engine.stats["decode_steps"])
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    rows = sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
    total_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    return {"decode_steps": steps, "kernel_launches": sum(e.count for e in kernels),
            "device_ms": round(total_ms, 3), "rows": len(prompts),
            "top": [{"name": e.key[:90], "device_ms": round(e.self_device_time_total / 1e3, 3), "calls": e.count}
                    for e in rows]}


def run_native(args, variant: str, name: str, model, cfg, batches, gen, record, checks, device) -> None:
    """One native-engine variant: '<kernel>[+compile][+eager][+lt][+noshare][+nofold][+fp8]' (eager = no CUDA
    graphs, lt = cuBLASLt, noshare = every sample reads its own copy of the prompt's KV, nofold = rollout.fold_norms
    off, fp8 = rollout.kv_cache_dtype=fp8)."""
    parts = variant.split("+")
    max_len = args.prompt_len + args.new_tokens
    config = RolloutConfig(max_model_len=max_len, max_num_seqs=max(batches),
                           max_num_batched_tokens=max(args.prefill_tokens, max_len), decode_attention=parts[0],
                           enable_cuda_graph="eager" not in parts and not args.no_cuda_graph,
                           compile="compile" in parts, gpu_memory_fraction=args.gpu_memory_fraction,
                           share_prompt_kv="noshare" not in parts, fold_norms="nofold" not in parts,
                           kv_cache_dtype="fp8" if "fp8" in parts else "auto",
                           kv_cache_tokens=None if device.startswith("cuda") else max(batches) * max_len)
    if "lt" in parts:  # every GEMM through cuBLASLt's heuristic instead of cuBLAS's (the A/B of a setting)
        torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        engine = NativeEngine.from_model(model, config=config)
        _run_native_batches(args, engine, name, model, cfg, batches, gen, record, checks, device, variant)
    finally:
        torch.backends.cuda.preferred_blas_library("default")


def _run_native_batches(args, engine, name, model, cfg, batches, gen, record, checks, device, variant) -> None:
    for batch in batches:
        prompts = torch.randint(3, cfg.vocab_size, (batch // args.n, args.prompt_len), generator=gen).tolist()
        params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, n=args.n)
        t0 = time.perf_counter()
        engine.generate(prompts, params)  # warm-up: compiles and captures this batch's decode graphs
        warm = time.perf_counter() - t0
        runs = []
        for _ in range(args.repeats):  # the median run by wall time, with its own stage times
            engine.stats.update(prefill_s=0.0, decode_s=0.0, decode_steps=0, prefill_steps=0)
            runs.append((*timed_generate(engine, prompts, params, device), dict(engine.stats)))
        outs, wall, peak, st = sorted(runs, key=lambda r: r[1])[len(runs) // 2]
        roof = decode_roofline(cfg, batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                               dtype=engine.runner.dtype, samples_per_prompt=args.n, kv_dtype=engine.runner.kv_dtype)
        decode_tps = batch * (args.new_tokens - 1) / max(st["decode_s"], 1e-9)
        roof_decode_tps = batch * (args.new_tokens - 1) / max(roof["roofline_decode_s"], 1e-12)
        record(name, batch, wall, peak, outs,
               {"warmup_s": round(warm, 2), "prefill_s": round(st["prefill_s"], 4),
                "decode_s": round(st["decode_s"], 4), "decode_steps": st["decode_steps"],
                "graphs": len(engine.runner.graphs), "decode_only_tokens_per_s": round(decode_tps, 1),
                "decode_only_roofline_fraction": round(decode_tps / roof_decode_tps, 4),
                "repeats_wall_s": [round(r[1], 4) for r in runs], "kv_slots": engine.runner.num_slots,
                "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                "compile_error": getattr(engine.runner._decode, "error", None),
                "prefill_compile_error": getattr(engine.runner._prefill, "error", None),
                "graph_error": engine.runner.graph_error,
                "decode_kernels": {f"{b}x{kv}": k for (b, kv), k in sorted(engine.runner.kernel_for.items())}},
               kv_dtype=engine.runner.kv_dtype)
    if not args.no_check:
        prompts = torch.randint(3, cfg.vocab_size, (min(8, max(batches)), args.prompt_len), generator=gen).tolist()
        checks[name] = check_against_trainer(engine, model, prompts, new_tokens=min(32, args.new_tokens))
    kind = "compiled" if "compile" in variant else "eager"
    if args.profile and device.startswith("cuda") and kind not in args.profiled:
        args.profiled.add(kind)  # the kernel mix of the first eager-forward and the first compiled variant
        prompts = torch.randint(3, cfg.vocab_size, (max(batches), args.prompt_len), generator=gen).tolist()
        # prefill alone (one new token), then prefill + 31 decode steps: the difference is decode's
        for tag, n in (("profile_prefill", 1), ("profile_top_kernels", min(32, args.new_tokens))):
            try:
                checks[f"{name}/{tag}"] = profile_decode(engine, prompts, new_tokens=n)
            except Exception as e:  # noqa: BLE001 - diagnostics must not cost the measurement
                checks[f"{name}/{tag}"] = f"{type(e).__name__}: {e}"[:300]
    engine.sleep()


def run_hf(args, cache: str, model, cfg, batches, gen, record, checks, device) -> None:
    engine = HFEngine.from_model(model, cache_implementation=cache, max_model_len=args.prompt_len + args.new_tokens + 1)
    for batch in batches:
        prompts = torch.randint(3, cfg.vocab_size, (batch, args.prompt_len), generator=gen).tolist()
        params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=1)
        engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=min(8, args.new_tokens), ignore_eos=True))
        outs, wall, peak = timed_generate(engine, prompts, params, device)
        record(f"hf-{cache}", batch, wall, peak, outs, {})
    if not args.no_check:
        prompts = torch.randint(3, cfg.vocab_size, (min(8, max(batches)), args.prompt_len), generator=gen).tolist()
        checks[f"hf-{cache}"] = check_against_trainer(engine, model, prompts, new_tokens=min(32, args.new_tokens))
    engine.sleep()


def summarize(args, device, dtype, batches, results, checks, *, partial: bool) -> dict:
    speedup = {}
    for batch in batches:
        best = {kind: max((r["new_tokens_per_s"] for r in results if r.get("batch") == batch
                           and r["engine"].startswith(kind)), default=None) for kind in ("native", "hf")}
        if best["native"] and best["hf"]:
            speedup[str(batch)] = round(best["native"] / best["hf"], 2)
    return {"bench": "generate", "partial": partial, "model": args.model, "device": device,
            "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "dtype": str(dtype).removeprefix("torch."), "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "samples_per_prompt": args.n, "hbm_bytes_per_s": hbm_bytes_per_s(),
            "results": results,
            "checks": checks, "native_over_hf_speedup": speedup}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--batches", default=None, help="comma list, overrides --batch (e.g. 32,64,256)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--n", type=int, default=1, help="samples per prompt (GRPO-style groups; native engines only); "
                    "the roofline then counts each prompt's KV once per group")
    ap.add_argument("--engine", choices=["native", "hf", "both"], default="both")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--hf-cache", default="dynamic,static", help="HF cache implementations to run")
    ap.add_argument("--native-variants", default="auto,auto+compile",
                    help="comma list of <auto|triton|sdpa|sdpa-efficient|sdpa-cudnn|bmm>[+compile][+eager][+lt] "
                         "(decode attention kernel; auto times them per graph shape), e.g. auto,bmm,sdpa+compile")
    ap.add_argument("--prefill-tokens", type=int, default=32768,
                    help="native max_num_batched_tokens (32768: the 256 x 128 prompts in one prefill)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per native engine and batch (median kept)")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--gpu-memory-fraction", type=float, default=0.5)
    ap.add_argument("--no-check", action="store_true", help="skip the log-prob check against the trainer")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="skip the kernel profile (top CUDA kernels of one native generate; CUDA only)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.profiled = set()
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [args.batch]
    if args.n < 1 or any(b % args.n for b in batches) or (args.n > 1 and args.engine != "native"):
        ap.error(f"--n {args.n} must divide every batch ({batches}) and needs --engine native")

    device = args.device
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    cfg = preset_config(args.model)
    model = random_model(args.model, device=device, dtype=dtype, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    results, checks = [], {}
    peak_flops = spec_peak_flops(torch.cuda.get_device_name() if device.startswith("cuda") else None)

    def record(engine_name, batch, wall, peak, outs, extra, kv_dtype=None):
        new = sum(len(c.token_ids) for c in outs)
        roof = decode_roofline(cfg, batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens, dtype=dtype,
                               samples_per_prompt=args.n, kv_dtype=kv_dtype)
        roof_all = decode_roofline(cfg, batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                   dtype=dtype, all_weights=True, samples_per_prompt=args.n, kv_dtype=kv_dtype)
        tps = new / wall
        prefill = None if peak_flops is None else prefill_floor_s(
            cfg, batch=batch, prompt_len=args.prompt_len, peak_flops=peak_flops, samples_per_prompt=args.n)
        row = {"engine": engine_name, "batch": batch, "new_tokens": new, "wall_s": round(wall, 4),
               "new_tokens_per_s": round(tps, 1), "peak_mem_gb": None if peak is None else round(peak, 3),
               "roofline_tokens_per_s": round(roof["roofline_tokens_per_s"], 1),
               "roofline_fraction": round(tps / roof["roofline_tokens_per_s"], 4),
               "roofline_fraction_all_weights": round(tps / roof_all["roofline_tokens_per_s"], 4),
               "prefill_floor_s": None if prefill is None else round(prefill, 4),
               "roofline_fraction_with_prefill_all_weights": None if prefill is None else round(
                   tps * (roof_all["roofline_decode_s"] + prefill) / (batch * args.new_tokens), 4),
               "bytes_per_decode_step_gb": round(roof["bytes_per_decode_step_gb"], 4), **extra}
        results.append(row)
        print(f"{engine_name:>14} B={batch:<4} {tps:>10.0f} tok/s  {wall:7.3f} s  "
              f"{row['roofline_fraction'] * 100:5.1f}% of HBM roofline ({roof['roofline_tokens_per_s']:.0f} tok/s)"
              f"  peak {row['peak_mem_gb']} GB", flush=True)

    # order: cheap native variants, then HF, then compiled variants (slow to compile) last, so a
    # timeout loses the least; a partial summary goes to stderr after every job
    variants = args.native_variants.split(",") if args.engine in ("native", "both") else []
    jobs = [("native", v) for v in variants if "compile" not in v]
    jobs += [("hf", c) for c in args.hf_cache.split(",")] if args.engine in ("hf", "both") else []
    jobs += [("native", v) for v in variants if "compile" in v]
    for kind, what in jobs:
        name = f"{kind}-{what}"
        try:
            if kind == "native":
                run_native(args, what, name, model, cfg, batches, gen, record, checks, device)
            else:
                run_hf(args, what, model, cfg, batches, gen, record, checks, device)
        except Exception as e:  # noqa: BLE001 - one failing variant must not lose the whole GPU run
            traceback.print_exc()
            results.append({"engine": name, "error": f"{type(e).__name__}: {e}"[:800]})
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        print(json.dumps(summarize(args, device, dtype, batches, results, checks, partial=True)),
              file=sys.stderr, flush=True)
    summary = summarize(args, device, dtype, batches, results, checks, partial=False)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
