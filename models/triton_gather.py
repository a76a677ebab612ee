"""The shared-prompt key gather's backward (models/document_layout.gather_keys) on CUDA: the prompt
tokens' extra copies summed in fp32 by one Triton kernel, written by distinct row (no atomics).

    grad_x = grad.index_select(0, own_index)                # every token's own copy (a plain gather)
    add_copies_(grad_x, grad, prefix_rows, prefix_copies)   # grad_x[rows[u]] += sum_c grad[copies[u, c]]

One program per prompt token u (and BLOCK_F-wide slice of the row's features) loads its C copies, sums
them in fp32, adds the own copy and rounds once, as the torch expression it replaces does: Inductor
compiled that gather-reduce + index_put into one kernel at ~7% of HBM bandwidth (24 ms of a GRPO
update on an H200; now ~5 ms, docs/history/measurements.md). Under TRITON_INTERPRET=1
it runs on CPU tensors (tests/models/test_triton_gather.py).
"""

from __future__ import annotations

import torch

from models.triton_support import triton_runs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: document_layout keeps its torch path
    triton = None


def available(device: torch.device) -> bool:
    """Whether the kernel can run here: CUDA with triton, or triton's CPU interpreter."""
    return triton_runs(device)


if triton is not None:

    @triton.jit
    def _add_copies_kernel(out_ptr, grad_ptr, rows_ptr, copies_ptr, F, C, s_c, BLOCK_F: tl.constexpr):
        u = tl.program_id(0)
        f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        ok = f < F
        acc = tl.zeros([BLOCK_F], tl.float32)
        for c in range(C):
            at = tl.load(copies_ptr + u * s_c + c)  # -1: padding
            live = ok & ((f * 0 + at) >= 0)  # (broadcast first: the interpreter masks only with [BLOCK_F] bools)
            acc += tl.load(grad_ptr + at.to(tl.int64) * F + f, mask=live, other=0.0).to(tl.float32)
        row = out_ptr + tl.load(rows_ptr + u).to(tl.int64) * F + f
        own = tl.load(row, mask=ok).to(tl.float32)
        tl.store(row, (own + acc).to(out_ptr.dtype.element_ty), mask=ok)


def add_copies_(out: torch.Tensor, grad: torch.Tensor, rows: torch.Tensor, copies: torch.Tensor) -> torch.Tensor:
    """out[rows[u]] += sum_c grad[copies[u, c]] (copies -1 padded), summed in fp32 and rounded once to out's
    dtype; out [N, ...] and grad [K, ...] contiguous with the same trailing shape. Returns out."""
    if out.shape[1:] != grad.shape[1:] or not (out.is_contiguous() and grad.is_contiguous()):
        raise ValueError(f"out {tuple(out.shape)} and grad {tuple(grad.shape)} must be contiguous rows of one shape")
    if rows.shape[0] != copies.shape[0] or copies.dim() != 2:
        raise ValueError(f"rows [U] and copies [U, C] disagree: {tuple(rows.shape)}, {tuple(copies.shape)}")
    feats = out[0].numel() if out.shape[0] else 0
    if rows.numel() and feats:
        copies = copies.contiguous()
        block = min(1024, triton.next_power_of_2(feats))
        _add_copies_kernel[(rows.shape[0], triton.cdiv(feats, block))](
            out, grad, rows, copies, feats, copies.shape[1], copies.stride(0), BLOCK_F=block, num_warps=4)
    return out
