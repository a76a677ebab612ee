"""Decode attention kernel alone: achieved HBM bandwidth of rollout/triton_attention.py per tile config.

    python -m bench.decode_attention --batches 32,64,256 --contexts 256,384    # llama-1b heads, bf16

The engine's cache layout (B rows, 8 KV heads, 16 query heads, head dim 128; --layers of them, each
attended once per timed call, time reported per layer), every row at the same position L (the new
token's K/V is written there, positions [0, L] are attended). Each config (BLOCK_N, warps, stages)
and the default (rollout.triton_attention.tile_config) is timed inside a CUDA graph; bytes = the K/V
read + the new K/V, q and output; `hbm_fraction` is bytes / time over 4.3 TB/s. The best config per
shape is checked against SDPA. The last stdout line is one JSON object; after each shape a partial one
("partial": true) goes to stderr, so a time-out keeps the shapes done.

With --samples-per-prompt N the rows also run in groups of N sharing a prompt (the fused shared-prompt
launch), for each table width in --members; --sweep-shared times those with each of --shared-tiles, each
with every register cap in --maxnreg:

    python -m bench.decode_attention --batches 256 --samples-per-prompt 8 --no-sweep --sweep-shared \
        --members 16,8 --shared-tiles 64:4:2,64:4:1 --maxnreg 80,96

With --kv-dtype fp8 the cache is rollout.kv_cache_dtype=fp8's (e4m3 values, one fp32 scale per token and head):
bytes count one byte per value plus the scales, and the check is against SDPA over the dequantized cache.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from bench.common import hbm_bytes_per_s

TILES = [(n, w, s) for n, (w, s) in itertools.product((32, 64, 128), ((2, 1), (4, 1), (4, 2), (4, 3), (4, 4), (8, 2),
                                                                       (8, 3)))]


def configs(tiles: list[tuple[int, int, int]] = TILES, maxnreg: tuple[int, ...] = ()) -> list[dict]:
    """Each tile (BLOCK_N, warps, stages) as a launch config, each also with every register cap in `maxnreg`."""
    out = [dict(BLOCK_N=n, num_warps=w, num_stages=s) for n, w, s in tiles]
    return out if not maxnreg else [t | {"maxnreg": r} for t in out for r in maxnreg]


def parse_tiles(spec: str) -> list[tuple[int, int, int]]:
    """"64:4:2,32:4:1" -> [(64, 4, 2), (32, 4, 1)] (BLOCK_N:warps:stages); empty: every tile (TILES)."""
    return [tuple(int(x) for x in t.split(":")) for t in spec.split(",") if t] or TILES


def every_layer(cache: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """attend() over each layer of `cache` in turn (one timed call = one decode step's attention)."""
    from rollout.triton_attention import attend

    for layer in range(cache.shape[0]):
        out = attend(cache, layer, *args, **kwargs)
    return out


def make_cache(layers: int, b: int, hkv: int, ctx: int, d: int, *, dtype: torch.dtype, fp8: bool,
               device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache [layers, 2, b + 1, hkv, ctx + 2, d], scales): random values in `dtype`, or (fp8) quantized like the
    engine's cache with its per-(token, head) scales [layers, 2, b + 1, hkv, ctx + 2] (else an empty tensor)."""
    from rollout.kv_cache import FP8, quantize_rows

    shape = (layers, 2, b + 1, hkv, ctx + 2, d)
    if not fp8:
        return torch.randn(shape, device=device, dtype=dtype), torch.zeros(0, device=device)
    values = torch.empty(shape, device=device, dtype=FP8)
    scales = torch.empty(shape[:-1], device=device, dtype=torch.float32)
    for layer in range(layers):  # one layer at a time: the fp32 temporaries of a whole cache would not fit
        values[layer], scales[layer] = quantize_rows(torch.randn(shape[1:], device=device, dtype=dtype))
    return values, scales


def reference(cache: torch.Tensor, scales: torch.Tensor, q: torch.Tensor, b: int, ctx: int) -> torch.Tensor:
    """SDPA in fp32 over layer 0's positions [0, ctx] of rows [0, b) (dequantized when fp8)."""
    from rollout.kv_cache import dequantized

    kv = dequantized(cache[0, :, :b, :, : ctx + 1], scales[0, :, :b, :, : ctx + 1] if scales.numel() else scales,
                     torch.float32).float()
    return F.scaled_dot_product_attention(q.float(), kv[0], kv[1], enable_gqa=q.shape[1] != kv.shape[2])


def kv_bytes(values: int, *, item: int, fp8: bool, d: int) -> float:
    """Bytes of `values` cached K and V values: item bytes each, or one byte each plus a 4-byte scale per row of d."""
    return values * (1 + 4 / d) if fp8 else values * item


def time_config(cache, pos, q, k, v, ctx: int, nbytes: int, cfg: dict | None, prefix=None, counts=None,
                scales=None) -> dict:
    """Per-layer time of one tile config (None: tile_config's) inside a CUDA graph, beside HBM bandwidth."""
    import triton.testing

    fn = functools.partial(every_layer, cache, pos, q, k, v, ctx + 1, prefix=prefix, counts=counts, config=cfg,
                           scales=scales)
    try:
        fn()  # compile outside the graph
        torch.cuda.synchronize()
        ms = triton.testing.do_bench_cudagraph(fn, rep=50) / cache.shape[0]
    except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory) is skipped
        return {"config": cfg or "default", "error": f"{type(e).__name__}: {e}"[:120]}
    return {"config": cfg or "default", "us": round(ms * 1e3, 2), "tb_per_s": round(nbytes / (ms * 1e-3) / 1e12, 3),
            "hbm_fraction": round(nbytes / (ms * 1e-3) / hbm_bytes_per_s(), 4)}


