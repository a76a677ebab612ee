"""Token-budget micro-batching and balanced partitioning (packing: ppo/batch/packing.py).

    minis = plan_micro_batches(lengths, dp=dp, rank=r, max_tokens=8192)  # [mini][micro] -> sample indices
    mbs = minis[0]                                            # same micro-batch counts on every DP rank
    packed = pack([seqs[i] for i in mb], pad_id=0, prompt_lens=[...])
    logits = model(packed.input_ids, packed.position_ids, attn=DocumentAttention(packed.position_ids))
    logp = unpack_responses(logprobs_from_logits(logits, packed.labels), packed)   # [B, R]

Everything here is deterministic (ties broken by index): the PPO loop relies on the old-log-prob
recompute and the first update epoch seeing the identical partition, so the ratio is exactly 1
on-policy.
"""

from __future__ import annotations

import heapq
import math
import warnings
from collections.abc import Sequence

import numpy as np

# packing lived here first; its names stay importable from this module
from ppo.batch.packing import (  # noqa: F401
    PackedBatch,
    gather_response_logprobs,
    pack,
    pack_prompt_responses,
    prompt_groups,
    responses_to_packed,
    unpack,
    unpack_responses,
)

# ---------------------------------------------------------------- partitioning


def _check_k(n: int, k: int, equal_size: bool) -> None:
    if k < 1:
        raise ValueError(f"number of partitions must be >= 1 (got {k})")
    if equal_size and n % k:
        raise ValueError(f"equal_size partitioning needs len(lengths)({n}) divisible by k({k}); "
                         f"pad the batch or change the batch size / dp")


def _finish(parts: list[list[int]]) -> list[list[int]]:
    """Sorted indices inside each part; parts ordered by their smallest index (empties last)."""
    parts = [sorted(p) for p in parts]
    return sorted(parts, key=lambda p: (not p, p[0] if p else 0))


