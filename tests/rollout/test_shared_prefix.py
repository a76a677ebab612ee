"""The tables of decode rows that share a prompt's KV, and which rows the scheduler groups."""

import pytest
import torch

from rollout.base import SamplingParams
from rollout.scheduler import Scheduler, Sequence
from rollout.shared_prefix import members_for, members_per_entry, shared_prefix_tables, table_entries


def test_tables_list_each_group_once_and_leave_unshared_rows_at_zero():
    row_prefix, row_entry, members, group_len = shared_prefix_tables([(128, [0, 1, 2, 3]), (96, [6, 4]), (50, [5])],
                                                                     rows=8, members_per_entry=8)
    assert row_prefix.tolist() == [128, 128, 128, 128, 96, 0, 96, 0]  # a group of one row shares nothing
    assert row_entry.tolist() == [0, 0, 0, 0, 1, -1, 1, -1]
    assert members.shape == (table_entries(8), 8) == (4, 8)
    assert members[0].tolist() == [0, 1, 2, 3] + [-1] * 4 and members[1].tolist() == [6, 4] + [-1] * 6
    assert (members[2:] == -1).all() and group_len.tolist() == [128, 96, 0, 0]
    assert {t.dtype for t in (row_prefix, row_entry, members, group_len)} == {torch.int32}


def test_a_group_larger_than_an_entry_splits_into_parts_of_two_rows_or_more():
    for n in range(2, 40):
        _, row_entry, members, group_len = shared_prefix_tables([(7, list(range(n)))], rows=64, members_per_entry=4)
        parts = [[r for r in row if r >= 0] for row in members.tolist() if row[0] >= 0]
        assert sorted(r for p in parts for r in p) == list(range(n))
        assert all(row_entry[r] == e for e, p in enumerate(parts) for r in p) and (row_entry[n:] == -1).all()
        assert all(2 <= len(p) <= 4 for p in parts) and (group_len > 0).sum() == len(parts)
    # at most rows // 2 entries are ever used, so a decode of b rows passes the first (b + 1) // 2
    _, _, members, _ = shared_prefix_tables([(3, [0, 1, 2]), (3, [3, 4]), (3, [5, 6, 7, 8, 9])], rows=10,
                                            members_per_entry=4)
    assert (members[:, 0] >= 0).sum() <= 10 // 2


def test_members_per_entry_fills_a_tile_and_refuses_too_many_query_heads():
    assert [members_per_entry(g) for g in (1, 2, 4, 8, 16)] == [32, 16, 8, 4, 0]
    with pytest.raises(ValueError, match="members_per_entry=2"):
        shared_prefix_tables([(4, [0, 1])], rows=4, members_per_entry=2)
    with pytest.raises(ValueError, match="reach past"):
        shared_prefix_tables([(4, [0, 9])], rows=4, members_per_entry=8)


def test_members_for_is_the_smallest_power_of_two_tile_that_holds_the_largest_group():
    groups = lambda *sizes: [(16, list(range(n))) for n in sizes]  # noqa: E731
    assert members_for(groups(8, 8, 3), cap=16) == 8  # GRPO's n = 8: 16 query rows at 2 heads, not 32
    assert members_for(groups(5), cap=16) == 8 and members_for(groups(2, 3), cap=16) == 4  # at least 4
    assert members_for(groups(9), cap=16) == 16 and members_for(groups(40), cap=16) == 16  # then it splits
    assert members_for([], cap=16) == 4 and members_for(groups(8), cap=4) == 4


def test_scheduler_groups_the_samples_of_one_prefill_row_only():
    sched = Scheduler(num_slots=6, max_num_batched_tokens=1000, max_model_len=32, granule=8, slot_len=32,
                      eos_token_ids=[0])
    p = SamplingParams(max_tokens=4, n=3)
    seqs = [Sequence(i, i // 3, i % 3, [1, 2, 3, 4] if i < 3 else [5, 6], p, key=i) for i in range(6)]
    for s in seqs:
        sched.add(s)
    sched.schedule()  # one prefill: two rows
    assert Scheduler.shared_prompts(seqs) == [(4, [0, 1, 2]), (2, [3, 4, 5])]
    assert Scheduler.shared_prompts([seqs[0], seqs[3], seqs[4]]) == [(2, [3, 4])]  # a lone row shares nothing


def test_member_widths_hold_every_width_members_for_picks():
    from rollout.shared_prefix import member_widths, members_for

    for cap in (4, 8, 12, 16, 32):
        picked = {members_for([(9, list(range(n)))], cap=cap) for n in range(1, 3 * cap)}
        assert picked == set(member_widths(cap)), cap