def shared_prompt_row(cache, pos, q, k, v, ctx: int, *, n: int, plen: int, item: int, unshared_us: float,
                      sweep: bool, members: int = 0, tiles: list = TILES, maxnreg: tuple[int, ...] = (),
                      scales: torch.Tensor | None = None) -> dict:
    """Rows in groups of n sharing positions [0, plen): the kernels read each group's prompt once.
    Bytes = each group's prompt K/V once + every row's own [plen, ctx) + the new K/V, q, output.

    Timed with the default tile (tile_config) and, with `sweep`, with each of `tiles` (each with every
    register cap in `maxnreg`). `members`: rows per table entry (0: the engine's, members_per_entry)."""
    from rollout import triton_attention
    from rollout.shared_prefix import members_per_entry, shared_prefix_tables

    b, hkv, d, g = q.shape[0], k.shape[1], q.shape[-1], q.shape[1] // k.shape[1]
    groups = [(plen, list(range(i, min(b, i + n)))) for i in range(0, b, n)]
    fp8 = scales is not None and scales.numel() > 0
    for _, rows in groups:  # one prefill row's copies are identical
        cache[:, :, rows[1:], :, :plen] = cache[:, :, rows[:1], :, :plen]
        if fp8:
            scales[:, :, rows[1:], :, :plen] = scales[:, :, rows[:1], :, :plen]
    m = members or members_per_entry(g)
    tables = tuple(t.cuda() for t in shared_prefix_tables(groups, rows=b, members_per_entry=m))
    counts = torch.zeros(tables[2].shape[0], hkv, dtype=torch.int32, device="cuda")  # the engine's: kept zero
    nbytes = (kv_bytes(2 * hkv * d * (len(groups) * plen + b * (ctx - plen)), item=item, fp8=fp8, d=d)
              + (2 * b * hkv * d + 2 * b * hkv * g * d) * item)

    def timed(cfg) -> dict:
        return time_config(cache, pos, q, k, v, ctx, nbytes, cfg, prefix=tables, counts=counts, scales=scales)

    default = timed(None)
    out = triton_attention.attend(cache, 0, pos, q, k, v, ctx + 1, prefix=tables, scales=scales).float()
    ref = reference(cache, scales if fp8 else cache.new_zeros(0), q, b, ctx)
    row = {"samples_per_prompt": n, "prompt_len": plen, "members_per_entry": tables[2].shape[1], "us": default["us"],
           "speedup_vs_unshared": round(unshared_us / default["us"], 3), "bytes_mb": round(nbytes / 1e6, 2),
           "hbm_fraction": default["hbm_fraction"], "max_abs_err_vs_sdpa": round((out - ref).abs().max().item(), 5),
           "default_tile": triton_attention.tile_config(b, ctx + 1, shared=True, fp8=fp8)}
    if sweep:
        ok = sorted((t for t in map(timed, configs(tiles, maxnreg)) if "us" in t), key=lambda t: t["us"])
        row["best"], row["top5"] = ok[0], ok[:5]
    return row


