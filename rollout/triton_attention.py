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

Shared prompts (GRPO's n samples of one prompt hold identical prompt K/V) stay one launch: beside the rows'
programs, one program per (table entry, KV head) reads the entry's prompt once for all its rows' queries.
Each leaves its online-softmax state in a workspace and takes a ticket from the entry's counter; the last
to arrive merges every member's prompt and own-position states and writes their outputs. A separate
prompt kernel before the rows' kernel cost a launch gap and a second, mostly idle wave per layer.

    out = decode_attention(cache, layer, positions, q, k, v, kv_len)   # q [B, Hq, 1, D], k/v [B, Hkv, 1, D]
    out = decode_attention(cache, layer, positions, q, k, v, kv_len, cos, sin)  # q/k before RoPE

`cache` is the engine's [layers, 2, slots, Hkv, slot_len, D] tensor; row b uses slot b. A torch custom
op, so torch.compile treats it as opaque and CUDA graphs capture it. Under TRITON_INTERPRET=1 it runs
on CPU tensors (tests/rollout/test_triton_attention.py checks it against SDPA there).
"""

from __future__ import annotations

import os

import torch

from models.triton_support import triton_runs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine then never offers the "triton" kernel
    triton = None

SHORT_KV = 32  # tile_config's shortest tile: KV lengths up to this take it, every longer one the same tile


def available(device: torch.device, head_dim: int) -> bool:
    """Whether the kernel can run here: CUDA with triton (or its CPU interpreter) and a power-of-two
    head dim >= 16 (one [BLOCK, D] tile per load)."""
    return head_dim >= 16 and not head_dim & (head_dim - 1) and triton_runs(device)


if triton is not None:
    _CVT_ASM = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")  # _e4m3_tile converts by PTX's cvt

    @triton.jit
    def _e4m3_tile(row_ptr, n, n_ok, s_ct, D: tl.constexpr):
        """[N, D] fp16 of the e4m3 cache rows n (masked by n_ok), converted in registers. Loaded as [N, D / 4]
        32-bit words; each word's four values become four fp16 by two hardware conversions (e4m3x2 -> f16x2, the
        low byte to the low half), joined back in the row's order. One word per conversion: with two (a pack),
        which words meet follows Triton's register layout, and that pairs K's neighbouring columns but V's rows."""
        c = tl.arange(0, D // 4)
        ptr = (row_ptr + n[:, None] * s_ct).to(tl.pointer_type(tl.int32)) + c[None, :]
        w = tl.load(ptr, mask=n_ok[:, None], other=0)
        if _CVT_ASM:
            v0, v1, v2, v3 = tl.inline_asm_elementwise(
                asm="""{ .reg .b16 lo, hi; .reg .b32 a, b;
                mov.b32 {lo, hi}, $4;
                cvt.rn.f16x2.e4m3x2 a, lo;
                cvt.rn.f16x2.e4m3x2 b, hi;
                mov.b32 {$0, $1}, a;
                mov.b32 {$2, $3}, b; }""",
                constraints="=h,=h,=h,=h,r", args=[w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                is_pure=True, pack=1)
        else:  # Triton's CPU interpreter runs no assembly: each byte through Triton's cast
            v0, v1, v2, v3 = _e4m3_byte(w, 0), _e4m3_byte(w, 8), _e4m3_byte(w, 16), _e4m3_byte(w, 24)
        x = tl.join(tl.join(v0, v2), tl.join(v1, v3))  # [N, D / 4, 2, 2]: value 4c + 2i + j at [n, c, i, j]
        return tl.reshape(x, (n.shape[0], D))

    @triton.jit
    def _e4m3_byte(w, shift: tl.constexpr):
        """The e4m3 value in bits [shift, shift + 8) of the words w, as fp16."""
        return ((w >> shift) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)

    @triton.jit
    def _cache_tile(row_ptr, n, n_ok, s_ct, D: tl.constexpr, TILE: tl.constexpr):
        """The cache rows n [N, D] as stored, or (TILE) an fp8 tile converted in registers (_e4m3_tile)."""
        if TILE:  # (one return: Triton checks every return's type, and the two differ)
            x = _e4m3_tile(row_ptr, n, n_ok, s_ct, D)
        else:
            x = tl.load(row_ptr + n[:, None] * s_ct + tl.arange(0, D)[None, :], mask=n_ok[:, None], other=0.0)
        return x

    @triton.jit
    def _attend_range(q, k_row, v_row, ks_row, vs_row, lo, hi, s_ct, s_st, qk_scale, m, l_sum, acc,
                      D: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr):
        """Online-softmax state (m, l_sum, acc) of the query rows q [M, D] advanced over cache positions
        [lo, hi) of one (slot, KV head), streamed in BLOCK_N-position tiles (scores in the exp2 domain). FP8:
        the cache holds float8 rows with fp32 scales at ks_row/vs_row (stride s_st): K's scale multiplies the
        scores, V's the probabilities, and the dots run on the rows converted to fp16 (q's dtype otherwise)."""
        TILE: tl.constexpr = FP8 and not IEEE  # fp8 tiles converted in registers (_e4m3_tile)
        if TILE:  # e4m3 -> fp16 is one instruction per two values on sm_89+ (-> bf16 goes through fp16 first), so
            q = q.to(tl.float16)  # fp8 tiles meet q in fp16
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            k = _cache_tile(k_row, n, n_ok, s_ct, D, TILE)
            if IEEE:  # fp32 caches, and every dtype under the CPU interpreter (no bf16 dot there)
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k.to(q.dtype)))
            if FP8:
                s = s * tl.load(ks_row + n * s_st, mask=n_ok, other=0.0)[None, :]
            s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            v = _cache_tile(v_row, n, n_ok, s_ct, D, TILE)
            p_v = p * tl.load(vs_row + n * s_st, mask=n_ok, other=0.0)[None, :] if FP8 else p
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p_v, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p_v.to(q.dtype), v.to(q.dtype))
            m = m_new
        return m, l_sum, acc

    @triton.jit
    def _round_e4m3(x):
        """fp32 x (|x| <= 448) rounded to the nearest float8 e4m3 value, ties to even, still in fp32: the cast
        after it is exact. (The hardware cast rounds the same; Triton's CPU interpreter does not carry a
        rounded-up mantissa into the exponent, so the kernels never leave the rounding to the cast.)"""
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # 3 of fp32's 23 mantissa bits, RTNE
        small = (x + 16384.0) - 16384.0  # below e4m3's smallest normal (2^-6): multiples of 2^-9, RTNE
        return tl.where(tl.abs(x) < 0.015625, small, bits.to(tl.float32, bitcast=True))

    @triton.jit
    def _quantize_rows(x):
        """Rows x [R, D] over their absolute maximum / 448, rounded to e4m3 (still fp32), and the scales [R]."""
        xf = x.to(tl.float32)
        sc = tl.maximum(tl.max(tl.abs(xf), 1) / 448.0, 1e-30)
        return _round_e4m3(xf / sc[:, None]), sc

    @triton.jit
    def _store_row(row_ptr, scale_ptr, x, D: tl.constexpr, FP8: tl.constexpr):
        """Store one cache row x [D]: as is, or (FP8) over its absolute maximum / 448 with the scale beside it.
        Returns the row as stored (FP8: dequantized), which the token then attends as every later step will."""
        d = tl.arange(0, D)
        if FP8:
            xf = x.to(tl.float32)
            sc = tl.maximum(tl.max(tl.abs(xf), 0) / 448.0, 1e-30)
            xq = _round_e4m3(xf / sc)
            tl.store(row_ptr + d, xq.to(row_ptr.dtype.element_ty))
            tl.store(scale_ptr, sc)
            return xq * sc
        else:
            tl.store(row_ptr + d, x)
            return x

    @triton.jit
    def _row_state(q, k_new, v_new, k_row, v_row, ks_row, vs_row, lo, pos, s_ct, s_st, qk_scale, m, l_sum, acc,
                   D: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr):
        """(m, l_sum, acc) advanced over cache positions [lo, pos) and then the new token itself (from
        registers: the cache store of its K/V has no read-after-write hazard)."""
        m, l_sum, acc = _attend_range(q, k_row, v_row, ks_row, vs_row, lo, pos, s_ct, s_st, qk_scale, m, l_sum, acc,
                                      D, IEEE, FP8, BLOCK_N)
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale
        m_new = tl.maximum(m, s_new)
        alpha = tl.exp2(m - m_new)
        p_new = tl.exp2(s_new - m_new)
        l_sum = l_sum * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
        return m_new, l_sum, acc

    @triton.jit
    def row_rms_scale(x_rows, eps, HID: tl.constexpr, CHUNK: tl.constexpr):
        """rsqrt(mean(x^2) + eps) in fp32 of the HID values at each pointer of x_rows ([R] or scalar): the rows'
        input-norm scale, which q, the new k and the new v of a layer with its norm weight folded in still need
        (folded_norms). The chunk loop is unrolled: every load is in flight at once."""
        for start in tl.static_range(0, HID, CHUNK):
            c = start + tl.arange(0, CHUNK)
            if len(x_rows.shape) == 0:
                x = tl.load(x_rows + c, mask=c < HID, other=0.0).to(tl.float32)
                part = tl.sum(x * x, 0)
            else:
                x = tl.load(x_rows[:, None] + c[None, :], mask=c[None, :] < HID, other=0.0).to(tl.float32)
                part = tl.sum(x * x, 1)
            if start == 0:
                sq = part
            else:
                sq += part
        return tl.rsqrt(sq / HID + eps)

    @triton.jit
    def _store_state(ws_acc_ptr, ws_ml_ptr, at, ok, m, l_sum, acc, D: tl.constexpr):
        d = tl.arange(0, D)
        tl.store(ws_ml_ptr + 2 * at, m, mask=ok)
        tl.store(ws_ml_ptr + 2 * at + 1, l_sum, mask=ok)
        tl.store(ws_acc_ptr + at[:, None] * D + d[None, :], acc, mask=ok[:, None])

    @triton.jit
    def _arrive(count_ptr, members_ptr, e, s_mg, ws_acc_ptr, ws_ml_ptr, s_half, out_ptr, s_ob, s_oh, s_wb, h,
                G: tl.constexpr, MEMBERS: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr):
        """One of the (members + 1) programs of table entry e (its prompt program and each member's row
        program) has left its softmax state in the workspace (half 0: the prompt's, half 1: a row's own
        positions). The last to arrive merges both halves of every member row and writes their outputs,
        then re-arms the counter for the next launch (so no launch needs a zero-fill)."""
        i = tl.arange(0, BLOCK_M)
        j, g = i // G, i % G
        row = tl.load(members_ptr + e * s_mg + j, mask=j < MEMBERS, other=-1)
        ok = row >= 0
        n_members = tl.sum((ok & (g == 0)).to(tl.int32))
        tl.debug_barrier()  # every thread's workspace stores precede the release below
        count_ptr += e * tl.num_programs(1) + h  # counts [N, Hkv]
        ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == n_members:
            row = tl.where(ok, row, 0)
            at = row * s_wb + h * G + g
            d = tl.arange(0, D)
            # .cg: other SMs wrote these; read them from L2, never from a stale L1 line
            m_p = tl.load(ws_ml_ptr + 2 * at, mask=ok, other=0.0, cache_modifier=".cg")
            l_p = tl.load(ws_ml_ptr + 2 * at + 1, mask=ok, other=1.0, cache_modifier=".cg")
            a_p = tl.load(ws_acc_ptr + at[:, None] * D + d[None, :], mask=ok[:, None], other=0.0,
                          cache_modifier=".cg")
            m_s = tl.load(ws_ml_ptr + s_half * 2 + 2 * at, mask=ok, other=0.0, cache_modifier=".cg")
            l_s = tl.load(ws_ml_ptr + s_half * 2 + 2 * at + 1, mask=ok, other=1.0, cache_modifier=".cg")
            a_s = tl.load(ws_acc_ptr + s_half * D + at[:, None] * D + d[None, :], mask=ok[:, None], other=0.0,
                          cache_modifier=".cg")
            m = tl.maximum(m_p, m_s)
            w_p, w_s = tl.exp2(m_p - m), tl.exp2(m_s - m)
            out = (a_p * w_p[:, None] + a_s * w_s[:, None]) / (l_p * w_p + l_s * w_s)[:, None]
            tl.store(out_ptr + row[:, None] * s_ob + (h * G + g)[:, None] * s_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=ok[:, None])
            tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _prompt_program(q_ptr, cache_ptr, members_ptr, group_len_ptr, count_ptr, ws_acc_ptr, ws_ml_ptr, out_ptr,
                        cos_ptr, sin_ptr, x_ptr, qk_scale, eps, s_qb, s_qh, s_rb, s_xb, s_cv, s_cb, s_ch, s_ct,
                        scale_ptr, s_sv, s_sb, s_sh, s_st,
                        s_mg, s_wb, s_half, s_ob, s_oh, e, h, G: tl.constexpr, MEMBERS: tl.constexpr,
                        BLOCK_M: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr, ROPE: tl.constexpr,
                        NORM: tl.constexpr, HID: tl.constexpr, CHUNK_M: tl.constexpr, FP8: tl.constexpr,
                        BLOCK_N: tl.constexpr):
        # table entry e, KV head h. The entry's rows (up to MEMBERS, the samples of one prompt admitted in one
        # prefill row) hold identical K/V at positions [0, plen) in their slots; read them once, from the
        # first member's slot, for the MEMBERS x G query rows together (tensor-core tiles of BLOCK_M rows), and
        # leave each row's online-softmax state (m, l, unnormalised acc) in half 0 of the workspace
        plen = tl.load(group_len_ptr + e)  # 0: an unused table entry
        if plen > 0:
            i = tl.arange(0, BLOCK_M)
            j, g = i // G, i % G
            row = tl.load(members_ptr + e * s_mg + j, mask=j < MEMBERS, other=-1)
            ok = row >= 0
            row = tl.where(ok, row, 0)
            d = tl.arange(0, D)
            q_at = q_ptr + row[:, None] * s_qb + (h * G + g)[:, None] * s_qh
            q = tl.load(q_at + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            if ROPE:  # as for a row, each member at its own position
                half = (d + D // 2) % D
                sign = tl.where(d < D // 2, -1.0, 1.0)
                cos = tl.load(cos_ptr + row[:, None] * s_rb + d[None, :]).to(tl.float32)
                sin = tl.load(sin_ptr + row[:, None] * s_rb + d[None, :]).to(tl.float32) * sign[None, :]
                q_half = tl.load(q_at + half[None, :], mask=ok[:, None], other=0.0)
                q = q * cos + q_half.to(tl.float32) * sin
            if NORM:  # each query row's own member's scale (an unused member reads row 0, masked)
                q = q * row_rms_scale(x_ptr + row.to(tl.int64) * s_xb, eps, HID, CHUNK_M)[:, None]
            q = q.to(q_ptr.dtype.element_ty)  # rounded once, as the compiled model's RoPE does
            src = tl.load(members_ptr + e * s_mg)
            k_row = cache_ptr + src.to(tl.int64) * s_cb + h * s_ch
            ks_row = scale_ptr + src.to(tl.int64) * s_sb + h * s_sh
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_sum = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D], tl.float32)
            m, l_sum, acc = _attend_range(q, k_row, k_row + s_cv, ks_row, ks_row + s_sv, 0, plen, s_ct, s_st, qk_scale,
                                          m, l_sum, acc, D, IEEE, FP8, BLOCK_N)
            _store_state(ws_acc_ptr, ws_ml_ptr, row * s_wb + h * G + g, ok, m, l_sum, acc, D)
            _arrive(count_ptr, members_ptr, e, s_mg, ws_acc_ptr, ws_ml_ptr, s_half, out_ptr, s_ob, s_oh, s_wb, h,
                    G, MEMBERS, BLOCK_M, D)

    @triton.jit
    def _decode_kernel(q_ptr, kn_ptr, vn_ptr, cache_ptr, pos_ptr, out_ptr, cos_ptr, sin_ptr, x_ptr, qk_scale, eps,
                       s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_ob, s_oh, s_rb, s_xb,
                       s_cv, s_cb, s_ch, s_ct, scale_ptr, s_sv, s_sb, s_sh, s_st,
                       row_prefix_ptr, row_entry_ptr, members_ptr, group_len_ptr, count_ptr,
                       ws_acc_ptr, ws_ml_ptr, s_wb, s_half, s_mg, n_entries,
                       G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr,
                       ROPE: tl.constexpr, NORM: tl.constexpr, HID: tl.constexpr, CHUNK: tl.constexpr,
                       CHUNK_M: tl.constexpr, PREFIX: tl.constexpr, MEMBERS: tl.constexpr, BLOCK_M: tl.constexpr,
                       FP8: tl.constexpr, BLOCK_N: tl.constexpr):
        # scores and P @ V on tensor cores, the G query heads padded to BLOCK_G >= 16 rows (a CUDA-core
        # broadcast-multiply-reduce over the G real rows measured 0.6-0.8x as fast on an H200).
        # Programs (i, h), h a KV head: with shared prompts (PREFIX) i < n_entries is table entry i's prompt
        # program, else row b = i - n_entries's; without, row b = i.
        i = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, D)
        if PREFIX and i < n_entries:
            _prompt_program(q_ptr, cache_ptr, members_ptr, group_len_ptr, count_ptr, ws_acc_ptr, ws_ml_ptr,
                            out_ptr, cos_ptr, sin_ptr, x_ptr, qk_scale, eps, s_qb, s_qh, s_rb, s_xb, s_cv, s_cb,
                            s_ch, s_ct, scale_ptr, s_sv, s_sb, s_sh, s_st, s_mg, s_wb, s_half, s_ob, s_oh, i, h, G,
                            MEMBERS, BLOCK_M, D, IEEE, ROPE, NORM, HID, CHUNK_M, FP8, BLOCK_N)
        else:
            b = i - n_entries if PREFIX else i
            pos = tl.load(pos_ptr + b)  # this row attends [0, pos]; pos is where the new token goes
            g = tl.arange(0, BLOCK_G)
            g_ok = g < G
            if NORM:  # unnormalised q/k/v of a layer with its input norm's weight folded in: the row's scale
                r = row_rms_scale(x_ptr + b.to(tl.int64) * s_xb, eps, HID, CHUNK)
            q_at = q_ptr + b * s_qb + (h * G + g)[:, None] * s_qh
            q = tl.load(q_at + d[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
            k_new = tl.load(kn_ptr + b * s_kb + h * s_kh + d).to(tl.float32)
            v_new = tl.load(vn_ptr + b * s_vb + h * s_vh + d).to(tl.float32)
            if ROPE:  # q and the new k arrive un-rotated: x * cos + rotate_half(x) * sin with the row's cos/sin
                # [D] (the model's own values), in fp32 and rounded once, as the compiled model's RoPE does
                half = (d + D // 2) % D
                sign = tl.where(d < D // 2, -1.0, 1.0)
                cos = tl.load(cos_ptr + b * s_rb + d).to(tl.float32)
                sin = tl.load(sin_ptr + b * s_rb + d).to(tl.float32) * sign
                q_half = tl.load(q_at + half[None, :], mask=g_ok[:, None], other=0.0)
                q = q * cos[None, :] + q_half.to(tl.float32) * sin[None, :]
                k_half = tl.load(kn_ptr + b * s_kb + h * s_kh + half)
                k_new = k_new * cos + k_half.to(tl.float32) * sin
            if NORM:
                q, k_new, v_new = q * r, k_new * r, v_new * r
            q = q.to(q_ptr.dtype.element_ty)
            k_new = k_new.to(kn_ptr.dtype.element_ty)
            v_new = v_new.to(vn_ptr.dtype.element_ty)
            k_row = cache_ptr + b.to(tl.int64) * s_cb + h * s_ch  # cache_ptr points at this layer's K; a
            # 7B layer's K over hundreds of slots passes 2**31 elements, so the slot offset is int64
            v_row = k_row + s_cv
            ks_row = scale_ptr + b.to(tl.int64) * s_sb + h * s_sh  # fp8: the rows' scales (unread otherwise)
            vs_row = ks_row + s_sv
            k_new = _store_row(k_row + pos * s_ct, ks_row + pos * s_st, k_new, D, FP8)
            v_new = _store_row(v_row + pos * s_ct, vs_row + pos * s_st, v_new, D, FP8)
            m = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_sum = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, D], tl.float32)
            out_at = out_ptr + b * s_ob + (h * G + g)[:, None] * s_oh + d[None, :]
            if PREFIX:  # positions [0, lo) are a prompt its table entry's prompt program attends
                lo = tl.load(row_prefix_ptr + b)
                m, l_sum, acc = _row_state(q, k_new, v_new, k_row, v_row, ks_row, vs_row, lo, pos, s_ct, s_st,
                                           qk_scale, m, l_sum, acc, D, IEEE, FP8, BLOCK_N)
                if lo > 0:  # its own positions' state, half 1 of the workspace; the entry's last arrival merges
                    e = tl.load(row_entry_ptr + b)
                    _store_state(ws_acc_ptr + s_half * D, ws_ml_ptr + s_half * 2, b * s_wb + h * G + g, g_ok, m,
                                 l_sum, acc, D)
                    _arrive(count_ptr, members_ptr, e, s_mg, ws_acc_ptr, ws_ml_ptr, s_half, out_ptr, s_ob, s_oh,
                            s_wb, h, G, MEMBERS, BLOCK_M, D)
                else:
                    tl.store(out_at, (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
            else:
                m, l_sum, acc = _row_state(q, k_new, v_new, k_row, v_row, ks_row, vs_row, 0, pos, s_ct, s_st,
                                           qk_scale, m, l_sum, acc, D, IEEE, FP8, BLOCK_N)
                tl.store(out_at, (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty), mask=g_ok[:, None])

    @triton.jit
    def _prefill_write_kernel(k_ptr, v_ptr, cache_ptr, rows_ptr, slots_ptr, t,
                              s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_cv, s_cb, s_ch, s_ct,
                              scale_ptr, s_sv, s_sb, s_sh, s_st,
                              D: tl.constexpr, FP8: tl.constexpr, BLOCK_T: tl.constexpr):
        i = tl.program_id(0)
        h = tl.program_id(1)
        tt = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
        d = tl.arange(0, D)
        ok = (tt < t)[:, None]
        r = tl.load(rows_ptr + i)
        slot = tl.load(slots_ptr + i)
        dst = cache_ptr + slot * s_cb + h * s_ch + tt[:, None] * s_ct + d[None, :]
        k = tl.load(k_ptr + r * s_kb + h * s_kh + tt[:, None] * s_kt + d[None, :], mask=ok, other=0.0)
        v = tl.load(v_ptr + r * s_vb + h * s_vh + tt[:, None] * s_vt + d[None, :], mask=ok, other=0.0)
        if FP8:  # each (token, head) row over its own absolute maximum / 448, the scale beside it
            s_dst = scale_ptr + slot * s_sb + h * s_sh + tt * s_st
            kq, k_sc = _quantize_rows(k)
            vq, v_sc = _quantize_rows(v)
            tl.store(dst, kq.to(cache_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + s_cv, vq.to(cache_ptr.dtype.element_ty), mask=ok)
            tl.store(s_dst, k_sc, mask=tt < t)
            tl.store(s_dst + s_sv, v_sc, mask=tt < t)
        else:
            tl.store(dst, k, mask=ok)
            tl.store(dst + s_cv, v, mask=ok)


def _scale_args(cache: torch.Tensor, scales: torch.Tensor, layer: int) -> tuple:
    """(pointer, v offset, slot, head, position strides) of an fp8 cache's scales at `layer`; for a cache without
    scales the cache's own layer and zero strides (never read: the kernels' FP8 is off)."""
    if not scales.numel():
        return cache[layer, 0], 0, 0, 0, 0
    return (scales[layer, 0], *scales.stride()[1:5])


def write_prefill(cache: torch.Tensor, layer: int, slots: torch.Tensor, rows: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, scales: torch.Tensor | None = None) -> None:
    """cache[layer, 0/1, slots[i], :, :T] = k/v[rows[i]] for k/v [Np, Hkv, T, D] (any strides, last dim
    contiguous) in one kernel: PyTorch's gather + index_put runs at ~10% of HBM bandwidth here (11 ms of
    a 130 ms llama-1b prefill of 256 x 128 tokens)."""
    scales = cache.new_zeros(0, dtype=torch.float32) if scales is None else scales
    n, (_, hkv, t, d) = slots.shape[0], k.shape
    if n == 0 or t == 0:
        return
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    block_t = 32
    layer_k = cache[layer, 0]
    _prefill_write_kernel[(n, hkv, triton.cdiv(t, block_t))](
        k, v, layer_k, rows, slots, t, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        cache.stride(1), cache.stride(2), cache.stride(3), cache.stride(4), *_scale_args(cache, scales, layer), D=d,
        FP8=bool(scales.numel()), BLOCK_T=block_t, num_warps=4)


def tile_config(rows: int, kv_len: int, *, shared: bool = False, fp8: bool = False) -> dict:
    """The kernel's tile (BLOCK_N, warps, stages) for a decode of `rows` rows over at most `kv_len` positions
    (`fp8`: the cache is fp8 with scales).

    A fixed rule from H200 sweeps of every config (llama-1b heads, contexts 160-1280, with and without
    shared prompts), not Triton's run-time autotuner: that timed configs on the first decode step of each
    KV-length bucket (one response token where the bucket later holds hundreds), ran 5-15% slower than these
    picks and picked differently between runs.

    - Shared prompts (`shared`), and every launch from 256 rows on: 64-position tiles, 4 warps, 2 stages at
      >= 128 rows (32/4/3 at 64 rows, 64/4/3 below). The shared launch also holds the prompt programs, which
      ptxas would give 255 registers with spills (two programs per SM): the launch is capped at 96 registers
      (`maxnreg`). At 256 rows unshared rows take the same capped tile: in the engine's kernel profile it ran
      50.8 us per layer where 128-position tiles ran 57.9.
    - Unshared rows below 256: 32-position tiles over 3 stages, the best when timed over 16 layers of KV (no
      L2 reuse between calls, as in the engine), e.g. 9.28 us per layer call at 32 rows x 160 positions
      (bench/results/decode_attention_splits_h200.json, which also holds the split-KV runs that were dropped).
    - An fp8 cache (`fp8`): the same tiles and stages, capped at 128 registers wherever a cap applies. Its tiles are
      loaded as 32-bit words and converted in registers (_e4m3_tile); a pipeline stages the words. On an H100 at
      the recipe's shape (640 rows in groups of 5 sharing an 80-token prompt, 600 positions), the shared launch ran
      369 us per layer at 64/4/2 capped at 128, 383 at 96, 415 over one stage, 393 with 32-position tiles (bf16:
      484); unshared 376 at 64/4/2 against 394 over one stage (bench/results/decode_attention_fp8_h100.json).

    The sweeps and A/B runs behind the rule: docs/history/measurements.md."""
    if shared or rows >= 256:
        block, warps, stages = (64, 4, 2) if rows >= 128 else (32, 4, 3) if rows >= 64 else (64, 4, 3)
    else:
        block, warps, stages = 32, 4, 3
    tile = dict(BLOCK_N=min(block, max(SHORT_KV, triton.next_power_of_2(kv_len))), num_warps=warps,
                num_stages=stages)
    if shared or rows >= 256:
        return tile | {"maxnreg": 128 if fp8 else 96}
    return tile


def attend(cache: torch.Tensor, layer: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, kv_len: int = 0, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
           prefix: tuple[torch.Tensor, ...] | None = None, counts: torch.Tensor | None = None,
           norm_x: torch.Tensor | None = None, eps: float = 0.0, *, config: dict | None = None,
           scales: torch.Tensor | None = None) -> torch.Tensor:
    """decode_attention's body; `config` (BLOCK_N, num_warps, num_stages) overrides tile_config's tile.
    prefix: shared_prefix_tables' (row_prefix, row_entry, members, group_len) on q's device; counts: their
    arrival counters, int32 [N, Hkv] zeros (left zero by every launch; None: a fresh zeroed tensor).
    norm_x [B, H]: q/k/v are row b's unnormalised projections and are scaled by rsqrt(mean(norm_x[b]^2) + eps)
    (rollout/folded_norms.py). scales: an fp8 cache's row scales (rollout/kv_cache.py; None or empty: none)."""
    scales = cache.new_zeros(0, dtype=torch.float32) if scales is None else scales
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
    if norm_x is not None and (norm_x.dim() != 2 or norm_x.shape[0] != b or norm_x.stride(-1) != 1):
        raise ValueError(f"norm_x must be [B={b}, H] with unit-stride rows, got {tuple(norm_x.shape)}")
    qs, ks, vs = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    x_ = qs if norm_x is None else norm_x  # unread without norm_x
    hid = x_.shape[-1] if norm_x is not None else 16
    layer_k = cache[layer, 0]
    cos_, sin_ = (cos, sin) if rope else (qs, qs)  # unread without RoPE
    scale = (d ** -0.5) * 1.4426950408889634  # log2(e): the kernels use exp2
    cache_strides = tuple(cache.stride()[1:5])
    # fp32 dots for fp32 queries, and under the CPU interpreter (it has no bf16 dot) unless the cache is fp8: those
    # tiles meet q in fp16, which it has
    ieee = q.dtype == torch.float32 or (not q.is_cuda and not scales.numel())
    tile = config or tile_config(b, kv_len, shared=prefix is not None, fp8=bool(scales.numel()))
    # unread without shared prefixes
    row_prefix = row_entry = members = group_len = counts_ = ws_acc = ws_ml = positions
    n, m = 0, 1
    if prefix is not None:
        row_prefix, row_entry, members, group_len = prefix
        n, m = members.shape
        if row_prefix.shape != (b,) or row_entry.shape != (b,) or group_len.shape != (n,) or members.stride(1) != 1:
            raise ValueError(f"prefix tables must be row_prefix [{b}], row_entry [{b}], members [N, M] and "
                             f"group_len [N], got {[tuple(t.shape) for t in prefix]}")
        counts_ = torch.zeros(n, hkv, dtype=torch.int32, device=q.device) if counts is None else counts
        if counts_.shape != (n, hkv) or counts_.dtype != torch.int32 or not counts_.is_contiguous():
            raise ValueError(f"counts must be contiguous int32 [{n}, {hkv}], got {tuple(counts_.shape)}")
        # per-(row, query head) softmax states: half 0 the prompt's, half 1 the row's own positions
        ws_acc = torch.empty(2, b, hq, d, dtype=torch.float32, device=q.device)
        ws_ml = torch.empty(2, b, hq, 2, dtype=torch.float32, device=q.device)
    block_m = max(16, triton.next_power_of_2(m * g))
    _decode_kernel[(n + b, hkv)](
        qs, ks, vs, layer_k, positions, out, cos_, sin_, x_, scale, eps, qs.stride(0), qs.stride(1),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1), out.stride(0), out.stride(1),
        cos_.stride(0) if rope else 0, x_.stride(0), *cache_strides, *_scale_args(cache, scales, layer), row_prefix,
        row_entry, members, group_len,
        counts_, ws_acc, ws_ml, hq, b * hq, members.stride(0) if prefix is not None else 0, n,
        G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, IEEE=ieee, ROPE=rope, NORM=norm_x is not None,
        # the x loads of the row's scale: [2048] per row program, [BLOCK_M, 4096 / BLOCK_M] per prompt program
        HID=hid, CHUNK=min(2048, triton.next_power_of_2(hid)),
        CHUNK_M=min(4096 // block_m, triton.next_power_of_2(hid)),
        PREFIX=prefix is not None, MEMBERS=m, BLOCK_M=block_m, FP8=bool(scales.numel()), **tile)
    return out


@torch.library.custom_op("hybridrl_rollout::decode_attention", mutates_args=("cache", "scales"))
def decode_attention(cache: torch.Tensor, scales: torch.Tensor, layer: int, positions: torch.Tensor, q: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, kv_len: int, cos: torch.Tensor | None = None,
                     sin: torch.Tensor | None = None, norm_x: torch.Tensor | None = None,
                     eps: float = 0.0) -> torch.Tensor:
    """cache[layer, 0/1, b, :, positions[b]] = k/v[b, :, 0]; returns attention of q [B, Hq, 1, D] over
    cache positions [0, positions[b]] of row b (slot b), shape [B, Hq, 1, D]. `kv_len` (> every
    position) caps the tile length (tile_config). With cos/sin ([B, D], the model's RoPE tables at each row's
    position) q and k arrive un-rotated and are rotated in the kernel (one small kernel less per layer); with
    norm_x [B, H] (the layer's input rows) q/k/v arrive unnormalised and are scaled by its RMS (folded_norms).
    `scales`: an fp8 cache's row scales (rollout/kv_cache.py), empty for a bf16/fp32 cache."""
    return attend(cache, layer, positions, q, k, v, kv_len, cos, sin, norm_x=norm_x, eps=eps, scales=scales)


@decode_attention.register_fake
def _decode_attention_fake(cache, scales, layer, positions, q, k, v, kv_len, cos=None, sin=None, norm_x=None,
                           eps=0.0) -> torch.Tensor:
    return q.new_empty(q.shape)


# a second op rather than optional arguments: torch 2.11's compile cannot run an op whose mutated optional
# tensor is None ("IndexError: tuple index out of range" making the fake tensor call)
@torch.library.custom_op("hybridrl_rollout::decode_attention_shared", mutates_args=("cache", "scales", "counts"))
def decode_attention_shared(cache: torch.Tensor, scales: torch.Tensor, layer: int, positions: torch.Tensor,
                            q: torch.Tensor,
                            k: torch.Tensor, v: torch.Tensor, kv_len: int, cos: torch.Tensor | None,
                            sin: torch.Tensor | None, row_prefix: torch.Tensor, row_entry: torch.Tensor,
                            members: torch.Tensor, group_len: torch.Tensor, counts: torch.Tensor,
                            norm_x: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """decode_attention with shared prompts (rollout.share_prompt_kv), given the tables of
    rollout/shared_prefix.py: row_prefix [B] int32 (row b's positions [0, row_prefix[b]) are a prompt its
    group shares; 0: none), row_entry [B] int32 (the table entry of row b's group; -1: none), members [N, M]
    int32 (each entry's rows, -1 padded, all of them rows of this launch; the first member's slot is read) and
    group_len [N] int32 (the entry's prompt length; 0: unused entry), with `counts` int32 [N, Hkv] zeros that
    the kernel uses and leaves zero. One launch: each entry's prompt K/V is read once, by a program of its own,
    beside the rows' programs; the last of an entry's programs to finish merges the prompt's and each row's
    softmax states."""
    return attend(cache, layer, positions, q, k, v, kv_len, cos, sin, (row_prefix, row_entry, members, group_len),
                  counts, norm_x, eps, scales=scales)


@decode_attention_shared.register_fake
def _decode_attention_shared_fake(cache, scales, layer, positions, q, k, v, kv_len, cos, sin, row_prefix, row_entry,
                                  members, group_len, counts, norm_x=None, eps=0.0) -> torch.Tensor:
    return q.new_empty(q.shape)
