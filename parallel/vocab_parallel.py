"""Token log-probs and entropy from hidden states when the LM head is split over vocab.

    logp, ent = vocab_parallel_token_logprobs(hidden, lm_head.weight.to_local(), targets,
                                              tp_group=tp_group, vocab_start=tp_rank * V // tp)

Each TP rank holds rows [vocab_start, vocab_start + V_local) of the head. Per chunk of
tokens a rank forms its [C, V_local] logits in fp32, and two all-reduces over the TP
group finish the softmax statistics: MAX of the row maxima, then SUM of (sum-exp,
target logit, sum of p * logit) stacked into one buffer. Nothing of shape [N, V] is ever
materialised; the backward recomputes each chunk's logits instead of saving them, and
is itself vocab-parallel (each rank forms the gradient of its own logits; the hidden
gradient is all-reduced). With `tp_group=None` (or a group of one) it is
models.logprobs.compute_token_logprobs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.logprobs import TORCH_CHUNK, compute_token_logprobs


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _chunk_stats(h, w, tgt, *, vocab_start, temperature, group, with_entropy):
    """One chunk: h [C, H], w [Vl, H], tgt [C] -> (lse [C], entropy [C] | None, target logit [C]), fp32."""
    logits = (h @ w.t()).float()
    if temperature != 1.0:
        logits.div_(temperature)
    rows = w.shape[0]
    local_t = tgt - vocab_start
    owned = (local_t >= 0) & (local_t < rows)
    t_logit = logits.gather(1, local_t.clamp(0, rows - 1)[:, None]).squeeze(1) * owned
    gmax = _all_reduce(logits.amax(dim=-1), dist.ReduceOp.MAX, group)
    shifted = logits.sub_(gmax[:, None])  # in place: one [C, V] fp32 buffer less
    e = shifted.exp()
    parts = [e.sum(-1), t_logit]
    if with_entropy:
        parts.append(e.mul_(shifted).sum(-1))
    # one SUM all-reduce for all per-token statistics of the chunk
    stats = _all_reduce(torch.stack(parts), dist.ReduceOp.SUM, group)
    log_z = torch.log(stats[0])
    # H = lse - E_p[logit] = log Z - E_p[logit - max]
    ent = log_z - stats[2] / stats[0] if with_entropy else None
    return gmax + log_z, ent, stats[1]


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, group, vocab_start, temperature, chunk_size, with_entropy):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse_all = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk_size):
            sl = slice(s, s + chunk_size)
            lse, chunk_ent, t_logit = _chunk_stats(
                hidden[sl], weight, targets[sl], vocab_start=vocab_start, temperature=temperature,
                group=group, with_entropy=with_entropy)
            logp[sl] = t_logit - lse
            lse_all[sl] = lse
            if with_entropy:
                ent[sl] = chunk_ent
        ctx.save_for_backward(hidden, weight, targets, lse_all, ent)
        ctx.cfg = (group, vocab_start, temperature, chunk_size, with_entropy)
        # an unused output (entropy kept only as a metric) then costs nothing in backward
        ctx.set_materialize_grads(False)
        return (logp, ent) if with_entropy else (logp,)

    @staticmethod
    def backward(ctx, g_logp, g_ent=None):
        hidden, weight, targets, lse_all, ent_all = ctx.saved_tensors
        group, vocab_start, temperature, chunk_size, with_entropy = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_ent is not None and not with_entropy:
            g_ent = None
        if (g_logp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None, None, None, None, None
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        vl = weight.shape[0]
        for s in range(0, hidden.shape[0], chunk_size):
            sl = slice(s, s + chunk_size)
            h = hidden[sl]
            logits = (h @ weight.t()).float()
            if temperature != 1.0:
                logits.div_(temperature)
            logp = logits.sub_(lse_all[sl, None])  # in place: log p_j
            p = logp.exp()
            # d logp_t / d logit_j = [j == t] - p_j;  d H / d logit_j = -p_j (log p_j + H)
            if g_ent is not None:
                coef = logp.add_(ent_all[sl, None]).mul_(g_ent[sl, None])
                if g_logp is not None:
                    coef.add_(g_logp[sl, None])
                g = p.mul_(coef).neg_()
            else:
                g = p.mul_(g_logp[sl, None]).neg_()
            if g_logp is not None:
                local_t = targets[sl] - vocab_start
                owned = (local_t >= 0) & (local_t < vl)
                # scatter with a 0/1 weight instead of indexing owned rows: no host sync on GPU
                g.scatter_add_(1, local_t.clamp(0, vl - 1)[:, None], (g_logp[sl] * owned)[:, None])
            if temperature != 1.0:
                g.div_(temperature)
            g = g.to(hidden.dtype)
            if need_h:
                grad_h[sl] = g @ weight
            if need_w:
                # matmul in the compute dtype, accumulate chunks in fp32
                grad_w += (g.t() @ h).float()
        if need_h:
            # hidden is replicated over TP: each rank holds the partial sum of its vocab slice
            _all_reduce(grad_h, dist.ReduceOp.SUM, group)
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def vocab_parallel_token_logprobs(
    hidden: torch.Tensor,
    local_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_start: int = 0,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target token (and the entropy of each row's distribution).

    hidden [..., H] (final-normed, replicated over the TP group), local_weight [V_local, H]
    (rows vocab_start .. vocab_start + V_local of the head), targets [...] int64 global token
    ids -> logprobs [...] fp32, entropy [...] fp32 or None. Differentiable in hidden and
    local_weight; all ranks of `tp_group` must call it with the same hidden and targets.
    chunk_size None: compute_token_logprobs' default on one device, models.logprobs.TORCH_CHUNK split over TP.
    """
    if local_weight.dim() != 2 or hidden.shape[-1] != local_weight.shape[1]:
        raise ValueError(f"hidden [..., {hidden.shape[-1]}] does not match head weight {tuple(local_weight.shape)}; "
                         "pass the local [V/tp, H] shard (DTensor.to_local())")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"targets {tuple(targets.shape)} must match hidden {tuple(hidden.shape[:-1])}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if vocab_start == 0 and (tp_group is None or dist.get_world_size(tp_group) == 1):
        # one device holds the whole head: the single-device function (with its fused kernels on CUDA)
        return compute_token_logprobs(hidden, local_weight, targets, temperature=temperature, chunk_size=chunk_size,
                                      with_entropy=with_entropy)
    lead = targets.shape
    out = _VocabParallelLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]), local_weight, targets.reshape(-1).long(), tp_group,
        int(vocab_start), float(temperature), int(chunk_size or TORCH_CHUNK), bool(with_entropy))
    logp = out[0].view(lead)
    ent = out[1].view(lead) if with_entropy else None
    return logp, ent