def main(argv: list[str] | None = None) -> dict:
    from rollout.triton_attention import attend, tile_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="32,64,256")
    ap.add_argument("--contexts", default="160,256,384")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--samples-per-prompt", type=int, default=1,
                    help="also time shared-prompt groups of this many rows (rollout.share_prompt_kv)")
    ap.add_argument("--prompt-len", type=int, default=128, help="the groups' shared prompt length")
    ap.add_argument("--members", default="0", help="comma list of rows per shared-prompt table entry to time "
                                                   "(0: the engine's rule, shared_prefix.members_per_entry)")
    ap.add_argument("--shared-tiles", default="",
                    help="BLOCK_N:warps:stages list of the shared sweep's tiles (default: all)")
    ap.add_argument("--maxnreg", default="", help="comma list of register caps the sweeps add to each tile")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16", help="the cache's (fp8: with scales)")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false",
                    help="time tile_config's tile only (not every fixed config)")
    ap.add_argument("--sweep-shared", action="store_true", help="time every fixed config on the shared rows too")
    ap.add_argument("--layers", type=int, default=16,
                    help="layers of KV in the cache, each attended once per timed call (16: no L2 reuse between "
                         "calls, as in the engine, where each layer's KV is distinct; 1, the setup of the records "
                         "before a656859, lets small batches' KV stay in L2)")
    args = ap.parse_args(argv)
    dev, dtype = "cuda", torch.bfloat16
    hkv, g, d = args.kv_heads, args.group, args.head_dim

    def summary(rows: list[dict], *, partial: bool) -> dict:
        return {"bench": "decode_attention", "partial": partial, "device_name": torch.cuda.get_device_name(),
                "dtype": "bfloat16", "kv_dtype": args.kv_dtype, "layers": args.layers, "kv_heads": hkv, "group": g,
                "head_dim": d,
                "hbm_bytes_per_s": hbm_bytes_per_s(), "rows": rows, "samples_per_prompt": args.samples_per_prompt,
                "prompt_len": args.prompt_len}

    item = torch.empty((), dtype=dtype).element_size()
    fp8 = args.kv_dtype == "fp8"
    caps = tuple(int(r) for r in args.maxnreg.split(",") if r)
    rows = []
    for b, ctx in itertools.product(map(int, args.batches.split(",")), map(int, args.contexts.split(","))):
        cache, scales = make_cache(args.layers, b, hkv, ctx, d, dtype=dtype, fp8=fp8, device=dev)
        q = torch.randn(b, hkv * g, 1, d, device=dev, dtype=dtype)
        k, v = (torch.randn(b, hkv, 1, d, device=dev, dtype=dtype) for _ in range(2))
        pos = torch.full((b,), ctx, device=dev, dtype=torch.int64)
        nbytes = (kv_bytes(2 * b * hkv * ctx * d, item=item, fp8=fp8, d=d)
                  + (2 * b * hkv * d + 2 * b * hkv * g * d) * item)
        swept = configs(maxnreg=caps) if args.sweep else [tile_config(b, ctx + 1)]
        timed = [time_config(cache, pos, q, k, v, ctx, nbytes, cfg, scales=scales) for cfg in [None, *swept]]
        ok = [t for t in timed if "us" in t]
        best = min((t for t in ok if t["config"] != "default"), key=lambda t: t["us"])
        out = attend(cache, 0, pos, q, k, v, ctx + 1, config=best["config"], scales=scales).float()
        ref = reference(cache, scales, q, b, ctx)
        default = next((t for t in ok if t["config"] == "default"), None)
        rows.append({"batch": b, "context": ctx, "bytes_mb": round(nbytes / 1e6, 2), "best": best,
                     "default": default, "default_tile": tile_config(b, ctx + 1),
                     "max_abs_err_vs_sdpa": round((out - ref).abs().max().item(), 5),
                     "top5": sorted(ok, key=lambda t: t["us"])[:5]})
        n, plen = args.samples_per_prompt, min(args.prompt_len, ctx)
        if n > 1 and default is not None:
            shared = [shared_prompt_row(cache, pos, q, k, v, ctx, n=n, plen=plen, item=item, unshared_us=default["us"],
                                        sweep=args.sweep_shared, members=int(m),
                                        tiles=parse_tiles(args.shared_tiles), maxnreg=caps, scales=scales)
                      for m in args.members.split(",")]
            rows[-1]["shared_prompt"] = shared[0] if len(shared) == 1 else shared
        print(f"B={b:<4} L={ctx:<4} best {best['us']:7.2f} us {best['tb_per_s']:.2f} TB/s "
              f"({best['hbm_fraction'] * 100:.1f}%) {best['config']}; default "
              f"{default and default['us']} us", flush=True)
        print(json.dumps(summary(rows, partial=True)), file=sys.stderr, flush=True)  # a time-out keeps these
    result = summary(rows, partial=False)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
