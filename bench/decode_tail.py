"""The engine's decode step after its forward: the draw and the rows' advance, fused or as separate ops.

    python -m bench.decode_tail --batches 32,64,256 --vocab 32000      # one H200, bf16 logits

Each variant runs inside a CUDA graph (triton.testing.do_bench_cudagraph), as the engine replays it:
- `unfused`: what rollout/model_runner.py ran before triton_sampling.decode_tail: the uniforms' gather,
  sample_unfiltered, two copies into the float64 result and the rows' advance as torch ops (~12 kernels);
- `draw_only`: sample_unfiltered alone (the draw's own time, the floor of any fusion);
- `fused`: triton_sampling.decode_tail (one kernel), and `fused_uncapped` without its register cap.
Every row is active (its position advances, clamped at the end of its slot). Bytes = the logits read once;
`hbm_fraction` is those bytes over the time at 4.3 TB/s. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.common import hbm_bytes_per_s


def variants(b: int, vocab: int, slots: int, slot_len: int) -> dict:
    """The three variants as closures over one set of engine-shaped buffers."""
    from rollout.triton_sampling import decode_tail, sample_unfiltered

    dev = torch.device("cuda")
    logits = (torch.randn(b, vocab, device=dev) * 3).to(torch.bfloat16)
    meta_i = torch.zeros(5, slots, dtype=torch.int64, device=dev)
    meta_i[1] = torch.randint(0, slot_len // 2, (slots,), device=dev)
    meta_i[4] = 1
    meta_f = torch.ones(2, slots, device=dev)
    u_table = torch.rand(slots + 1, slot_len + 1, device=dev).clamp(1e-7, 1 - 1e-7)
    out = torch.zeros(2 * slots, dtype=torch.float64, device=dev)

    def unfused():
        ids, pos, active = meta_i[0, :b], meta_i[1, :b], meta_i[4, :b]
        u = u_table[:b].gather(1, (pos + 1)[:, None])[:, 0]
        tok, lp = sample_unfiltered(logits, meta_f[0, :b], u)
        out[:b].copy_(tok)
        out[b: 2 * b].copy_(lp)
        next_pos = torch.clamp(pos + active, max=slot_len - 1)
        ids.copy_(torch.where(active > 0, tok, torch.zeros_like(tok)))
        pos.copy_(next_pos)

    def draw_only():
        sample_unfiltered(logits, meta_f[0, :b], u_table[:b, 0])

    def fused():
        decode_tail(logits, meta_i, meta_f[0], u_table, out, max_position=slot_len - 1)

    def fused_uncapped():
        decode_tail(logits, meta_i, meta_f[0], u_table, out, max_position=slot_len - 1, maxnreg=None)

    return {"unfused": unfused, "draw_only": draw_only, "fused": fused, "fused_uncapped": fused_uncapped}


def main(argv: list[str] | None = None) -> dict:
    import triton.testing

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="32,64,256")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--slot-len", type=int, default=384)
    args = ap.parse_args(argv)
    rows = []
    for b in map(int, args.batches.split(",")):
        row = {"batch": b, "logits_mb": round(b * args.vocab * 2 / 1e6, 2)}
        for name, fn in variants(b, args.vocab, b + 8, args.slot_len).items():
            fn()  # compile outside the graph
            torch.cuda.synchronize()
            us = triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3
            hbm = b * args.vocab * 2 / (us * 1e-6) / hbm_bytes_per_s()
            row[name] = {"us": round(us, 2), "hbm_fraction": round(hbm, 4)}
        row["fused_saves_us"] = round(row["unfused"]["us"] - row["fused"]["us"], 2)
        rows.append(row)
        print(f"B={b:<4} unfused {row['unfused']['us']:7.2f} us  draw only {row['draw_only']['us']:7.2f}  "
              f"fused {row['fused']['us']:7.2f}  uncapped {row['fused_uncapped']['us']:7.2f}", flush=True)
    result = {"bench": "decode_tail", "device_name": torch.cuda.get_device_name(), "vocab": args.vocab,
              "dtype": "bfloat16", "hbm_bytes_per_s": hbm_bytes_per_s(), "rows": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
