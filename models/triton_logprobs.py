"""The chunked log-prob's softmax work (models/logprobs.py) as two Triton kernels over the chunk's logits
in their own dtype: one read of the logits forward, one read and one in-place write backward.

In torch each chunk's [c, V] logits are cast to fp32 and passed over ~5 times forward (cast, max,
subtract, exp, sum) and ~8 times backward (cast, subtract, exp, add, mul, sub, mul, cast back): with
llama-1b's 32k vocab that was ~110 ms of elementwise kernels in a GRPO step's reference forward and
update on an H200, for work bound by one read of the bf16 logits (~10 ms). Fused, forward + backward over
16384 tokens took 13.8 ms against 32.2 (bench/results/logprobs_fused_h200.json).

    logp, lse, ent = token_stats(z, targets, temperature, with_entropy=True)   # z [c, V] = h @ W^T
    logit_grad_(z, targets, lse, g_logp, temperature, entropy=ent, g_entropy=g_ent)  # z <- dL/d(h @ W^T)

The math is models/logprobs.py's, in fp32 after the logits' own rounding, with the same IEEE division by
the temperature: x = z / T, lse = logsumexp(x), logp = x[y] - lse, H = lse - sum_v p_v x_v with
p = exp(x - lse); backward dx = p * (-(log p + H) * gH - g_logp) + onehot(y) * g_logp, then / T, cast to
z's dtype. Forward streams each row once with per-lane online statistics (max m, sum s of exp(x - m) and
sum t of exp(x - m) * x; one exp per element), combined across lanes at the end. Summation order
differs from torch's, so results agree to fp32 rounding (tests/models/test_triton_logprobs.py, under
Triton's CPU interpreter; tests/models/test_logprobs.py's GPU test on CUDA).
"""

from __future__ import annotations

import torch

from models.triton_support import triton_runs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: models/logprobs.py keeps its torch path
    triton = None


def available(device: torch.device) -> bool:
    """Whether the kernels can run here: CUDA with triton, or triton's CPU interpreter."""
    return triton_runs(device)


