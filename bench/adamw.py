"""The optimizer step over a model's parameters: the Triton update (parallel/triton_adamw.py) against
torch's path, each against the HBM roofline.

    python -m bench.adamw --model llama-1b                       # fp32 masters, bf16 main grads (one micro-batch)
    python -m bench.adamw --model llama-1b --grads fp32          # main grads summed over several micro-batches
    python -m bench.adamw --model llama-1b --layout bf16         # bf16 weights and moments (ShardLocalAdamW)
    python -m bench.adamw --model llama-1b --sweep 8192:1024:4,16384:2048:8,32768:2048:8   # CHUNK:BLOCK:warps
    python -m bench.adamw --model tiny --device cpu              # CPU smoke run (torch's path only)

One step = AdamW on every parameter from its gradient x a clip coefficient. `--layout masters`
(MasterWeightAdamW): fp32 masters and moments updated and the bf16 weights written; bytes per parameter:
the kernel's minimum is 28 with bf16 grads (grad read 2; master, exp_avg, exp_avg_sq read and written 24;
bf16 weight written 2), 30 with fp32 grads; torch's path also casts a bf16 grad into fp32 (6), scales it (8)
and copies the master into the weight (6). `--layout bf16` (ShardLocalAdamW, bf16 weights, grads and
moments): 14 bytes per parameter on either path, plus torch's in-place scaling (4). `ms` is the time per
step of steps run back to back (the device's, where the host keeps ahead, as in training), `ms_synced` the
median of steps each synchronised (host preparation + device). Each path's
`hbm_fraction` is its own bytes over `ms` against the device's measured copy bandwidth (bench.common.hbm_bytes_per_s),
and `min_bytes_fraction` the kernel's minimum bytes over that path's time. The paths' weights after one step
from the same state are compared (`max_rel_diff_weights`). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import (
    add_device_args,
    emit_json,
    hbm_bytes_per_s,
    resolve_device,
    run_info,
    synchronize,
    time_steps,
)
from models import build_model, preset_config
from parallel import triton_adamw
from parallel.master_weights import MasterWeightAdamW, attach_main_grads
from parallel.shard_adamw import ShardLocalAdamW


def _setup(cfg, *, device, layout: str, grads_dtype, kernel: bool):
    model = build_model(cfg, dtype=torch.bfloat16, device=device, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator(device=device).manual_seed(1)
    kw = dict(lr=1e-6, betas=(0.9, 0.95), weight_decay=0.1, kernel=kernel)
    if layout == "bf16":
        for p in params:
            p.grad = (torch.randn(p.shape, device=device, generator=gen) * 1e-3).to(torch.bfloat16)
        return params, ShardLocalAdamW(params, **kw)
    attach_main_grads(model)
    for p in params:
        p.main_grad = (torch.randn(p.shape, device=device, generator=gen) * 1e-3).to(grads_dtype)
    return params, MasterWeightAdamW(params, **kw)


def _weights(opt, params) -> list[torch.Tensor]:
    return [opt.state[p].get("master", p).detach().float().clone() for p in params]


def _bytes(layout: str, grads_dtype, *, kernel: bool) -> int:
    """Bytes per parameter one step moves (module docstring)."""
    if layout == "bf16":
        return 14 + (0 if kernel else 4)
    grad = 2 if grads_dtype == torch.bfloat16 else 4
    return grad + 26 + (0 if kernel else (6 if grad == 2 else 0) + 8 + 6)


def _pipelined(step, *, device, steps: int) -> float:
    """Seconds per step over `steps` steps run back to back (one sync at the end): the device's time per step
    where the host keeps ahead, as in training (the host's preparation overlaps the device's previous work)."""
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return (time.perf_counter() - t0) / steps


def bench_paths(cfg, *, device, layout: str, grads_dtype, steps: int) -> dict:
    n = sum(p.numel() for p in build_model(cfg, dtype=torch.bfloat16, device="meta").parameters() if p.requires_grad)
    minimum = n * _bytes(layout, grads_dtype, kernel=True)
    out: dict = {"params": n, "layout": layout, "grads": "bfloat16" if layout == "bf16" else
                 str(grads_dtype).removeprefix("torch."), "min_bytes": minimum}
    paths = {"torch_path": False}
    if triton_adamw.available(device):
        paths = {"triton_kernel": True, **paths}
    weights = {}
    for name, kernel in paths.items():
        params, opt = _setup(cfg, device=device, layout=layout, grads_dtype=grads_dtype, kernel=kernel)
        # the first step allocates the state; torch's path scales the gradients in place, so the timed steps
        # scale by 1 (the kernel's work does not depend on the factor)
        opt.step(grad_scale=0.7)
        weights[name] = _weights(opt, params)
        times = time_steps(lambda opt=opt: opt.step(grad_scale=0.999), device=device, warmup=2, steps=steps)
        sec = _pipelined(lambda opt=opt: opt.step(grad_scale=0.999), device=device, steps=steps)
        moved = n * _bytes(layout, grads_dtype, kernel=kernel)
        out[name] = {"ms": sec * 1e3, "ms_synced": sorted(times)[len(times) // 2] * 1e3, "bytes": moved,
                     "hbm_fraction": moved / sec / hbm_bytes_per_s(),
                     "min_bytes_fraction": minimum / sec / hbm_bytes_per_s()}
        del params, opt
        torch.cuda.empty_cache() if device.type == "cuda" else None
    if len(weights) == 2:
        a, b = weights.values()
        out["max_rel_diff_weights"] = max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()
                                          for x, y in zip(a, b))
        out["kernel_speedup"] = out["torch_path"]["ms"] / out["triton_kernel"]["ms"]
    return out


def sweep(cfg, *, device, layout: str, grads_dtype, steps: int, configs: list[tuple[int, int, int]]) -> list[dict]:
    params, opt = _setup(cfg, device=device, layout=layout, grads_dtype=grads_dtype, kernel=True)
    opt.step()
    minimum = sum(p.numel() for p in params) * _bytes(layout, grads_dtype, kernel=True)
    saved = triton_adamw.CHUNK, triton_adamw.BLOCK, triton_adamw.NUM_WARPS
    rows = []
    try:
        for chunk, block, warps in configs:
            triton_adamw.CHUNK, triton_adamw.BLOCK, triton_adamw.NUM_WARPS = chunk, block, warps
            time_steps(lambda: opt.step(grad_scale=0.7), device=device, warmup=2, steps=1)  # compiles
            sec = _pipelined(lambda: opt.step(grad_scale=0.7), device=device, steps=steps)
            rows.append({"chunk": chunk, "block": block, "num_warps": warps, "ms": sec * 1e3,
                         "hbm_fraction": minimum / sec / hbm_bytes_per_s()})
            print("sweep:", rows[-1], flush=True)
    finally:
        triton_adamw.CHUNK, triton_adamw.BLOCK, triton_adamw.NUM_WARPS = saved
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = add_device_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--layout", choices=("masters", "bf16"), default="masters",
                   help="fp32 masters of bf16 weights (MasterWeightAdamW), or bf16 weights and moments")
    p.add_argument("--grads", choices=("bf16", "fp32"), default="bf16", help="main-grad dtype (--layout masters)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--sweep", default="", help="comma list of CHUNK:BLOCK:num_warps for the kernel")
    args = p.parse_args(argv)
    device, _ = resolve_device(args)
    cfg = preset_config(args.model)
    grads_dtype = torch.bfloat16 if args.grads == "bf16" else torch.float32
    result = {"bench": "adamw", "model": args.model,
              **bench_paths(cfg, device=device, layout=args.layout, grads_dtype=grads_dtype, steps=args.steps)}
    print("paths:", result, flush=True)
    if args.sweep:
        if not triton_adamw.available(device):
            raise SystemExit("--sweep times the Triton kernel: it needs CUDA with triton")
        configs = [tuple(int(x) for x in c.split(":")) for c in args.sweep.split(",")]
        result["sweep"] = sweep(cfg, device=device, layout=args.layout, grads_dtype=grads_dtype, steps=args.steps,
                                configs=configs)
    result |= run_info(device)
    emit_json(result)
    return result


if __name__ == "__main__":
    main()
