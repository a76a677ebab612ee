"""Decode attention as ONE Triton kernel per layer: store the new token's K/V in its cache slot and
attend over positions [0, position] of that slot, reading exactly the live KV once.

Why a kernel of our own: SDPA over the slot cache needs an additive mask and a KV-length bucket
(reads up to a bucket of padding per row), the mem-efficient kernel tiles 64 query rows for our 2
(GQA) queries, and the K/V write is two more scatter kernels per layer. Here one program per
(row, KV head) loads the G = Hq / Hkv query heads of that KV head once, streams the row's K/V in
BLOCK_N-position tiles with an online softmax (fp32 accumulation, exp2), folds the new token's K/V in
from registers (so the cache store has no read-after-write hazard) and writes the G outputs. Given
the rows' RoPE cos/sin it also rotates q and the new k (the engine's decode then runs no separate
RoPE kernel: one of ~10 kernels per layer, whose launch gaps cost as much as their work at decode
sizes). The prefill's K/V write is one kernel here too (write_prefill).

    out = decode_attention(cache, layer, positions, q, k, v, kv_len)   # q [B, Hq, 1, D], k/v [B, Hkv, 1, D]
    out = decode_attention(cache, layer, positions, q, k, v, kv_len, cos, sin)  # q/k before RoPE

`cache` is the engine's [layers, 2, slots, Hkv, slot_len, D] tensor; row b uses slot b. A torch custom
op, so torch.compile treats it as opaque and CUDA graphs capture it. Under TRITON_INTERPRET=1 it runs
on CPU tensors (tests/rollout/test_triton_attention.py checks it against SDPA there).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine then never offers the "triton" kernel
    triton = None


def available(device: torch.device, head_dim: int) -> bool:
    """Whether the kernel can run here: CUDA with triton (or its CPU interpreter) and a power-of-two
    head dim >= 16 (one [BLOCK, D] tile per load)."""
    import os

    if triton is None or head_dim < 16 or head_dim & (head_dim - 1):
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _decode_kernel(q_ptr, kn_ptr, vn_ptr, cache_ptr, pos_ptr, out_ptr, cos_ptr, sin_ptr, qk_scale,
                       s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_ob, s_oh, s_rb,
                       s_cv, s_cb, s_ch, s_ct, rows_p2, kv_p2,
                       G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr,
                       ROPE: tl.constexpr, BLOCK_N: tl.constexpr):
        # scores and P @ V on tensor cores, the G query heads padded to BLOCK_G >= 16 rows (a CUDA-core
        # broadcast-multiply-reduce over the G real rows measured 0.6-0.8x as fast on an H200)
        b = tl.program_id(0)
        h = tl.program_id(1)
        pos = tl.load(pos_ptr + b)  # this row attends [0, pos]; pos is where the new token goes
        d = tl.arange(0, D)
        g = tl.arange(0, BLOCK_G)
        g_ok = g < G
        q_at = q_ptr + b * s_qb + (h * G + g)[:, None] * s_qh
        q = tl.load(q_at + d[None, :], mask=g_ok[:, None], other=0.0)
        k_new = tl.load(kn_ptr + b * s_kb + h * s_kh + d)
        v_new = tl.load(vn_ptr + b * s_vb + h * s_vh + d)
        if ROPE:  # q and the new k arrive un-rotated: x * cos + rotate_half(x) * sin with the row's cos/sin
            # [D] (the model's own values), in fp32 and rounded once, as the compiled model's RoPE does
            half = (d + D // 2) % D
            sign = tl.where(d < D // 2, -1.0, 1.0)
            cos = tl.load(cos_ptr + b * s_rb + d).to(tl.float32)
            sin = tl.load(sin_ptr + b * s_rb + d).to(tl.float32) * sign
            q_half = tl.load(q_at + half[None, :], mask=g_ok[:, None], other=0.0)
            q = (q.to(tl.float32) * cos[None, :] + q_half.to(tl.float32) * sin[None, :]).to(q_ptr.dtype.element_ty)
            k_half = tl.load(kn_ptr + b * s_kb + h * s_kh + half)
            k_new = (k_new.to(tl.float32) * cos + k_half.to(tl.float32) * sin).to(kn_ptr.dtype.element_ty)
        k_row = cache_ptr + b.to(tl.int64) * s_cb + h * s_ch  # cache_ptr points at this layer's K; a
        # 7B layer's K over hundreds of slots passes 2**31 elements, so the slot offset is int64
        v_row = k_row + s_cv
        tl.store(k_row + pos * s_ct + d, k_new)
        tl.store(v_row + pos * s_ct + d, v_new)

        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for start in range(0, pos, BLOCK_N):  # the cached positions [0, pos)
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < pos
            k = tl.load(k_row + n[:, None] * s_ct + d[None, :], mask=n_ok[:, None], other=0.0)
            if IEEE:  # fp32 caches, and every dtype under the CPU interpreter (no bf16 dot there)
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            v = tl.load(v_row + n[:, None] * s_ct + d[None, :], mask=n_ok[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        # the new token itself, from registers
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale
        m_new = tl.maximum(m, s_new)
        alpha = tl.exp2(m - m_new)
        p_new = tl.exp2(s_new - m_new)
        l_sum = l_sum * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
        out = acc / l_sum[:, None]
        tl.store(out_ptr + b * s_ob + (h * G + g)[:, None] * s_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None])


    # tile length and warps/stages tuned per (rows bucket, KV-length bucket, group, head dim) on first use
    # (a 2-tile row wants other tiles than a 6-tile one), outside any CUDA
    # graph capture (the engine warms every graph up eagerly first). Benchmark launches only rewrite the
    # new token's K/V with the same values, so they leave the cache as one launch would.
    _TUNED = triton.autotune(
        configs=[triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st)
                 for n in (32, 64, 128) for w, st in ((4, 2), (4, 3), (8, 2))],
        key=["rows_p2", "kv_p2", "G", "D"], warmup=5, rep=20)(_decode_kernel)


    @triton.jit
    def _prefill_write_kernel(k_ptr, v_ptr, cache_ptr, rows_ptr, slots_ptr, t,
                              s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_cv, s_cb, s_ch, s_ct,
                              D: tl.constexpr, BLOCK_T: tl.constexpr):
        i = tl.program_id(0)
        h = tl.program_id(1)
        tt = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
        d = tl.arange(0, D)
        ok = (tt < t)[:, None]
        r = tl.load(rows_ptr + i)
        dst = cache_ptr + tl.load(slots_ptr + i) * s_cb + h * s_ch + tt[:, None] * s_ct + d[None, :]
        k = tl.load(k_ptr + r * s_kb + h * s_kh + tt[:, None] * s_kt + d[None, :], mask=ok)
        v = tl.load(v_ptr + r * s_vb + h * s_vh + tt[:, None] * s_vt + d[None, :], mask=ok)
        tl.store(dst, k, mask=ok)
        tl.store(dst + s_cv, v, mask=ok)


def write_prefill(cache: torch.Tensor, layer: int, slots: torch.Tensor, rows: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> None:
    """cache[layer, 0/1, slots[i], :, :T] = k/v[rows[i]] for k/v [Np, Hkv, T, D] (any strides, last dim
    contiguous) in one kernel: PyTorch's gather + index_put runs at ~10% of HBM bandwidth here (11 ms of
    a 130 ms llama-1b prefill of 256 x 128 tokens)."""
    n, (_, hkv, t, d) = slots.shape[0], k.shape
    if n == 0 or t == 0:
        return
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    block_t = 32
    layer_k = cache[layer, 0]
    _prefill_write_kernel[(n, hkv, triton.cdiv(t, block_t))](
        k, v, layer_k, rows, slots, t, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        cache.stride(1), cache.stride(2), cache.stride(3), cache.stride(4), D=d, BLOCK_T=block_t, num_warps=4)


def _launch(args: tuple, *, rows: int, kv_len: int, g: int, d: int, ieee: bool, rope: bool, interpret: bool,
            config: dict | None) -> None:
    """Autotuned launch on a GPU, or one fixed `config` (BLOCK_N, num_warps, num_stages): the CPU
    interpreter has nothing to time, and bench/decode_attention.py sweeps configs itself."""
    consts = dict(G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, IEEE=ieee, ROPE=rope)
    grid, buckets = args[0], (triton.next_power_of_2(rows), triton.next_power_of_2(kv_len))
    if interpret or config is not None:
        config = config or dict(BLOCK_N=64, num_warps=4, num_stages=2)
        _decode_kernel[grid](*args[1:], *buckets, **consts, **config)
    else:
        _TUNED[grid](*args[1:], *buckets, **consts)


def attend(cache: torch.Tensor, layer: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, kv_len: int = 0, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
           *, config: dict | None = None) -> torch.Tensor:
    """decode_attention's body; `config` fixes the kernel's tile (default: autotuned on CUDA)."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    g = hq // hkv
    out = torch.empty(b, hq, 1, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    rope = cos is not None
    if rope and (cos.shape != (b, d) or sin.shape != (b, d) or cos.stride(-1) != 1 or sin.stride() != cos.stride()):
        raise ValueError(f"cos/sin must be [B, D] = [{b}, {d}] rows of one layout, got {tuple(cos.shape)}")
    qs, ks, vs = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    layer_k = cache[layer, 0]
    cos_, sin_ = (cos, sin) if rope else (qs, qs)  # unread without RoPE
    _launch(((b, hkv), qs, ks, vs, layer_k, positions, out, cos_, sin_, (d ** -0.5) * 1.4426950408889634,
             qs.stride(0), qs.stride(1), ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
             out.stride(0), out.stride(1), cos_.stride(0) if rope else 0,
             cache.stride(1), cache.stride(2), cache.stride(3), cache.stride(4)), rope=rope,
            rows=b, kv_len=max(1, kv_len), g=g, d=d, ieee=q.dtype == torch.float32 or not q.is_cuda,
            interpret=not q.is_cuda, config=config)
    return out


@torch.library.custom_op("hybridrl_rollout::decode_attention", mutates_args=("cache",))
def decode_attention(cache: torch.Tensor, layer: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, kv_len: int, cos: torch.Tensor | None = None,
                     sin: torch.Tensor | None = None) -> torch.Tensor:
    """cache[layer, 0/1, b, :, positions[b]] = k/v[b, :, 0]; returns attention of q [B, Hq, 1, D] over
    cache positions [0, positions[b]] of row b (slot b), shape [B, Hq, 1, D]. `kv_len` (> every
    position) only picks the tuned tile. With cos/sin ([B, D], the model's RoPE tables at each row's
    position) q and k arrive un-rotated and are rotated in the kernel (one small kernel less per layer)."""
    return attend(cache, layer, positions, q, k, v, kv_len, cos, sin)


@decode_attention.register_fake
def _decode_attention_fake(cache, layer, positions, q, k, v, kv_len, cos=None, sin=None) -> torch.Tensor:
    return q.new_empty(q.shape)
