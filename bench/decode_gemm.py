"""The decode step's projections alone: cuBLAS (what the engine runs) against Inductor's autotuned
Triton GEMM templates, per shape, each beside its ceiling.

    python -m bench.decode_gemm --model llama-1b --rows 32,64,256

For every projection of one decode step (the fused q/k/v and gate/up weights, o_proj, down_proj and
the LM head) at M rows: x [M, K] @ W[N, K].T in bf16, over one weight per layer (as a decode step
reads them: from HBM, not L2), timed inside a CUDA graph, reported per call. The ceiling of a shape is
the slower of its FLOPs at the measured 790 TFLOP/s and its bytes (W, x and the output) at 4.3 TB/s;
`ceiling_fraction` = ceiling time / measured time. "autotuned" is torch.compile with
mode="max-autotune-no-cudagraphs" on that static shape (Inductor times Triton templates and cuBLAS
itself and keeps the fastest); where it beats cuBLAS, the engine's 64x64-tile cuBLAS choices at
decode sizes (docs/history/speed_round2_profile.md, item 4) have a better kernel to take. The last stdout
line is one JSON object; after each shape a partial one ("partial": true) goes to stderr.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

from bench.common import H200_MATMUL_CEILING_FLOPS, hbm_bytes_per_s
from models import preset_config


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


def split_k(x: torch.Tensor, w: torch.Tensor, splits: int, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ w[N, K].T as `splits` partial products over K chunks: [splits, M, N] in `out_dtype`, one
    cuBLAS strided-batched GEMM over views (no copies): `splits` times the output tiles of one GEMM."""
    (m, k), n = x.shape, w.shape[0]
    c = k // splits
    return torch.bmm(x.view(m, splits, c).transpose(0, 1), w.view(n, splits, c).permute(1, 2, 0), out_dtype=out_dtype)


def _split_k_fn(splits: int, out_dtype: torch.dtype, reduce: bool):
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        parts = split_k(x, w, splits, out_dtype)
        return parts.sum(0, dtype=torch.float32).to(x.dtype) if reduce else parts[0]
    return fn


def _each(fn, x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    for w in weights:
        fn(x, w)


def ceiling_us(m: int, n: int, k: int, item: int) -> float:
    return max(2 * m * n * k / H200_MATMUL_CEILING_FLOPS, (n * k + m * k + m * n) * item / hbm_bytes_per_s()) * 1e6


def main(argv: list[str] | None = None) -> dict:
    import triton.testing

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--rows", default="32,64,256")
    ap.add_argument("--no-autotune", action="store_true", help="time cuBLAS only")
    ap.add_argument("--split-k", default="", help="comma list of K splits to time as one cuBLAS batched GEMM "
                    "(fp32 and bf16 partials, each with its reduction and alone), e.g. 2,4")
    args = ap.parse_args(argv)
    dtype, dev = torch.bfloat16, "cuda"
    item = torch.empty((), dtype=dtype).element_size()
    shapes = projections(preset_config(args.model))
    rows, step = [], {}

    def summary(*, partial: bool) -> dict:
        """Per-step totals count only the row sizes finished (every projection of that size)."""
        done = {r["rows"] for r in rows if sum(x["rows"] == r["rows"] for x in rows) == len(shapes)}
        per_step = {m: {kind: round(us / 1e3, 4) for kind, us in kinds.items()}
                    | {"ceiling": round(sum(ceiling_us(m, n, k, item) * c for n, k, c in shapes.values()) / 1e3, 4)}
                    for m, kinds in step.items() if m in done}
        return {"bench": "decode_gemm", "partial": partial, "model": args.model,
                "device_name": torch.cuda.get_device_name(), "dtype": "bfloat16",
                "peak_flops": H200_MATMUL_CEILING_FLOPS,
                "hbm_bytes_per_s": hbm_bytes_per_s(), "rows": rows, "per_step_ms": per_step}

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
            for splits in (int(v) for v in args.split_k.split(",") if v):
                if k % splits == 0:  # "_nored": the partials alone (a consumer kernel would fuse their sum)
                    for tag, odt in (("f32", torch.float32), ("bf16", dtype)):
                        timed[f"splitk{splits}_{tag}"] = _split_k_fn(splits, odt, True)
                        timed[f"splitk{splits}_{tag}_nored"] = _split_k_fn(splits, odt, False)
            if not args.no_autotune:  # a fresh compile per shape: static, autotuned for exactly (M, N, K)
                torch._dynamo.reset()  # (else the 9th shape would pass dynamo's recompile limit and run eagerly)
                timed["autotuned"] = torch.compile(_linear, mode="max-autotune-no-cudagraphs", dynamic=False)
            for kind, fn in timed.items():
                try:
                    out = fn(x, w)  # compiles and autotunes outside the graph
                    torch.cuda.synchronize()
                    us = triton.testing.do_bench_cudagraph(functools.partial(_each, fn, x, ws), rep=50) * 1e3 / count
                except Exception as e:  # noqa: BLE001 - a backend that does not compile is reported, not fatal
                    row[kind] = {"error": f"{type(e).__name__}: {e}"[:160]}
                    continue
                err = (out.float() - linear(x, w).float()).abs().max().item() if "nored" not in kind else None
                row[kind] = {"us": round(us, 2), "ceiling_fraction": round(ceil / us, 4),
                             "tflop_per_s": round(2 * m * n * k / us / 1e6, 1), "max_abs_diff_vs_cublas": err}
                step.setdefault(m, {}).setdefault(kind, 0.0)
                step[m][kind] += us * count
            rows.append(row)
            print(f"M={m:<4} {name:<9} N={n:<6} K={k:<5} ceiling {ceil:7.2f} us  " + "  ".join(
                f"{kd} {row[kd]['us']:7.2f} us ({row[kd]['ceiling_fraction'] * 100:.0f}%)"
                for kd in timed if "us" in row.get(kd, {})), flush=True)
            print(json.dumps(summary(partial=True)), file=sys.stderr, flush=True)  # a time-out keeps these
    result = summary(partial=False)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
