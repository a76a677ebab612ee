"""Token-budget micro-batching, balanced partitioning and sequence packing.

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
from dataclasses import dataclass

import numpy as np
import torch

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
            count = max(len(micro_batches_by_tokens([lengths[i] for i in m], max_tokens=max_tokens)) for m in minis)
            parts = micro_batches_by_tokens([lengths[i] for i in mine], max_tokens=max_tokens, min_count=count)
        out.append([[mine[j] for j in p] for p in parts])
    return out


# ---------------------------------------------------------------- packing


@dataclass(slots=True)
class PackedBatch:
    """B sequences concatenated into one row of T tokens (T >= sum of lengths when padded).

    input_ids, position_ids, labels: [1, T]; position ids restart at 0 per sequence (and for the
    padding tail) so `models.llama.DocumentAttention(position_ids)` keeps documents apart. labels[t]
    is the next token of the same sequence (pad_id at each sequence's last token), so
    `logprobs_from_logits(logits, labels)[t]` is log p(token t+1). cu_seqlens [B+1] int32 are the
    sequence boundaries (flash-attention varlen convention). When `prompt_lens` were given,
    response_index / response_mask [B, R] locate each response token's log-prob position.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lens: list[int]
    max_seqlen: int
    num_pad: int
    response_index: torch.Tensor | None = None
    response_mask: torch.Tensor | None = None
    response_tokens: torch.Tensor | None = None  # [B, R] the response token ids (0 past each end)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def pack(sequences: Sequence[torch.Tensor | Sequence[int]], *, pad_id: int, prompt_lens: Sequence[int] | None = None,
         pad_to_multiple: int = 1, device: torch.device | str | None = None,
         share_prompts: bool = False) -> PackedBatch:
    """Concatenate 1-D token sequences into a PackedBatch.

    sequences: B tensors/lists of shape [L_i] (prompt + response). prompt_lens: B ints; response i
    is sequence i after its first prompt_lens[i] tokens (prompt_lens[i] >= 1, since the first
    token has no log-prob). pad_to_multiple pads T up (CUDA-graph / sequence-parallel friendly).

    share_prompts=True (needs prompt_lens): consecutive sequences with the same prompt keep it once.
    The first is packed whole; each next one adds only its response, with positions continuing from
    the prompt length, so models.llama.DocumentAttention lets it see the shared prompt (a GRPO group
    of n samples costs P + sum(R_i) tokens instead of n P + sum(R_i)). Per-position `labels` then
    cannot hold every response's first token (they share one predicting position): score with
    response_index / response_tokens (`gather_response_logprobs`); cu_seqlens / seq_lens describe
    the packed segments rather than the sequences.
    """
    if not sequences:
        raise ValueError("pack() needs at least one sequence")
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
    if device is None:
        device = seqs[0].device
    if share_prompts:
        if prompt_lens is None:
            raise ValueError("pack(share_prompts=True) needs prompt_lens")
        return _pack_shared(seqs, pad_id=pad_id, prompt_lens=list(prompt_lens), pad_to_multiple=pad_to_multiple,
                            device=device)
    lens = [int(s.numel()) for s in seqs]
    if min(lens) < 1:
        raise ValueError(f"pack() got an empty sequence (lengths {lens})")
    total = sum(lens)
    t = -(-total // pad_to_multiple) * pad_to_multiple
    num_pad = t - total
    ids = torch.cat([s.to("cpu") for s in seqs] + [torch.full((num_pad,), pad_id, dtype=torch.long)])
    pos = torch.cat([torch.arange(n) for n in lens] + [torch.arange(num_pad)])
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    labels = torch.roll(ids, -1)
    labels[cu[1:].long() - 1] = pad_id  # a sequence's last token has no next token in its document
    labels[total:] = pad_id
    resp_idx = resp_mask = resp_tok = None
    if prompt_lens is not None:
        if len(prompt_lens) != len(lens):
            raise ValueError(f"prompt_lens has {len(prompt_lens)} entries for {len(lens)} sequences")
        bad = [i for i, (p, n) in enumerate(zip(prompt_lens, lens)) if not 1 <= p <= n]
        if bad:
            i = bad[0]
            raise ValueError(f"sequence {i}: prompt_len {prompt_lens[i]} must be in [1, length {lens[i]}]")
        r_lens = [n - p for n, p in zip(lens, prompt_lens)]
        r = max(max(r_lens), 1)
        j = torch.arange(r)
        # response token j of sequence i sits at cu[i] + p_i + j and is predicted at the position before
        start = cu[:-1].long() + torch.tensor(prompt_lens, dtype=torch.long) - 1
        resp_mask = j[None] < torch.tensor(r_lens)[:, None]
        resp_idx = torch.where(resp_mask, start[:, None] + j[None], torch.zeros((), dtype=torch.long))
        resp_tok = torch.where(resp_mask, labels[resp_idx], torch.zeros((), dtype=torch.long))
        resp_idx, resp_mask, resp_tok = resp_idx.to(device), resp_mask.to(device), resp_tok.to(device)
    return PackedBatch(
        input_ids=ids[None].to(device), position_ids=pos[None].to(device), labels=labels[None].to(device),
        cu_seqlens=cu.to(device), seq_lens=lens, max_seqlen=max(lens), num_pad=num_pad,
        response_index=resp_idx, response_mask=resp_mask, response_tokens=resp_tok,
    )


def prompt_groups(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Runs of consecutive indices whose prompts are identical (a GRPO group's n samples)."""
    groups: list[list[int]] = []
    for i, p in enumerate(prompts):
        if groups and list(prompts[groups[-1][0]]) == list(p):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _pack_shared(seqs: list[torch.Tensor], *, pad_id: int, prompt_lens: list[int], pad_to_multiple: int,
                 device) -> PackedBatch:
    if len(prompt_lens) != len(seqs):
        raise ValueError(f"prompt_lens has {len(prompt_lens)} entries for {len(seqs)} sequences")
    bad = [i for i, (p, s) in enumerate(zip(prompt_lens, seqs)) if not 1 <= p <= s.numel()]
    if bad:
        raise ValueError(f"sequence {bad[0]}: prompt_len {prompt_lens[bad[0]]} must be in [1, length "
                         f"{seqs[bad[0]].numel()}]")
    groups = prompt_groups([s[:p].tolist() for s, p in zip(seqs, prompt_lens)])
    ids, pos, seg_lens = [], [], []
    r_lens = [s.numel() - p for s, p in zip(seqs, prompt_lens)]
    r = max(max(r_lens), 1)
    resp_idx = torch.zeros(len(seqs), r, dtype=torch.long)
    resp_tok = torch.zeros(len(seqs), r, dtype=torch.long)
    at = 0
    for g in groups:
        p = prompt_lens[g[0]]
        last_prompt = at + p - 1  # predicts every member's first response token
        for k, i in enumerate(g):
            part = seqs[i] if k == 0 else seqs[i][p:]
            ids.append(part)
            pos.append(torch.arange(part.numel()) + (0 if k == 0 else p))
            seg_lens.append(part.numel())
            first = at + (p if k == 0 else 0)  # where this member's response starts in the row
            n = r_lens[i]
            if n:
                resp_idx[i, 0] = last_prompt
                resp_idx[i, 1:n] = torch.arange(first, first + n - 1)
                resp_tok[i, :n] = seqs[i][p:]
            at += part.numel()
    total = at
    t = -(-total // pad_to_multiple) * pad_to_multiple
    num_pad = t - total
    ids = torch.cat(ids + [torch.full((num_pad,), pad_id, dtype=torch.long)])
    pos = torch.cat(pos + [torch.arange(num_pad)])
    cu = torch.zeros(len(seg_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seg_lens), 0)
    # next token within each segment (the shared prompt's last label is its first member's token)
    labels = torch.roll(ids, -1)
    labels[cu[1:].long() - 1] = pad_id
    labels[total:] = pad_id
    resp_mask = torch.arange(r)[None] < torch.tensor(r_lens)[:, None]
    return PackedBatch(
        input_ids=ids[None].to(device), position_ids=pos[None].to(device), labels=labels[None].to(device),
        cu_seqlens=cu.to(device), seq_lens=seg_lens, max_seqlen=max(seg_lens), num_pad=num_pad,
        response_index=resp_idx.to(device), response_mask=resp_mask.to(device), response_tokens=resp_tok.to(device))


def gather_response_logprobs(hidden: torch.Tensor, packed: PackedBatch, token_logprobs) -> tuple:
    """Score only the response tokens: hidden [T, H] at each response token's predicting position ->
    token_logprobs(hidden_sel [N, H], labels [N]) -> (logp [N], entropy [N] | None) -> [B, R] each
    (0 past each end). Works for shared-prompt packs (where per-position labels cannot) and skips the
    LM head on prompt tokens. Differentiable."""
    if packed.response_index is None or packed.response_tokens is None:
        raise ValueError("gather_response_logprobs needs pack(..., prompt_lens=...)")
    m = packed.response_mask
    logp, ent = token_logprobs(hidden[packed.response_index[m]], packed.response_tokens[m])

    def spread(x):
        return None if x is None else x.new_zeros(m.shape).masked_scatter(m, x)

    return spread(logp), spread(ent)


def _flat(per_token: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """[1, T, ...] or [T, ...] -> [T, ...]."""
    if per_token.dim() >= 2 and per_token.shape[0] == 1 and per_token.shape[1] == packed.num_tokens:
        return per_token[0]
    if per_token.shape[0] != packed.num_tokens:
        raise ValueError(f"per-token tensor of shape {tuple(per_token.shape)} does not match the packed length "
                         f"{packed.num_tokens}")
    return per_token


def unpack(per_token: torch.Tensor, packed: PackedBatch) -> list[torch.Tensor]:
    """[1, T, ...] per-token outputs -> B tensors [L_i, ...] (padding tail dropped)."""
    x = _flat(per_token, packed)
    return list(torch.split(x[: sum(packed.seq_lens)], packed.seq_lens))


def unpack_responses(per_token: torch.Tensor, packed: PackedBatch, *, pad_value: float = 0.0) -> torch.Tensor:
    """Per-token outputs at the *predicting* positions -> response-aligned [B, R, ...].

    per_token: [1, T, ...] (e.g. log-probs of `packed.labels`, entropies, values). Entry [i, j] is
    the output for response token j of sequence i; positions past a response end hold pad_value.
    Differentiable (a gather).
    """
    if packed.response_index is None:
        raise ValueError("unpack_responses needs pack(..., prompt_lens=...) to know where responses start")
    x = _flat(per_token, packed)
    out = x[packed.response_index]  # [B, R, ...]
    m = packed.response_mask.view(*packed.response_mask.shape, *([1] * (out.dim() - 2)))
    return torch.where(m, out, torch.full_like(out, pad_value))


def responses_to_packed(x: torch.Tensor, packed: PackedBatch, *, fill: float = 0.0) -> torch.Tensor:
    """Inverse of unpack_responses: [B, R] response-aligned values -> [1, T] at the predicting
    positions (fill elsewhere); e.g. advantages for a loss computed on the packed row."""
    if packed.response_index is None:
        raise ValueError("responses_to_packed needs pack(..., prompt_lens=...)")
    out = torch.full((packed.num_tokens,), fill, dtype=x.dtype, device=x.device)
    m = packed.response_mask
    out[packed.response_index[m]] = x[m]
    return out[None]
