"""The decode step's projections alone: cuBLAS (what the engine runs) against Inductor's autotuned
Triton GEMM templates and our split-K kernel (rollout/triton_gemm.py), per shape, each beside its ceiling.

    python -m bench.decode_gemm --model llama-1b --rows 32,64,256

For every projection of one decode step (the fused q/k/v and gate/up weights, o_proj, down_proj and
the LM head) at M rows: x [M, K] @ W[N, K].T in bf16, over one weight per layer (as a decode step
reads them: from HBM, not L2), timed inside a CUDA graph, reported per call. The ceiling of a shape is
the slower of its FLOPs at the measured 790 TFLOP/s and its bytes (W, x and the output) at 4.3 TB/s;
`ceiling_fraction` = ceiling time / measured time. "autotuned" is torch.compile with
mode="max-autotune-no-cudagraphs" on that static shape (Inductor times Triton templates and cuBLAS
itself and keeps the fastest); where it beats cuBLAS, the engine's 64x64-tile cuBLAS choices at
decode sizes (docs/speed_round2_profile.md, item 4) have a better kernel to take. "splitk" is the
fastest of a sweep of split-K launches (splitk_candidates: tile, K-step, split count, reduction; its
"config" and every candidate's "sweep" time are in the row); "splitk_auto" is decode_linear, the launch
that rollout.triton_gemm.choose_config picks (or F.linear where it declines: "config" null). The last
stdout line is one JSON object; after each shape a partial one ("partial": true) goes to stderr.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

import torch

from bench.common import H200_BF16_FLOPS
from bench.generate import HBM_BYTES_PER_S
from models import preset_config
from rollout.triton_gemm import choose_config, decode_linear, splitk_linear


def projections(cfg) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, per-step count) of one decode step's matmuls (the engine fuses q/k/v and gate/up)."""
    h, d = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    n_layers = cfg.num_hidden_layers
    return {"qkv": (qkv, h, n_layers), "o_proj": (h, cfg.num_attention_heads * d, n_layers),
            "gate_up": (2 * cfg.intermediate_size, h, n_layers), "down_proj": (h, cfg.intermediate_size, n_layers),
            "lm_head": (cfg.vocab_size, h, 1)}


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w)


def _transposed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, x.t()).t()


