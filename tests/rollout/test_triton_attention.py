"""The Triton decode-attention kernel, run by Triton's CPU interpreter (TRITON_INTERPRET=1) in a child
process (the variable must be set before triton is imported, and must not leak into other tests)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(code: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("block_n", [16, 64])
def test_kernel_equals_sdpa_over_the_live_positions_and_writes_the_new_kv(block_n):
    run_interpreted(f"""
        import torch, torch.nn.functional as F
        from rollout.triton_attention import attend
        torch.manual_seed(0)
        layers, slots, hkv, slot_len, d = 3, 6, 2, 150, 16
        config = dict(BLOCK_N={block_n}, num_warps=4, num_stages=2)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            for g in (1, 2, 3):  # MHA, GQA, a group that is not a power of two
                cache = torch.randn(layers, 2, slots, hkv, slot_len, d).to(dtype)
                b = 5
                q = torch.randn(b, hkv * g, 1, d).to(dtype)
                k, v = (torch.randn(b, hkv, 1, d).to(dtype) for _ in range(2))
                pos = torch.tensor([0, 1, 63, 64, 149])  # empty history, tile edges, the last position
                want = cache.clone()
                for r in range(b):
                    want[1, 0, r, :, pos[r]], want[1, 1, r, :, pos[r]] = k[r, :, 0], v[r, :, 0]
                out = attend(cache, 1, pos, q, k, v, config=config)
                assert torch.equal(cache, want), "only (layer 1, row r, position pos[r]) may change"
                for r in range(b):
                    kk, vv = (want[1, i, r, :, : pos[r] + 1].float()[None] for i in (0, 1))
                    ref = F.scaled_dot_product_attention(q[r: r + 1].float(), kk, vv, enable_gqa=g > 1)
                    err = (out[r: r + 1].float() - ref).abs().max().item()
                    assert err < tol, (dtype, g, r, err)
        print("ok")
    """)


@pytest.mark.parametrize("compiled,fused", [(False, True), (True, True), (False, False)],
                         ids=["eager", "compiled", "unfused-projections"])
def test_engine_with_triton_decode_matches_naive_greedy_and_trainer_logprobs(compiled, fused):
    # the engine passes q/k un-rotated and the kernel applies RoPE; compiled: through Dynamo/Inductor too
    out = run_interpreted(f"""
        import torch
        from rollout import NativeEngine, SamplingParams
        from tests.rollout.test_engine import PROMPTS, config, naive_greedy, peaked_model, trainer_logprobs
        model = peaked_model()
        engine = NativeEngine.from_model(model, config=config(decode_attention="triton", compile={compiled},
                                                               fuse_projections={fused}))
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = engine.generate(PROMPTS[:3], greedy)
        assert [c.token_ids for c in outs] == [naive_greedy(model, q, 8) for q in PROMPTS[:3]]
        sampled = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=3, ignore_eos=True)
        for c in engine.generate(PROMPTS[:2], sampled):
            ref = trainer_logprobs(model, c.prompt_ids, c.token_ids, 1.0)
            assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= 1e-5
        assert getattr(engine.runner._decode, "error", None) is None
        print("ok")
    """)
    assert "ok" in out


def test_prefill_write_kernel_equals_the_indexed_copy():
    run_interpreted("""
        import torch
        from rollout.triton_attention import write_prefill
        torch.manual_seed(0)
        cache = torch.randn(2, 2, 7, 3, 80, 16)
        want = cache.clone()
        qkv = torch.randn(4, 3 * 3, 70, 16)  # k and v as strided views of one tensor, like the fused QKV
        k, v = qkv[:, 3:6], qkv[:, 6:]
        slots, rows = torch.tensor([5, 0, 2, 6]), torch.tensor([1, 1, 3, 0])  # n samples share a row
        want[1, 0, slots, :, :70], want[1, 1, slots, :, :70] = k[rows], v[rows]
        write_prefill(cache, 1, slots, rows, k, v)
        assert torch.equal(cache, want)
        print("ok")
    """)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, dict(BLOCK_N=32, num_warps=4, num_stages=3),
                                    dict(BLOCK_N=128, num_warps=8, num_stages=2)], ids=["autotuned", "n32", "n128"])
def test_compiled_kernels_on_cuda_equal_sdpa(config):
    import torch
    import torch.nn.functional as F

    from rollout.triton_attention import attend, write_prefill

    torch.manual_seed(0)
    b, hkv, g, d, slot_len = 37, 8, 2, 128, 300
    cache = torch.randn(2, 2, b + 1, hkv, slot_len + 1, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(b, hkv * g, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    pos = torch.randint(0, slot_len, (b,), device="cuda")
    out = attend(cache, 1, pos, q, k, v, slot_len, config=config).float()
    for r in range(b):
        assert torch.equal(cache[1, 0, r, :, pos[r]], k[r, :, 0]) and torch.equal(cache[1, 1, r, :, pos[r]], v[r, :, 0])
        kk, vv = (cache[1, i, r, :, : pos[r] + 1].float()[None] for i in (0, 1))
        ref = F.scaled_dot_product_attention(q[r: r + 1].float(), kk, vv, enable_gqa=True)
        assert (out[r: r + 1] - ref).abs().max().item() < 2e-2
    # RoPE inside the kernel at long-context positions equals the model's rotation outside it
    from models.llama import apply_rotary, rotary_cos_sin

    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    big = torch.randint(0, 32768, (b,), device="cuda")
    cos, sin = rotary_cos_sin(inv_freq, big[:, None], torch.bfloat16)
    ref_cache, cache2 = cache.clone(), cache.clone()
    small = torch.randint(0, slot_len, (b,), device="cuda")  # attend a short history, rotate as at `big`
    want = attend(ref_cache, 0, small, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, slot_len,
                  config=config).float()
    got = attend(cache2, 0, small, q, k, v, slot_len, cos[:, 0, 0], sin[:, 0, 0], config=config).float()
    assert (got - want).abs().max().item() < 2e-2
    # the rotated k: fp32 math rounded once vs three bf16 roundings outside, so within one bf16 ulp
    assert torch.allclose(cache2.float(), ref_cache.float(), rtol=1e-2, atol=1e-2)
    kp, vp = (torch.randn(5, hkv, 130, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots, rows = torch.tensor([3, 9, 0], device="cuda"), torch.tensor([4, 4, 1], device="cuda")
    want = cache.clone()
    want[0, 0, slots, :, :130], want[0, 1, slots, :, :130] = kp[rows], vp[rows]
    write_prefill(cache, 0, slots, rows, kp, vp)
    assert torch.equal(cache, want)


def test_kernel_applies_rope_to_q_and_the_new_k_like_the_model():
    run_interpreted("""
        import torch, torch.nn.functional as F
        from models.llama import apply_rotary, rotary_cos_sin
        from rollout.triton_attention import attend
        torch.manual_seed(0)
        layers, slots, hkv, g, slot_len, d = 2, 5, 2, 2, 90, 16
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            cache = torch.randn(layers, 2, slots, hkv, slot_len, d).to(dtype)
            b = 4
            q = torch.randn(b, hkv * g, 1, d).to(dtype)
            k, v = (torch.randn(b, hkv, 1, d).to(dtype) for _ in range(2))
            pos = torch.tensor([0, 7, 64, 89])
            cos, sin = rotary_cos_sin(inv_freq, pos[:, None], dtype)  # [B, 1, 1, D]
            qr, kr = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            want = cache.clone()
            out_ref = attend(want, 1, pos, qr, kr, v, slot_len)  # rotated outside: the reference
            out = attend(cache, 1, pos, q, k, v, slot_len, cos[:, 0, 0], sin[:, 0, 0])
            assert torch.allclose(cache.float(), want.float(), rtol=tol, atol=tol), "the cache holds the rotated k"
            assert (out.float() - out_ref.float()).abs().max().item() <= tol, dtype
        print("ok")
    """)
