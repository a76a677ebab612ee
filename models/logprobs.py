"""Memory-lean token log-probs and entropies straight from hidden states and the lm_head weight.

    logp, ent = compute_token_logprobs(hidden, model.lm_head.weight, targets, temperature=1.0,
                                       with_entropy=True)

Full fp32 logits of a PPO batch do not fit: 16k tokens x 128k vocab x 4 B = 8 GiB, times the
softmax/grad copies autograd keeps. Here logits exist for `chunk_size` tokens at a time, in forward
and again (recomputed) in backward, so the peak is a few [chunk_size, V] fp32 buffers plus one fp32
[V, H] gradient accumulator. The matmuls run in the weight's dtype (bf16 on GPU, as the rollout engine
computes its logits), everything after them in fp32. Where Triton runs (CUDA), the softmax work of
each chunk is two fused kernels over the logits in their own dtype (models/triton_logprobs.py).

Kept logits: on the fused path the forward's 16-bit logits may instead stay for the backward, which
then skips the recompute GEMM (a quarter of the LM head's matmul work in a trained micro-batch: 2 of
its 8 x tokens x H x V FLOPs). By default (`keep_logits=None`) they stay where a backward follows and
all of them take at most KEEP_LOGITS_FREE_FRACTION of the device memory still free (the driver's free
memory plus the allocator's cached blocks): 5 GB for a 16k-token micro-batch at V = 152k. The backward
overwrites each kept chunk with its gradient and drops it; the results are the recomputing path's bit
for bit (the same GEMM on the same inputs).
"""

from __future__ import annotations

import torch

from models import triton_logprobs