def _each(fn, x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    for w in weights:
        fn(x, w)


def splitk_candidates(m: int, n: int, k: int, *, sm_count: int) -> list[dict]:
    """The split-K launches swept for one shape (<= 24 for llama-1b's): 64/128-row tiles (128 only past
    M = 64) by 64/128 columns, K-steps of 64/128, split_k 1..8 where split_k * K-step divides K and, for
    split_k > 1, the grid stays within one wave (tiles * split_k <= sm_count); both reductions when split."""
    out = []
    for bm, bn, bk in itertools.product((64, 128), (64, 128), (64, 128)):
        tiles = -(-m // bm) * -(-n // bn)
        for split_k in (1, 2, 4, 8):
            if bm > max(64, m) or k % (split_k * bk) or (split_k > 1 and tiles * split_k > sm_count):
                continue
            for reduce in ("serial", "gather") if split_k > 1 else ("serial",):
                out.append(dict(block_m=bm, block_n=bn, block_k=bk, split_k=split_k, reduce=reduce,
                                num_warps=8 if bm * bn >= 128 * 128 else 4, num_stages=3 if bk == 128 else 4))
    return out


def _label(c: dict) -> str:
    tile = f"{c['block_m']}x{c['block_n']}x{c['block_k']}"
    return f"{tile} s{c['split_k']} {c['reduce']} w{c['num_warps']} st{c['num_stages']}"


def ceiling_us(m: int, n: int, k: int, item: int) -> float:
    return max(2 * m * n * k / H200_BF16_FLOPS, (n * k + m * k + m * n) * item / HBM_BYTES_PER_S) * 1e6


def main(argv: list[str] | None = None) -> dict:
    import triton.testing

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--rows", default="32,64,256")
    ap.add_argument("--no-autotune", action="store_true", help="skip Inductor's max-autotune variant")
    ap.add_argument("--no-splitk", action="store_true", help="skip the split-K variants (splitk, splitk_auto)")
    args = ap.parse_args(argv)
    dtype, dev = torch.bfloat16, "cuda"
    item = torch.empty((), dtype=dtype).element_size()
    shapes = projections(preset_config(args.model))
    rows, step = [], {}
    sm_count = torch.cuda.get_device_properties(dev).multi_processor_count

    def bench_us(fn, x: torch.Tensor, ws: list[torch.Tensor], rep: int = 50) -> tuple[torch.Tensor, float]:
        """fn(x, ws[0]) once (compiles and autotunes outside the graph), then us per call over all of ws."""
        out = fn(x, ws[0])
        torch.cuda.synchronize()
        return out, triton.testing.do_bench_cudagraph(functools.partial(_each, fn, x, ws), rep=rep) * 1e3 / len(ws)

    def summary(*, partial: bool) -> dict:
        """Per-step totals count only the row sizes finished (every projection of that size)."""
        done = {r["rows"] for r in rows if sum(x["rows"] == r["rows"] for x in rows) == len(shapes)}
        per_step = {m: {kind: round(us / 1e3, 4) for kind, us in kinds.items()}
                    | {"ceiling": round(sum(ceiling_us(m, n, k, item) * c for n, k, c in shapes.values()) / 1e3, 4)}
                    for m, kinds in step.items() if m in done}
        return {"bench": "decode_gemm", "partial": partial, "model": args.model,
                "device_name": torch.cuda.get_device_name(), "dtype": "bfloat16", "peak_flops": H200_BF16_FLOPS,
                "hbm_bytes_per_s": HBM_BYTES_PER_S, "rows": rows, "per_step_ms": per_step}

    for m in map(int, args.rows.split(",")):
        for name, (n, k, count) in shapes.items():
            x = torch.randn(m, k, device=dev, dtype=dtype)
            # one weight per layer, as in a decode step: together they exceed L2, so each call reads its
            # weight from HBM (a single weight timed alone would stay in L2 and beat the HBM ceiling)
            ws = [torch.randn(n, k, device=dev, dtype=dtype) * k ** -0.5 for _ in range(count)]
            w = ws[0]
            ceil = ceiling_us(m, n, k, item)
            row = {"rows": m, "name": name, "n": n, "k": k, "per_step": count, "ceiling_us": round(ceil, 2)}
            linear = torch.nn.functional.linear
            # "cublas_t": the same product as W @ x^T (M and N swapped for cuBLAS's tile heuristics), transposed back
            timed = {"cublas": linear, "cublas_t": _transposed}
            if not args.no_autotune:  # a fresh compile per shape: static, autotuned for exactly (M, N, K)
                torch._dynamo.reset()  # (else the 9th shape would pass dynamo's recompile limit and run eagerly)
                timed["autotuned"] = torch.compile(_linear, mode="max-autotune-no-cudagraphs", dynamic=False)
            extra = {}  # per-variant keys beside the timing (the split-K config)
            if not args.no_splitk:
                # the sweep at rep=20 (24 launches a shape), its fastest timed again like the other variants
                sweep = {}
                for c in splitk_candidates(m, n, k, sm_count=sm_count):
                    try:
                        sweep[_label(c)] = (c, bench_us(functools.partial(splitk_linear, **c), x, ws, rep=20)[1])
                    except Exception as e:  # noqa: BLE001 - a launch that does not compile (shared memory) is skipped
                        sweep[_label(c)] = (c, None)
                        print(f"  {_label(c)}: {type(e).__name__}: {e}"[:200], file=sys.stderr)
                timed_ok = {lb: cu for lb, cu in sweep.items() if cu[1] is not None}
                if timed_ok:
                    best = min(timed_ok.values(), key=lambda cu: cu[1])[0]
                    timed["splitk"] = functools.partial(splitk_linear, **best)
                    extra["splitk"] = {"config": best, "sweep": {lb: cu[1] and round(cu[1], 2)
                                                                 for lb, cu in sweep.items()}}
                timed["splitk_auto"] = decode_linear
                extra["splitk_auto"] = {"config": choose_config(m, n, k, sm_count=sm_count)}
            for kind, fn in timed.items():
                try:
                    out, us = bench_us(fn, x, ws)
                except Exception as e:  # noqa: BLE001 - a backend that does not compile is reported, not fatal
                    row[kind] = {"error": f"{type(e).__name__}: {e}"[:160]}
                    continue
                err = (out.float() - linear(x, w).float()).abs().max().item()
                row[kind] = {"us": round(us, 2), "ceiling_fraction": round(ceil / us, 4),
                             "tflop_per_s": round(2 * m * n * k / us / 1e6, 1), "max_abs_diff_vs_cublas": err,
                             **extra.get(kind, {})}
                step.setdefault(m, {}).setdefault(kind, 0.0)
                step[m][kind] += us * count
            rows.append(row)
            print(f"M={m:<4} {name:<9} N={n:<6} K={k:<5} ceiling {ceil:7.2f} us  " + "  ".join(
                f"{kd} {row[kd]['us']:7.2f} us ({row[kd]['ceiling_fraction'] * 100:.0f}%)"
                for kd in timed if "us" in row.get(kd, {})), flush=True)
            if "splitk" in extra:
                print(f"  splitk best: {_label(extra['splitk']['config'])}", flush=True)
            print(json.dumps(summary(partial=True)), file=sys.stderr, flush=True)  # a time-out keeps these
    result = summary(partial=False)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
