"""AdamW's step on CUDA as one Triton kernel for ShardLocalAdamW and MasterWeightAdamW
(parallel/shard_adamw.py, parallel/master_weights.py): each element's gradient is read once in its own
dtype and scaled by the clip coefficient, the weight and both moments are updated in fp32 arithmetic and
stored in their dtypes, and, for fp32 masters, the 16-bit weight the forward reads is written too.

    adamw_(grads, weights, exp_avgs, exp_avg_sqs, copies, lr=1e-6, betas=(0.9, 0.999), eps=1e-8,
           weight_decay=0.0, step=3, grad_scale=0.5)   # copies: the bf16 weights of fp32 masters, or None

Why: torch's fused AdamW takes one dtype for all its tensors ("expected scalar type Float but found
BFloat16" on a bf16 gradient), so the master-weight torch path casts each first gradient into an fp32
buffer, scales the gradients for clipping in another pass, and copies the masters back into the bf16
weights after the update: 48 bytes of traffic per parameter against this kernel's 28 (bf16 gradient read,
master and two moments read and written, bf16 weight written), ~25 GB per step for llama-1b. For bf16
weights and moments the bytes are torch's (14 per parameter) and the kernel is the faster of the two on the
H200 machine (bench.adamw times both paths against the HBM roofline).

One launch covers up to MAX_TENSORS tensors of one dtype combination through the device table of
parallel/triton_multi_tensor.py: each program takes CHUNK elements of one tensor, so the ~150 tensors of a 1B
model cost one launch, not 150.

Numerics: AdamW as torch's single-tensor loop computes it (decoupled decay `w *= 1 - lr * wd`, the first
moment by lerp, `w -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)`, bias corrections in double on the
host), in fp32 with IEEE-rounded square root and division, every 16-bit store rounded to nearest even as
torch's copies are; torch's fused CUDA kernel does part of its arithmetic in double, so the two agree to
fp32 rounding, not bit for bit (tests/parallel/test_triton_adamw.py). Under TRITON_INTERPRET=1 it runs on
CPU tensors.
"""

from __future__ import annotations

import math

import torch

from models.triton_support import triton_runs
from parallel.triton_multi_tensor import MAX_TENSORS, launch_table

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: MasterWeightAdamW keeps its torch path
    triton = None

# the best of bench.adamw's sweep on the H200 machine over llama-1b's three layouts (bench/results/adamw_h200.json)
CHUNK = 8192  # elements per program
BLOCK = 1024  # elements per inner iteration
NUM_WARPS = 4
HALF = (torch.bfloat16, torch.float16)
_DTYPES = (torch.float32, *HALF)


def available(device: torch.device | str) -> bool:
    """Whether the kernel can run on `device`: CUDA with triton, or triton's CPU interpreter."""
    return triton_runs(device)


if triton is not None:
    from parallel.triton_multi_tensor import TL_DTYPE, find_tensor

    @triton.jit
    def _adamw_kernel(addr_ptr, numel_ptr, first_ptr, T, grad_scale, decay, one_minus_beta1, beta2,
                      one_minus_beta2, step_size, bc2_sqrt, eps,
                      GRAD: tl.constexpr, WEIGHT: tl.constexpr, MOMENT: tl.constexpr, HALF: tl.constexpr,
                      HAS_HALF: tl.constexpr, ALIGNED: tl.constexpr, ALIGN_G: tl.constexpr, ALIGN_W: tl.constexpr,
                      ALIGN_M: tl.constexpr, ALIGN_H: tl.constexpr, TPAD: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK: tl.constexpr):
        t, base, n = find_tensor(first_ptr, numel_ptr, T, TPAD, CHUNK)
        g_ptr = tl.load(addr_ptr + t).to(tl.pointer_type(GRAD))
        w_ptr = tl.load(addr_ptr + T + t).to(tl.pointer_type(WEIGHT))
        m_ptr = tl.load(addr_ptr + 2 * T + t).to(tl.pointer_type(MOMENT))
        v_ptr = tl.load(addr_ptr + 3 * T + t).to(tl.pointer_type(MOMENT))
        h_ptr = tl.load(addr_ptr + 4 * T + t).to(tl.pointer_type(HALF)) if HAS_HALF else w_ptr
        if ALIGNED:  # every address 16-byte aligned (checked on the host): vector loads and stores (LaunchTable.align)
            g_ptr = tl.multiple_of(g_ptr, ALIGN_G)
            w_ptr = tl.multiple_of(w_ptr, ALIGN_W)
            m_ptr = tl.multiple_of(m_ptr, ALIGN_M)
            v_ptr = tl.multiple_of(v_ptr, ALIGN_M)
            h_ptr = tl.multiple_of(h_ptr, ALIGN_H)
        # a length read from memory says nothing about divisibility, so a masked load is element-wise: whole
        # chunks (all but each tensor's last) run unmasked
        if base + CHUNK <= n:
            for i in range(0, CHUNK, BLOCK):
                _step_block(g_ptr, w_ptr, m_ptr, v_ptr, h_ptr, base + i + tl.arange(0, BLOCK), n, grad_scale, decay,
                            one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps,
                            WEIGHT, MOMENT, HALF, HAS_HALF, False)
        else:
            for i in range(0, CHUNK, BLOCK):
                _step_block(g_ptr, w_ptr, m_ptr, v_ptr, h_ptr, base + i + tl.arange(0, BLOCK), n, grad_scale, decay,
                            one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps,
                            WEIGHT, MOMENT, HALF, HAS_HALF, True)

    @triton.jit
    def _step_block(g_ptr, w_ptr, m_ptr, v_ptr, h_ptr, offs, n, grad_scale, decay, one_minus_beta1, beta2,
                    one_minus_beta2, step_size, bc2_sqrt, eps, WEIGHT: tl.constexpr, MOMENT: tl.constexpr,
                    HALF: tl.constexpr, HAS_HALF: tl.constexpr, MASKED: tl.constexpr):
        """AdamW on the elements `offs` of one tensor (those below n where MASKED)."""
        ok = offs < n if MASKED else None
        zero = 0.0 if MASKED else None
        g = tl.load(g_ptr + offs, mask=ok, other=zero).to(tl.float32) * grad_scale
        w = tl.load(w_ptr + offs, mask=ok, other=zero).to(tl.float32) * decay
        m = tl.load(m_ptr + offs, mask=ok, other=zero).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=ok, other=zero).to(tl.float32)
        m = m + one_minus_beta1 * (g - m)
        v = v * beta2 + one_minus_beta2 * (g * g)
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        w = w - step_size * tl.div_rn(m, denom)
        tl.store(w_ptr + offs, _round(w, WEIGHT), mask=ok)
        tl.store(m_ptr + offs, _round(m, MOMENT), mask=ok)
        tl.store(v_ptr + offs, _round(v, MOMENT), mask=ok)
        if HAS_HALF:
            tl.store(h_ptr + offs, _round(w, HALF), mask=ok)

    @triton.jit
    def _round(w, HALF: tl.constexpr):
        """fp32 -> HALF (fp32 itself: unchanged), round to nearest even: bf16 by its bits (Triton's interpreter
        truncates a bf16 cast; this gives the device's rounding in both), NaN kept."""
        if HALF == tl.float32:
            return w
        if HALF == tl.bfloat16:
            bits = w.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            return tl.where(w != w, w.to(tl.bfloat16), out)
        return w.to(HALF)


