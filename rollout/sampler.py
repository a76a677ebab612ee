"""On-device sampling with per-row temperature / top-k / top-p and per-request reproducible randomness.

Randomness is counter-based: row b draws ONE uniform u = hash(key_b, position_b) and samples by
inverting the CDF of its (filtered) distribution. So a request's tokens depend only on its own seed
and logits, never on the batch around it, preemption or TP degree; and the whole step is a fixed set
of kernels with no host sync and no per-request generator (CUDA-graph capturable). One uniform per
row instead of Gumbel noise per (row, vocab) keeps the RNG cost O(B) rather than O(B x V).

    tokens, logprobs = sample(logits, temperature=t, top_k=k, top_p=p, keys=keys, positions=pos)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rollout.scheduler import Sequence

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2^31, so (x < 2^32) * _MUL never overflows int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """32-bit integer avalanche hash on int64 tensors holding values in [0, 2^32)."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


def uniform_from_counter(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[B] int64 keys and counters -> [B] float32 uniforms in (0, 1), a pure function of (key, counter)."""
    h = _mix32((keys & _M32) ^ _mix32((counters & _M32) ^ 0x2545F491))
    h = _mix32(h ^ ((keys >> 32) & _M32))
    # 24 random bits: exact in float32, and +0.5 keeps u strictly inside (0, 1)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def request_key(seed: int, sample_index: int) -> int:
    """Host-side key of sample `sample_index` of a request seeded with `seed` (a 62-bit int)."""
    x = (seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % (1 << 64)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) % (1 << 64)
    x ^= x >> 29
    return x >> 2  # fits a signed int64 tensor


def any_filtered(seqs: Iterable[Sequence]) -> bool:
    """Whether any sampled (T > 0) row needs the sorted top-k/top-p path."""
    return any(s.params.temperature > 0 and (s.params.top_k > 0 or s.params.top_p < 1) for s in seqs)


def sample(logits: torch.Tensor, *, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           keys: torch.Tensor | None = None, positions: torch.Tensor | None = None,
           uniforms: torch.Tensor | None = None, filtered: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    logits [B, V] (any float dtype; computed in fp32); temperature [B] float (0 -> greedy); top_k [B]
    int64 (<= 0 -> off); top_p [B] float in (0, 1]; keys, positions [B] int64 (the RNG counter is the
    position of the token being sampled), or `uniforms` [B] = uniform_from_counter(keys, positions)
    precomputed (the decode step gathers them from a per-slot table). `filtered=False` skips the sort when no
    row uses top-k/top-p
    (same result as filtered with top_k<=0, top_p=1).
    Returns tokens [B] int64 and logprobs [B] float32 = log softmax(logits / T)[token], T = 1 when greedy.
    """
    logits = logits.float()
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    logp = torch.log_softmax(logits / t[:, None], dim=-1)
    u = uniforms if uniforms is not None else uniform_from_counter(keys, positions)
    if filtered:
        vocab = logits.shape[-1]
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        p = sorted_logp.exp()
        rank = torch.arange(vocab, device=logits.device)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
        p = p * (rank[None, :] < k[:, None])
        # top-p on the top-k-renormalised distribution: keep the smallest prefix with mass >= top_p
        cum = p.cumsum(dim=-1)
        before = (cum - p) / cum[:, -1:]
        p = torch.where(before < top_p[:, None].float(), p, torch.zeros_like(p))
        cdf = p.cumsum(dim=-1)
        j = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=vocab - 1)
        tokens = order.gather(1, j)[:, 0]
    else:
        cdf = logp.exp().cumsum(dim=-1)
        tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=logits.shape[-1] - 1)[:, 0]
    tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    return tokens, logp.gather(1, tokens[:, None])[:, 0]
