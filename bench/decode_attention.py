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
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from bench.generate import HBM_BYTES_PER_S

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


def time_config(cache, pos, q, k, v, ctx: int, nbytes: int, cfg: dict | None, prefix=None, counts=None) -> dict:
    """Per-layer time of one tile config (None: tile_config's) inside a CUDA graph, beside HBM bandwidth."""
    import triton.testing

    fn = functools.partial(every_layer, cache, pos, q, k, v, ctx + 1, prefix=prefix, counts=counts, config=cfg)
    try:
        fn()  # compile outside the graph
        torch.cuda.synchronize()
        ms = triton.testing.do_bench_cudagraph(fn, rep=50) / cache.shape[0]
    except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory) is skipped
        return {"config": cfg or "default", "error": f"{type(e).__name__}: {e}"[:120]}
    return {"config": cfg or "default", "us": round(ms * 1e3, 2), "tb_per_s": round(nbytes / (ms * 1e-3) / 1e12, 3),
            "hbm_fraction": round(nbytes / (ms * 1e-3) / HBM_BYTES_PER_S, 4)}


def shared_prompt_row(cache, pos, q, k, v, ctx: int, *, n: int, plen: int, item: int, unshared_us: float,
                      sweep: bool, members: int = 0, tiles: list = TILES, maxnreg: tuple[int, ...] = ()) -> dict:
    """Rows in groups of n sharing positions [0, plen): the kernels read each group's prompt once.
    Bytes = each group's prompt K/V once + every row's own [plen, ctx) + the new K/V, q, output.

    Timed with the default tile (tile_config) and, with `sweep`, with each of `tiles` (each with every
    register cap in `maxnreg`). `members`: rows per table entry (0: the engine's, members_per_entry)."""
    from rollout import triton_attention
    from rollout.shared_prefix import members_per_entry, shared_prefix_tables

    b, hkv, d, g = q.shape[0], k.shape[1], q.shape[-1], q.shape[1] // k.shape[1]
    groups = [(plen, list(range(i, min(b, i + n)))) for i in range(0, b, n)]
    for _, rows in groups:  # one prefill row's copies are identical
        cache[:, :, rows[1:], :, :plen] = cache[:, :, rows[:1], :, :plen]
    m = members or members_per_entry(g)
    tables = tuple(t.cuda() for t in shared_prefix_tables(groups, rows=b, members_per_entry=m))
    counts = torch.zeros(tables[2].shape[0], hkv, dtype=torch.int32, device="cuda")  # the engine's: kept zero
    nbytes = (2 * hkv * d * (len(groups) * plen + b * (ctx - plen)) + 2 * b * hkv * d + 2 * b * hkv * g * d) * item

    def timed(cfg) -> dict:
        return time_config(cache, pos, q, k, v, ctx, nbytes, cfg, prefix=tables, counts=counts)

    default = timed(None)
    out = triton_attention.attend(cache, 0, pos, q, k, v, ctx + 1, prefix=tables).float()
    kk, vv = cache[0, 0, :b, :, : ctx + 1].float(), cache[0, 1, :b, :, : ctx + 1].float()
    ref = F.scaled_dot_product_attention(q.float(), kk, vv, enable_gqa=g > 1)
    row = {"samples_per_prompt": n, "prompt_len": plen, "members_per_entry": tables[2].shape[1], "us": default["us"],
           "speedup_vs_unshared": round(unshared_us / default["us"], 3), "bytes_mb": round(nbytes / 1e6, 2),
           "hbm_fraction": default["hbm_fraction"], "max_abs_err_vs_sdpa": round((out - ref).abs().max().item(), 5)}
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
    ap.add_argument("--maxnreg", default="", help="comma list of register caps the shared sweep adds to each tile")
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
                "dtype": "bfloat16", "layers": args.layers, "kv_heads": hkv, "group": g, "head_dim": d,
                "hbm_bytes_per_s": HBM_BYTES_PER_S, "rows": rows, "samples_per_prompt": args.samples_per_prompt,
                "prompt_len": args.prompt_len}

    item = torch.empty((), dtype=dtype).element_size()
    rows = []
    for b, ctx in itertools.product(map(int, args.batches.split(",")), map(int, args.contexts.split(","))):
        cache = torch.randn(args.layers, 2, b + 1, hkv, ctx + 2, d, device=dev, dtype=dtype)
        q = torch.randn(b, hkv * g, 1, d, device=dev, dtype=dtype)
        k, v = (torch.randn(b, hkv, 1, d, device=dev, dtype=dtype) for _ in range(2))
        pos = torch.full((b,), ctx, device=dev, dtype=torch.int64)
        nbytes = (2 * b * hkv * ctx * d + 2 * b * hkv * d + 2 * b * hkv * g * d) * item
        swept = configs() if args.sweep else [tile_config(b, ctx + 1)]
        timed = [time_config(cache, pos, q, k, v, ctx, nbytes, cfg) for cfg in [None, *swept]]
        ok = [t for t in timed if "us" in t]
        best = min((t for t in ok if t["config"] != "default"), key=lambda t: t["us"])
        out = attend(cache, 0, pos, q, k, v, ctx + 1, config=best["config"]).float()
        kk, vv = cache[0, 0, :b, :, : ctx + 1].float(), cache[0, 1, :b, :, : ctx + 1].float()
        ref = F.scaled_dot_product_attention(q.float(), kk, vv, enable_gqa=g > 1)
        default = next((t for t in ok if t["config"] == "default"), None)
        rows.append({"batch": b, "context": ctx, "bytes_mb": round(nbytes / 1e6, 2), "best": best,
                     "default": default, "default_tile": tile_config(b, ctx + 1),
                     "max_abs_err_vs_sdpa": round((out - ref).abs().max().item(), 5),
                     "top5": sorted(ok, key=lambda t: t["us"])[:5]})
        n, plen = args.samples_per_prompt, min(args.prompt_len, ctx)
        if n > 1 and default is not None:
            caps = tuple(int(r) for r in args.maxnreg.split(",") if r)
            shared = [shared_prompt_row(cache, pos, q, k, v, ctx, n=n, plen=plen, item=item, unshared_us=default["us"],
                                        sweep=args.sweep_shared, members=int(m),
                                        tiles=parse_tiles(args.shared_tiles), maxnreg=caps)
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