def karmarkar_karp(lengths: Sequence[int], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Split indices 0..n-1 into k parts with near-equal sums of `lengths` (largest differencing).

    Each item starts as a k-way partial partition; the two partial partitions with the largest
    spread (max - min subset sum) are repeatedly merged by pairing the heaviest subset of one with
    the lightest of the other. equal_size=True starts from groups of k consecutive sorted items,
    one per subset, so every part gets exactly n/k indices. Returns k lists of indices.

    A state is two [k] arrays (subset sums, subset ids), so a merge is a few numpy ops; subset
    membership is a union-find over items (id = smallest item index, -1 = empty), resolved once
    at the end: O(n k) numpy work instead of copying item lists (4096 items into 264 parts: ~0.1 s).
    """
    n = len(lengths)
    _check_k(n, k, equal_size)
    if n == 0:
        return [[] for _ in range(k)]
    if k == 1:  # one part holds everything (the merges below would take ~1 ms to find that out)
        return [list(range(n))]
    lens = np.asarray(lengths, dtype=np.int64)
    order = np.lexsort((np.arange(n), lens))  # ascending (length, index)
    heap: list[tuple[int, int, np.ndarray, np.ndarray]] = []
    counter = 0
    parent = np.arange(n)

    def push(sums: np.ndarray, ids: np.ndarray, *, presorted: bool = False) -> None:
        nonlocal counter
        if not presorted:
            # heaviest first, ties by smallest item (empty last); one int64 key sorts 3x faster than lexsort
            o = np.argsort(np.where(ids < 0, n, ids) - sums * (n + 1), kind="stable")
            sums, ids = sums[o], ids[o]
        heapq.heappush(heap, (int(sums[-1] - sums[0]), counter, sums, ids))
        counter += 1

    if equal_size:
        for g in range(0, n, k):
            grp = order[g:g + k]
            push(lens[grp], grp.astype(np.int64))
    else:
        zeros, empty = np.zeros(k, np.int64), np.full(k, -1, np.int64)
        for i in order.tolist():
            sums, ids = zeros.copy(), empty.copy()
            sums[0], ids[0] = lens[i], i
            push(sums, ids, presorted=True)  # one item then empties: already in order
    while len(heap) > 1:
        _, _, sa, ia = heapq.heappop(heap)
        _, _, sb, ib = heapq.heappop(heap)
        # heaviest of a with lightest of b: the difference cancels out
        sb, ib = sb[::-1], ib[::-1]
        both = (ia >= 0) & (ib >= 0)
        lo, hi = np.minimum(ia, ib), np.maximum(ia, ib)
        parent[hi[both]] = lo[both]  # each id is a root until merged once, so this is a plain link
        push(sa + sb, np.where(both, lo, np.maximum(ia, ib)))
    # pointer jumping: every item's root (= its part's id) in O(log n) vectorised rounds
    while True:
        nxt = parent[parent]
        if np.array_equal(nxt, parent):
            break
        parent = nxt
    ids = heap[0][3]
    by_root: dict[int, list[int]] = {int(r): [] for r in ids if r >= 0}
    for i, r in enumerate(parent.tolist()):
        by_root[r].append(i)
    return _finish([by_root[int(r)] if r >= 0 else [] for r in ids])


def lpt(lengths: Sequence[int], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Longest-processing-time greedy: each item, longest first, goes to the lightest open part."""
    n = len(lengths)
    _check_k(n, k, equal_size)
    cap = n // k if equal_size else n
    heap = [(0, j) for j in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        s, j = heapq.heappop(heap)
        parts[j].append(i)
        if len(parts[j]) < cap:  # a full part leaves the heap for good
            heapq.heappush(heap, (s + lengths[i], j))
    return _finish(parts)


def part_sums(lengths: Sequence[int], parts: list[list[int]]) -> list[int]:
    return [sum(lengths[i] for i in p) for p in parts]


def imbalance(lengths: Sequence[int], parts: list[list[int]]) -> int:
    """max - min part sum (0 is perfect balance)."""
    sums = part_sums(lengths, parts)
    return max(sums) - min(sums)


def balance_across_dp(lengths: Sequence[int], dp: int, *, equal_size: bool = True) -> list[list[int]]:
    """Assign sequences to `dp` ranks with balanced total tokens (and equal counts when
    equal_size, which collectives over per-sample tensors need). Returns dp lists of indices."""
    parts = karmarkar_karp(lengths, dp, equal_size=equal_size)
    ref = lpt(lengths, dp, equal_size=equal_size)
    # KK is better on almost every input; keep whichever is better so the result is never worse than LPT
    return ref if imbalance(lengths, ref) < imbalance(lengths, parts) else parts


def _first_fit_decreasing(lengths: Sequence[int], idx: list[int], max_tokens: int) -> list[list[int]]:
    bins: list[list[int]] = []
    sums: list[int] = []
    for i in sorted(idx, key=lambda i: (-lengths[i], i)):
        for j, s in enumerate(sums):
            if s + lengths[i] <= max_tokens:
                bins[j].append(i)
                sums[j] += lengths[i]
                break
        else:
            bins.append([i])
            sums.append(lengths[i])
    return bins


def micro_batches_by_tokens(lengths: Sequence[int], *, max_tokens: int, min_count: int = 1) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most `max_tokens` total tokens each.

    The count is the smallest k (from ceil(total / max_tokens) up) for which a balanced k-way
    partition (Karmarkar-Karp, then LPT) fits the budget, never more than first-fit-decreasing
    needs; within that count the token sums are balanced. A sequence longer than max_tokens gets a
    micro-batch of its own (with a warning), never dropped. `min_count` forces at least that many
    micro-batches (e.g. the max over DP ranks, so every rank runs the same number of steps).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 (got {max_tokens})")
    n = len(lengths)
    if min_count > n:
        raise ValueError(f"min_count({min_count}) > number of sequences({n}): cannot make non-empty micro-batches")
    over = [i for i in range(n) if lengths[i] > max_tokens]
    if over:
        warnings.warn(f"{len(over)} sequence(s) longer than max_tokens={max_tokens} (longest "
                      f"{max(lengths[i] for i in over)}) each get their own micro-batch; raise the token budget "
                      "to pack them", stacklevel=2)
    rest = [i for i in range(n) if lengths[i] <= max_tokens]
    sub = [lengths[i] for i in rest]
    want = max(min_count - len(over), 1 if rest else 0)
    k = max(math.ceil(sum(sub) / max_tokens), want)
    chosen: list[list[int]] | None = None
    ffd: list[list[int]] | None = None
    while rest and chosen is None:
        if ffd is None and k >= max(math.ceil(sum(sub) / max_tokens), want) + 2:
            # the balanced methods missed twice: first-fit-decreasing bounds the count from above
            ffd = _first_fit_decreasing(lengths, rest, max_tokens)
        if ffd is not None and k > max(len(ffd), want):
            chosen = ffd
            # more micro-batches requested than FFD made: split the fullest bins (never breaks the budget)
            while len(chosen) < want:
                chosen.sort(key=lambda p: (-len(p), p))
                big = sorted(chosen.pop(0))
                chosen += [big[: len(big) // 2], big[len(big) // 2:]]
            break
        for method in (karmarkar_karp, lpt):
            parts = method(sub, k)
            if max(part_sums(sub, parts)) <= max_tokens and all(parts):
                chosen = [[rest[j] for j in p] for p in parts]
                break
        k += 1
    return _finish((chosen or []) + [[i] for i in over])


def plan_micro_batches(lengths: Sequence[int], *, dp: int, rank: int, max_tokens: int, mini_batch_size: int = 0,
                       fixed_count: int | None = None) -> list[list[list[int]]]:
    """DP rank `rank`'s mini-batches, each a list of micro-batches (indices into `lengths`).

    The one planner of every DP-sharded pass (log-prob recompute, values, scores, updates). Every
    rank holds all lengths and computes the same global partition (pure, deterministic, no
    communication), so all DP ranks agree on the number of micro-batches of each mini-batch: FSDP
    runs collectives per micro-batch and unequal counts would hang. Balanced tokens and equal counts
    per rank (balance_across_dp), cut into mini-batches of mini_batch_size // dp units per rank
    (0: one mini-batch), then token-budget micro-batches (min_count = the largest count over the
    ranks), or exactly `fixed_count` balanced ones when a pipeline schedule fixes the count.
    """
    if not lengths or len(lengths) % dp:
        raise ValueError(f"{len(lengths)} samples do not split evenly over dp={dp}")
    shards = balance_across_dp(lengths, dp, equal_size=True)
    per_rank = max(1, mini_batch_size // dp) if mini_batch_size else len(shards[0])
    out = []
    for start in range(0, len(shards[0]), per_rank):
        minis = [s[start:start + per_rank] for s in shards]
        mine = minis[rank]
        if fixed_count is not None:
            if len(mine) < fixed_count:
                raise ValueError(f"a mini-batch of {len(mine)} units per DP rank cannot fill {fixed_count} "
                                 "pipeline micro-batches; raise the mini-batch size")
            parts = karmarkar_karp([lengths[i] for i in mine], fixed_count)
        else:
            natural = [micro_batches_by_tokens([lengths[i] for i in m], max_tokens=max_tokens) for m in minis]
            count = max(map(len, natural))
            # this rank's own partition already has the common count (always at dp = 1): it is the plan
            parts = natural[rank] if len(natural[rank]) == count else micro_batches_by_tokens(
                [lengths[i] for i in mine], max_tokens=max_tokens, min_count=count)
        out.append([[mine[j] for j in p] for p in parts])
    return out