FUSED_CHUNK, TORCH_CHUNK = 4096, 1024  # tokens per chunk by default (compute_token_logprobs)
KEEP_LOGITS_FREE_FRACTION = 0.25  # of the free device memory: the most the kept logits may take (keep_logits=None)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """[c, H] x [V, H] -> [c, V] fp32 logits / temperature."""
    z = (h @ weight.t()).float()
    return z.div_(temperature) if temperature != 1.0 else z


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_size: int, with_entropy: bool,
                fused: bool, keep: bool):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        ctx.kept = [] if fused and keep else None  # the chunks' logits, for the backward (fused path)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            if fused:
                z = hidden[s:e] @ weight.t()
                triton_logprobs.token_stats(z, targets[s:e], temperature, with_entropy=with_entropy,
                                            out=(logprobs[s:e], lse[s:e], entropy[s:e]))
                if ctx.kept is not None:
                    ctx.kept.append(z)
                continue
            z = _chunk_logits(hidden[s:e], weight, temperature)
            lse[s:e] = torch.logsumexp(z, dim=-1)
            logprobs[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - lse[s:e]
            if with_entropy:
                # H = lse - sum_v p_v z_v  (= -sum p log p without forming log p)
                p = (z - lse[s:e, None]).exp_()
                entropy[s:e] = lse[s:e] - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy, ctx.fused = temperature, chunk_size, with_entropy, fused
        ctx.mark_non_differentiable(lse)
        return logprobs, entropy, lse

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, _grad_lse):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk_size
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = hidden.shape[0]
        use_ent = ctx.with_entropy and grad_entropy is not None
        g_lp = grad_logprobs if grad_logprobs is not None else torch.zeros(n, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        # fp32 accumulator: summing many bf16 chunk products in bf16 would lose the small ones
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        kept, ctx.kept = ctx.kept, None
        for i, s in enumerate(range(0, n, chunk)):
            e = min(s + chunk, n)
            h = hidden[s:e]
            if ctx.fused:
                z = h @ weight.t() if kept is None else kept[i]
                if kept is not None:
                    kept[i] = None  # overwritten by its gradient below and freed after it
                g = triton_logprobs.logit_grad_(z, targets[s:e], lse[s:e], g_lp[s:e], t,
                                                entropy=entropy[s:e] if use_ent else None,
                                                g_entropy=grad_entropy[s:e] if use_ent else None)
            else:
                g = _chunk_logit_grad(h, weight, targets[s:e], lse[s:e], g_lp[s:e], t,
                                      (entropy[s:e], grad_entropy[s:e]) if use_ent else None)
            if need_h:
                grad_h[s:e] = g @ weight
            if need_w:
                _accumulate_outer(grad_w, g, h)
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def _chunk_logit_grad(h, weight, targets, lse, g_lp, t: float, ent: tuple | None) -> torch.Tensor:
    """The torch path of one chunk's logit gradient (models/triton_logprobs.logit_grad_'s math), in the
    weight's dtype; `ent` = (entropy, its gradient) when the entropy term has one."""
    logp = _chunk_logits(h, weight, t).sub_(lse[:, None])
    p = logp.exp()
    # d logp_y / dz = onehot(y) - p ;  d H / dz = -p * (log p + H)
    if ent is not None:
        entropy, g_ent = ent
        g = logp.add_(entropy[:, None]).mul_(-g_ent[:, None].float())
        g.sub_(g_lp[:, None]).mul_(p)
    else:
        g = p.mul_(-g_lp[:, None])
    g[torch.arange(g.shape[0], device=g.device), targets] += g_lp
    if t != 1.0:
        g.div_(t)
    return g.to(weight.dtype)


def _accumulate_outer(acc: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """acc (fp32 [V, H]) += g^T @ h for g [c, V], h [c, H] in the weight dtype."""
    if g.dtype == torch.float32:
        acc.addmm_(g.t(), h)
    elif g.is_cuda and _fp32_addmm_ok(g.device, g.dtype):
        # one GEMM with bf16 inputs accumulating straight into the fp32 buffer (no [V, H] temporary)
        torch.addmm(acc, g.t(), h, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(g.t() @ h)


_FP32_ADDMM_OK: dict[tuple[int, torch.dtype], bool] = {}


def _fp32_addmm_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Does addmm(out_dtype=fp32, out=acc) with half inputs work in place on this GPU (probed once)?"""
    key = (device.index or 0, dtype)
    if key not in _FP32_ADDMM_OK:
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            a = torch.randn(64, 96, device=device, generator=gen).to(dtype)
            b = torch.randn(64, 80, device=device, generator=gen).to(dtype)
            acc = torch.randn(96, 80, device=device, generator=gen)
            want = acc + a.float().t() @ b.float()
            torch.addmm(acc, a.t(), b, out_dtype=torch.float32, out=acc)
            _FP32_ADDMM_OK[key] = bool((acc - want).abs().max() < 1e-2)
        except (RuntimeError, TypeError, NotImplementedError):  # op missing for this device / build
            _FP32_ADDMM_OK[key] = False
    return _FP32_ADDMM_OK[key]


def compute_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    fused: bool | None = None,
    keep_logits: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target token under softmax(hidden @ weight^T / temperature), and optionally the
    entropy of that full distribution; both fp32 and differentiable w.r.t. hidden and weight.

    hidden [..., H] (final-normed hidden states), weight [V, H] (lm_head), targets [...] int token ids
    (padding positions need a valid id; mask their outputs afterwards) -> logprobs [...], entropy [...]
    or None. Never materialises more than [chunk_size, V] logits at once, in forward or backward.
    `fused`: the Triton kernels for the softmax work (models/triton_logprobs.py; None: where they run).
    `chunk_size` None: 4096 tokens fused (one [4096, V] buffer in the weight dtype: 0.26 GB at V = 32k;
    on an H200 10% faster than 1024, bench/results/logprobs_fused_h200.json), 1024 on the torch path
    (its fp32 copies take ~6x the bytes per token). `keep_logits`: the fused path keeps the forward's
    logits for the backward instead of recomputing them (None: where a backward follows and they fit in
    KEEP_LOGITS_FREE_FRACTION of the free device memory; see the module docstring).
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} needs targets of shape {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(targets.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} != weight [V, H] {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden dtype {hidden.dtype} != weight dtype {weight.dtype}; cast one of them")
    if fused is None:
        fused = triton_logprobs.available(hidden.device)
    elif fused and not triton_logprobs.available(hidden.device):
        raise ValueError(f"fused=True needs triton on CUDA (or its CPU interpreter); {hidden.device} has neither")
    if chunk_size is None:
        chunk_size = FUSED_CHUNK if fused else TORCH_CHUNK
    if temperature <= 0 or chunk_size <= 0:
        raise ValueError(f"temperature ({temperature}) and chunk_size ({chunk_size}) must be > 0")
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1).long()
    if keep_logits is None:
        keep_logits = fused and _logits_fit(flat_h, weight)
    logprobs, entropy, _ = _TokenLogprobs.apply(flat_h, weight, flat_t, float(temperature), int(chunk_size),
                                                bool(with_entropy), bool(fused), bool(keep_logits))
    logprobs = logprobs.view(targets.shape)
    return logprobs, (entropy.view(targets.shape) if with_entropy else None)


def _logits_fit(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a backward will follow (grad mode, an input that needs a gradient) on a CUDA device whose free
    memory (the driver's, plus the allocator's cached blocks) holds all [N, V] logits KEEP_LOGITS_FREE_FRACTION
    times over. Host-side queries only: no synchronisation."""
    if not (hidden.is_cuda and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        return False
    need = hidden.shape[0] * weight.shape[0] * weight.element_size()
    free, _ = torch.cuda.mem_get_info(hidden.device)
    cached = torch.cuda.memory_reserved(hidden.device) - torch.cuda.memory_allocated(hidden.device)
    return need <= KEEP_LOGITS_FREE_FRACTION * (free + cached)
