"""Which decode rows share a prompt's KV, as the tables the Triton decode kernels read.

The n samples of a prompt admitted in one prefill row have bit-identical K/V at positions
[0, prompt_len) in each of their slots (one prefill computed it; write_prefill copied it). Decode
attention that reads those positions once per group instead of once per row saves, at GRPO's n = 8,
7/8 of the prompt's share of the KV traffic (rollout/triton_attention.py, `_prompt_program`).

    row_prefix, row_entry, members, group_len = shared_prefix_tables([(128, [0, 1, 2, 3]), (96, [4, 5])],
                                                                     rows=8, members_per_entry=8)
    # row_prefix [8] = 128 x4, 96 x2, 0 x2; row_entry [8] = 0 x4, 1 x2, -1 x2;
    # members [4, 8] = [0,1,2,3,-1..], [4,5,-1..], -1...; group_len [4] = 128, 96, 0, 0
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

# query rows one prefix-kernel program attends together (members x query heads per KV head): a tensor-core
# tile's height; more would raise register pressure ([rows, head_dim] fp32 accumulator) for no extra reuse
PREFIX_QUERY_ROWS = 32


MIN_MEMBERS = 4  # splitting a group into parts of at most M >= 4 rows leaves every part at least 2 rows


def members_per_entry(group_size: int) -> int:
    """Rows per table entry for G query heads per KV head (0: too many query heads to share a tile)."""
    m = PREFIX_QUERY_ROWS // group_size
    return m if m >= MIN_MEMBERS else 0


def members_for(groups: Iterable[tuple[int, Sequence[int]]], *, cap: int) -> int:
    """Rows per table entry for these groups: the smallest power of two (>= MIN_MEMBERS) that holds the
    largest group, at most `cap` (members_per_entry's). A prompt program's tile (members x query heads per
    KV head rows) is then no taller than the groups need: GRPO's 8 samples x 2 query heads fill 16 query
    rows, where the cap's 16 members made a 32-row tile half padding. On an H200, 256 rows of llama-1b heads
    in groups of 8 then took 28.7 / 47.3 / 79.6 us per layer against 31.2 / 48.7 / 80.8 at contexts 160 / 256
    / 384 (bench/results/decode_attention_members_h200.json)."""
    largest = max((len(slots) for _, slots in groups), default=0)
    return min(cap, max(MIN_MEMBERS, 1 << max(0, largest - 1).bit_length()))


def member_widths(cap: int) -> list[int]:
    """Every width members_for can return under `cap`."""
    return sorted({min(cap, MIN_MEMBERS << i) for i in range(max(1, cap.bit_length()))})


def table_entries(rows: int) -> int:
    """Table entries for a decode batch of `rows` rows: every shared group has at least two rows."""
    return max(1, rows // 2)


def shared_prefix_tables(groups: Iterable[tuple[int, Sequence[int]]], *, rows: int,
                         members_per_entry: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """groups: (prompt length, rows/slots sharing it), rows < `rows`. Returns CPU int32 tensors
    row_prefix [rows] (0: the row reads its whole history itself), row_entry [rows] (the row's table entry;
    -1: none), members [table_entries(rows), M] (-1 padded; the first member's slot is the one read) and
    group_len [table_entries(rows)] (0: unused).
    A group of one row or an empty prompt is not shared; a group of more than M rows is split into
    near-equal parts, each of at least two rows (each part reads the prompt once)."""
    if members_per_entry < MIN_MEMBERS:
        raise ValueError(f"members_per_entry={members_per_entry} < {MIN_MEMBERS}: parts of a split group could "
                         f"have one row, and the table could overflow")
    entries = table_entries(rows)
    row_prefix = torch.zeros(rows, dtype=torch.int32)
    row_entry = torch.full((rows,), -1, dtype=torch.int32)
    members = torch.full((entries, members_per_entry), -1, dtype=torch.int32)
    group_len = torch.zeros(entries, dtype=torch.int32)
    at = 0
    for plen, slots in groups:
        if plen <= 0 or len(slots) < 2:
            continue
        if max(slots) >= rows:
            raise ValueError(f"group rows {list(slots)} reach past the batch of {rows} rows")
        parts = -(-len(slots) // members_per_entry)
        for k in range(parts):
            part = slots[k * len(slots) // parts: (k + 1) * len(slots) // parts]
            members[at, : len(part)] = torch.tensor(part, dtype=torch.int32)
            row_entry[list(part)] = at
            group_len[at] = plen
            at += 1
        row_prefix[list(slots)] = plen
    return row_prefix, row_entry, members, group_len
