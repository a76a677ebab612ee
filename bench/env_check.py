"""Measure the GPU machine's ceilings and check the ops hybridrl relies on, in one short run.

    python -m bench.env_check            # one JSON line: matmul TFLOP/s, copy TB/s, versions, op checks

The ceilings measured here are what every benchmark's MFU / roofline fraction is judged against.
"""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F


def _time(fn, *, warmup: int = 3, iters: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _copy_bandwidth(dev: torch.device) -> float:
    """Device-to-device copy of 2 GiB, counting bytes read plus written, in TB/s."""
    x = torch.empty(2**31 // 2, device=dev, dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    return round(2 * x.numel() * 2 / _time(lambda: y.copy_(x)) / 1e12, 2)


def main() -> None:
    out: dict = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        out["error"] = "no CUDA device"
        print(json.dumps(out))
        return
    dev = torch.device("cuda")
    out["gpu"] = torch.cuda.get_device_name()
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    out["matmul_tflops"] = round(2 * n**3 / _time(lambda: a @ b) / 1e12, 1)
    out["copy_tb_s"] = _copy_bandwidth(dev)
    # flash SDPA with GQA (enable_gqa) at the llama-1b shape
    q = torch.randn(4, 16, 2048, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(4, 8, 2048, 128, device=dev, dtype=torch.bfloat16)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    checks = {}
    for name, backend in (("flash_gqa", SDPBackend.FLASH_ATTENTION), ("efficient_gqa", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn_gqa", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                t = _time(lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True))
            checks[name] = round(4 * 4 * 16 * 2048 * 2048 * 128 / 2 / t / 1e12, 1)  # causal fwd TFLOP/s
        except RuntimeError as e:
            checks[name] = f"unavailable: {str(e).splitlines()[0][:120]}"
    out["sdpa_causal_fwd_tflops"] = checks
    t0 = time.perf_counter()
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

        out["flex_attention"] = "importable"
    except ImportError as e:
        out["flex_attention"] = f"missing: {e}"
    out["check_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