if triton is not None:

    @triton.jit
    def _logits_tile(base, start, V, temperature, TEMP: tl.constexpr, BLOCK_V: tl.constexpr):
        """Vocab ids [start, start + BLOCK_V), which of them exist, and their logits / T in fp32 (IEEE division,
        as torch's; 0 past the vocab)."""
        v = start + tl.arange(0, BLOCK_V)
        ok = v < V
        x = tl.load(base + v, mask=ok, other=0.0).to(tl.float32)
        if TEMP:
            x = tl.math.div_rn(x, temperature)
        return v, ok, x

    @triton.jit
    def _stats_kernel(z_ptr, tgt_ptr, lp_ptr, lse_ptr, ent_ptr, V, s_row, temperature,
                      TEMP: tl.constexpr, ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * s_row
        m = tl.full([BLOCK_V], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_V], tl.float32)
        t = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, V, BLOCK_V):
            v, ok, x = _logits_tile(base, start, V, temperature, TEMP, BLOCK_V)
            # one exp per element: e = exp(-|x - m|) rescales whichever of the old sum and the new term is
            # under the new max (the first live element of a lane: m = -inf, e = 0, s = 1)
            up = ok & (x > m)
            e = tl.exp(-tl.abs(x - m))
            s = tl.where(up, s * e + 1.0, tl.where(ok, s + e, s))
            if ENTROPY:
                t = tl.where(up, t * e + x, tl.where(ok, t + e * x, t))
            m = tl.where(up, x, m)
        mx = tl.max(m, 0)
        w = tl.where(m > float("-inf"), tl.exp(m - mx), 0.0)  # lanes that saw no element weigh 0
        total = tl.sum(s * w, 0)
        lse = mx + tl.log(total)
        x_tgt = tl.load(base + tl.load(tgt_ptr + row)).to(tl.float32)
        if TEMP:
            x_tgt = tl.math.div_rn(x_tgt, temperature)
        tl.store(lp_ptr + row, x_tgt - lse)
        tl.store(lse_ptr + row, lse)
        if ENTROPY:
            tl.store(ent_ptr + row, lse - tl.sum(t * w, 0) / total)

    @triton.jit
    def _grad_kernel(z_ptr, tgt_ptr, lse_ptr, glp_ptr, ent_ptr, gent_ptr, V, s_row, temperature,
                     TEMP: tl.constexpr, ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * s_row
        lse = tl.load(lse_ptr + row)
        g_lp = tl.load(glp_ptr + row).to(tl.float32)
        tgt = tl.load(tgt_ptr + row)
        if ENTROPY:
            ent = tl.load(ent_ptr + row)
            g_ent = tl.load(gent_ptr + row).to(tl.float32)
        for start in range(0, V, BLOCK_V):
            v, ok, x = _logits_tile(base, start, V, temperature, TEMP, BLOCK_V)
            logp = x - lse
            p = tl.exp(logp)
            if ENTROPY:
                g = ((logp + ent) * -g_ent - g_lp) * p
            else:
                g = p * -g_lp
            g = tl.where(v == tgt, g + g_lp, g)
            if TEMP:
                g = tl.math.div_rn(g, temperature)
            tl.store(base + v, g.to(z_ptr.dtype.element_ty), mask=ok)


def _launch(z: torch.Tensor) -> dict:
    """Tile and warps (a function of the vocab and device only: no autotune). 4096-wide tiles over 8 warps
    on a GPU; small tiles under the interpreter, so test vocabs span several tiles and a partial one."""
    if not z.is_cuda:
        return dict(BLOCK_V=32, num_warps=4)
    return dict(BLOCK_V=min(4096, max(128, triton.next_power_of_2(z.shape[1]))), num_warps=8)


def _check(z: torch.Tensor, targets: torch.Tensor) -> None:
    if z.dim() != 2 or z.stride(1) != 1 or targets.shape != z.shape[:1]:
        raise ValueError(f"need z [c, V] with unit stride over V and targets [c], got {tuple(z.shape)} "
                         f"strides {z.stride()} and targets {tuple(targets.shape)}")


def token_stats(z: torch.Tensor, targets: torch.Tensor, temperature: float, *, with_entropy: bool,
                out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """z [c, V] logits (any float dtype), targets [c] -> (logp [c], lse [c], entropy [c] or empty), fp32,
    of softmax(z / temperature); written into `out` (three contiguous fp32 tensors) when given."""
    _check(z, targets)
    targets = targets.contiguous()
    c = z.shape[0]
    if out is None:
        out = tuple(torch.empty(c if i < 2 or with_entropy else 0, dtype=torch.float32, device=z.device)
                    for i in range(3))
    logp, lse, ent = out
    if not all(x.is_contiguous() and x.dtype == torch.float32 for x in out):
        raise ValueError("out must be three contiguous fp32 tensors")
    if c:
        _stats_kernel[(c,)](z, targets, logp, lse, ent if with_entropy else lse, z.shape[1], z.stride(0),
                            float(temperature), TEMP=temperature != 1.0, ENTROPY=with_entropy, **_launch(z))
    return logp, lse, ent


def logit_grad_(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g_logp: torch.Tensor,
                temperature: float, *, entropy: torch.Tensor | None = None,
                g_entropy: torch.Tensor | None = None) -> torch.Tensor:
    """Overwrite z [c, V] (the chunk's logits h @ W^T, recomputed) with the gradient of
    sum(g_logp * logp) + sum(g_entropy * entropy) w.r.t. them, in z's dtype; returns z."""
    _check(z, targets)
    use_ent = g_entropy is not None
    if use_ent and entropy is None:
        raise ValueError("g_entropy needs the forward's entropy")
    # the kernel reads row r of each at offset r: autograd hands the gradient of a sum as a stride-0 expand
    targets, lse, g_logp = (x.contiguous() for x in (targets, lse, g_logp))
    if use_ent:
        entropy, g_entropy = entropy.contiguous(), g_entropy.contiguous()
    if z.shape[0]:
        _grad_kernel[(z.shape[0],)](z, targets, lse, g_logp, entropy if use_ent else lse,
                                    g_entropy if use_ent else g_logp, z.shape[1], z.stride(0), float(temperature),
                                    TEMP=temperature != 1.0, ENTROPY=use_ent, **_launch(z))
    return z