def adamw_(grads: list[torch.Tensor], weights: list[torch.Tensor], exp_avgs: list[torch.Tensor],
           exp_avg_sqs: list[torch.Tensor], copies: list[torch.Tensor] | None, *, lr: float,
           betas: tuple[float, float], eps: float, weight_decay: float, step: int, grad_scale: float = 1.0) -> None:
    """One AdamW step (the `step`-th, counted from 1) in place on `weights`, `exp_avgs` and `exp_avg_sqs` from
    `grads` x `grad_scale`, then each stepped weight's rounding into `copies` (the 16-bit weights of fp32
    masters; None: the weights are the parameters). The lists are parallel; within each the tensors are
    contiguous, on one device and of one float dtype, and every tensor has its gradient's length."""
    lists = [grads, weights, exp_avgs, exp_avg_sqs] + ([copies] if copies is not None else [])
    if not grads:
        return
    if any(len(x) != len(grads) for x in lists):
        raise ValueError(f"parallel lists of different lengths: {[len(x) for x in lists]}")
    for k, col in enumerate(lists):
        if len({(t.dtype, t.device) for t in col}) != 1 or not all(t.is_contiguous() for t in col):
            raise ValueError(f"list {k}: tensors of one dtype and device, contiguous, are needed")
        if col[0].dtype not in _DTYPES:
            raise ValueError(f"list {k}: {col[0].dtype} is not one of {_DTYPES}")
    if exp_avgs[0].dtype != exp_avg_sqs[0].dtype:
        raise ValueError(f"the moments have one dtype, got {exp_avgs[0].dtype} and {exp_avg_sqs[0].dtype}")
    if copies is not None and (weights[0].dtype != torch.float32 or copies[0].dtype not in HALF):
        raise ValueError(f"copies are the 16-bit weights of fp32 masters, got {copies[0].dtype} of {weights[0].dtype}")
    if any(t.numel() != g.numel() for col in lists[1:] for t, g in zip(col, grads)):
        raise ValueError("every tensor of a parameter must have its gradient's length")
    beta1, beta2 = betas
    bc2_sqrt = math.sqrt(1 - beta2 ** step)
    step_size = lr / (1 - beta1 ** step)
    for lo in range(0, len(grads), MAX_TENSORS):
        part = [col[lo: lo + MAX_TENSORS] for col in lists]
        _launch(part, grad_scale=grad_scale, decay=1 - lr * weight_decay, beta1=beta1, beta2=beta2,
                step_size=step_size, bc2_sqrt=bc2_sqrt, eps=eps)


def _launch(lists: list[list[torch.Tensor]], *, grad_scale, decay, beta1, beta2, step_size, bc2_sqrt, eps) -> None:
    table = launch_table(lists, chunk=CHUNK)
    if table is None:
        return
    has_copy = len(lists) == 5
    align = table.align
    _adamw_kernel[(table.programs,)](
        table.addrs, table.numels, table.firsts, table.tensors, float(grad_scale), float(decay), float(1 - beta1),
        float(beta2), float(1 - beta2), float(step_size), float(bc2_sqrt), float(eps),
        GRAD=TL_DTYPE[lists[0][0].dtype], WEIGHT=TL_DTYPE[lists[1][0].dtype], MOMENT=TL_DTYPE[lists[2][0].dtype],
        HALF=TL_DTYPE[lists[4][0].dtype] if has_copy else tl.bfloat16, HAS_HALF=has_copy, ALIGNED=table.aligned,
        ALIGN_G=align[0], ALIGN_W=align[1], ALIGN_M=align[2], ALIGN_H=align[-1],
        TPAD=table.tpad, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=NUM_WARPS)
