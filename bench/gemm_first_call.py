"""What a GEMM's first call at a new shape costs the host: cuBLAS picks a kernel per problem shape and
caches the pick, so a packed micro-batch whose token count M is new every step pays the pick in every
projection of the forward and the backward, while the device waits (the `aten::mm` gaps of the GRPO
step profiles, bench/results/profiles/).

    python -m bench.gemm_first_call --model llama-1b --tokens 23000 --shapes 6

For `--shapes` token counts near `--tokens` (each new to the process), every training GEMM of one layer
(forward x @ W^T, input gradient dy @ W, weight gradient dy^T @ x) is launched twice: the host time of
the launch (`torch.mm` returning, the device work excluded) the first time and the second. The last
stdout line is one JSON object: per projection and kind, the median first and repeat launch times (ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

import torch

from bench.decode_gemm import projections
from models import preset_config


def _launch_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return ms


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--tokens", type=int, default=23000)
    ap.add_argument("--shapes", type=int, default=6)
    args = ap.parse_args(argv)
    dev, dtype = "cuda", torch.bfloat16
    shapes = projections(preset_config(args.model))
    weights = {name: torch.randn(n, k, device=dev, dtype=dtype) for name, (n, k, _) in shapes.items()}
    times: dict[str, dict[str, list[float]]] = {}
    for i in range(args.shapes):
        m = args.tokens + 17 * i + 1  # odd, distinct, never seen before in this process
        for name, (n, k, _) in shapes.items():
            w = weights[name]
            x = torch.randn(m, k, device=dev, dtype=dtype)
            dy = torch.randn(m, n, device=dev, dtype=dtype)
            for kind, fn in (("fwd", partial(torch.mm, x, w.t())), ("dgrad", partial(torch.mm, dy, w)),
                             ("wgrad", partial(torch.mm, dy.t(), x))):
                first, again = _launch_ms(fn), _launch_ms(fn)
                t = times.setdefault(f"{name}.{kind}", {"first": [], "again": []})
                t["first"].append(first)
                t["again"].append(again)
    per = {key: {side: round(statistics.median(v), 4) for side, v in t.items()} for key, t in times.items()}
    first = sum(v["first"] for v in per.values())
    again = sum(v["again"] for v in per.values())
    result = {"bench": "gemm_first_call", "model": args.model, "device_name": torch.cuda.get_device_name(),
              "tokens": args.tokens, "shapes": args.shapes, "per_gemm_ms": per,
              "layer_first_ms": round(first, 3), "layer_again_ms": round(again, 3),
              "torch": torch.__version__}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
