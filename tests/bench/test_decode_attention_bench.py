"""bench.decode_attention's cache, byte count and reference (the timing needs CUDA): under Triton's CPU
interpreter, the kernel over the bench's bf16 and fp8 caches equals the bench's SDPA reference."""

from __future__ import annotations

from tests.triton_interp import run_interpreted


def test_bench_caches_and_reference_agree_with_the_kernel_bf16_and_fp8():
    run_interpreted("""
        import torch
        from bench.decode_attention import kv_bytes, make_cache, reference
        from rollout.triton_attention import attend
        torch.manual_seed(0)
        b, hkv, g, d, ctx = 3, 2, 2, 16, 40
        assert kv_bytes(100, item=2, fp8=False, d=16) == 200 and kv_bytes(128, item=2, fp8=True, d=16) == 160
        for fp8 in (False, True):
            cache, scales = make_cache(2, b, hkv, ctx, d, dtype=torch.bfloat16, fp8=fp8, device="cpu")
            assert cache.shape == (2, 2, b + 1, hkv, ctx + 2, d)
            assert (cache.dtype == torch.float8_e4m3fn) == fp8 and (scales.numel() > 0) == fp8
            # fp32 queries under the interpreter for the bf16 cache (it has no bf16 dot); bf16 ones meet fp8 tiles
            q = torch.randn(b, hkv * g, 1, d, dtype=torch.bfloat16 if fp8 else torch.float32)
            k, v = (torch.randn(b, hkv, 1, d, dtype=q.dtype) for _ in range(2))
            c = cache if fp8 else cache.float()
            pos = torch.full((b,), ctx, dtype=torch.int64)
            out = attend(c, 0, pos, q, k, v, ctx + 1, scales=scales, config=dict(BLOCK_N=16, num_warps=4,
                                                                                 num_stages=2)).float()
            ref = reference(c, scales, q, b, ctx)  # the kernel wrote the new K/V at position ctx first
            assert (out - ref).abs().max().item() < (0.02 if fp8 else 1e-4), (fp8, (out - ref).abs().max())
        print("ok")
    """)
