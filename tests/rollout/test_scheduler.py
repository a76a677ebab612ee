"""rollout/scheduler.py: pure-Python admission, buckets, compaction and finishing."""

import pytest

from rollout.base import SamplingParams, check_request
from rollout.scheduler import DecodeBatch, PrefillBatch, Scheduler, Sequence, batch_buckets, length_bucket


def _sched(num_slots=4, budget=64, max_model_len=64, eos=(2,)):
    return Scheduler(num_slots=num_slots, max_num_batched_tokens=budget, max_model_len=max_model_len, granule=16,
                     slot_len=64, eos_token_ids=list(eos))


def _seq(i, prompt_index, prompt_len, **params):
    return Sequence(i, prompt_index, 0, [1] * prompt_len, SamplingParams(**params), key=i)


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(2) == [2] and batch_buckets(5) == [2, 4, 5]  # no one-row bucket: see batch_buckets
    assert batch_buckets(256)[:8] == [2, 4, 8, 16, 32, 64, 96, 128] and batch_buckets(256)[-1] == 256
    for n in range(1, 5000):
        b = length_bucket(n, granule=64, cap=1 << 20)
        assert b >= n and b % 64 == 0 and (b - n < 64 or b - n <= n / 8)
    assert length_bucket(5000, granule=64, cap=4096) == 4096
    assert len({length_bucket(n, granule=64, cap=4096) for n in range(1, 4097)}) < 40


def test_admission_shares_rows_respects_slots_and_budget():
    s = _sched(num_slots=4, budget=20)
    for i in range(3):  # three samples of prompt 0 (length 8) share one row
        s.add(Sequence(i, 0, i, [1] * 8, SamplingParams(), key=i))
    s.add(_seq(3, 1, 8))
    s.add(_seq(4, 2, 4))
    step = s.schedule()
    assert isinstance(step, PrefillBatch)
    assert [[q.seq_id for q in row] for row in step.rows] == [[0, 1, 2], [3]] and step.padded_len == 8
    assert [q.slot for q in step.seqs] == [0, 1, 2, 3]  # lowest slots first
    assert list(s.waiting)[0].seq_id == 4  # no free slot left
    step = s.schedule()
    assert isinstance(step, DecodeBatch) and step.num_rows == 4 and step.kv_len == 16


def test_budget_counts_padded_tokens_and_first_row_always_fits():
    s = _sched(num_slots=8, budget=10)
    s.add(_seq(0, 0, 30))
    s.add(_seq(1, 1, 2))
    step = s.schedule()
    assert [q.seq_id for q in step.seqs] == [0] and step.padded_len == 30
    assert [q.seq_id for q in s.schedule().seqs] == [1]


def test_finish_reasons_free_slots_and_compaction():
    s = _sched(num_slots=4, max_model_len=12)
    seqs = [_seq(0, 0, 4, max_tokens=3), _seq(1, 1, 4, stop_token_ids=[9]), _seq(2, 2, 4),
            _seq(3, 3, 10, max_tokens=100), _seq(4, 4, 4, ignore_eos=True, max_tokens=50)]
    for q in seqs:
        s.add(q)
    step = s.schedule()
    assert len(step.seqs) == 4
    assert s.update(step.seqs, [5, 9, 2, 5], [-1.0] * 4) == seqs[1:3]  # stop token, eos
    assert seqs[1].finish_reason == "stop" and seqs[2].finish_reason == "stop"
    step = s.schedule()  # seq 4 takes the lowest freed slot
    assert step.seqs == [seqs[4]] and seqs[4].slot == 1
    assert s.update(step.seqs, [2], [-0.5]) == []  # ignore_eos
    step = s.schedule()
    assert isinstance(step, DecodeBatch) and [q.slot for q in step.seqs] == [0, 1, 3]
    done = s.update(step.seqs, [5, 5, 5], [-1.0] * 3)
    assert done == [seqs[3]] and seqs[3].finish_reason == "length"  # 10 + 2 tokens == max_model_len
    done = s.update([seqs[0], seqs[4]], [5, 5], [-1.0] * 2)
    assert done == [seqs[0]] and seqs[0].finish_reason == "length" and len(seqs[0].token_ids) == 3
    # only seq 4 in slot 1 left: the smallest bucket (2 rows) covers it, nothing to compact
    assert s.schedule().num_rows == 2 and not s.needs_compaction() and s.compaction() == []


def test_schedule_without_work_raises():
    with pytest.raises(RuntimeError, match="no work"):
        _sched().schedule()


def test_check_request_messages():
    ok = SamplingParams()
    assert check_request([1, 2], ok, max_model_len=8, vocab_size=10) is None
    assert "empty" in check_request([], ok, max_model_len=8, vocab_size=10)
    assert "max_model_len=8" in check_request([1] * 8, ok, max_model_len=8, vocab_size=10)
    assert "vocabulary" in check_request([10], ok, max_model_len=8, vocab_size=10)
    assert "temperature" in check_request([1], SamplingParams(temperature=float("nan")), max_model_len=8,
                                          vocab_size=10)


def test_pipelining_helpers():
    s = _sched(num_slots=4, max_model_len=20)
    a, c, b = _seq(0, 0, 4, max_tokens=2), _seq(2, 2, 4, max_tokens=2), _seq(1, 1, 17, max_tokens=50)
    for q in (a, c, b):
        s.add(q)
    s.update(s.schedule().seqs, [5, 5, 5], [0.0] * 3)  # a, c: 1 of 2 tokens, b: length 18 of 20
    assert s.surely_finishes_next(a) and not s.surely_finishes_next(b)
    s.update([b], [5], [0.0])
    assert s.surely_finishes_next(b)  # length 19: the next token reaches max_model_len
    step = s.decode_batch([a, c, b], lookahead=1)
    assert step.num_rows == 4 and step.kv_len == 32  # slot 2 -> bucket 4; 19 + 1 in flight -> granule 16
    assert not s.can_admit() and not s.needs_compaction()
    s.update([a, c], [5, 5], [0.0] * 2)  # a and c finish: b alone in slot 2, past the smallest bucket (2)
    assert s.needs_compaction() and s.compaction() == [(2, 0)] and s.decode_batch([b], lookahead=1).num_rows == 2


def test_admissions_are_batched():
    s = Scheduler(num_slots=8, max_num_batched_tokens=64, max_model_len=64, granule=16, slot_len=64,
                  eos_token_ids=[2], min_admit=3)
    for i in range(12):
        s.add(_seq(i, i, 2, stop_token_ids=[9]))
    assert len(s.schedule().seqs) == 8  # nothing running: admit whatever fits
    running = sorted(s.running.values(), key=lambda q: q.slot)
    s.update(running[:2], [9, 9], [0.0, 0.0])  # two finish: 2 free < 3 -> keep decoding
    assert not s.can_admit() and isinstance(s.schedule(), DecodeBatch)
    s.update(running[2:3], [9], [0.0])  # a third: admit three at once
    step = s.schedule()
    assert isinstance(step, PrefillBatch) and len(step.seqs) == 3
    s.update(running[3:4], [9], [0.0])  # one slot free and exactly one waiting: admit it
    assert [q.seq_id for q in s.schedule().seqs] == [11]



def test_continuations_are_admitted_in_waves():
    # returning agent turns (kept KV: their slot held) share a prefill: once min_admit of them wait, or once the
    # oldest has waited continuation_wait steps; not one prefill (and a stalled decode batch) per returning turn
    s = Scheduler(num_slots=8, max_num_batched_tokens=256, max_model_len=64, granule=16, slot_len=64,
                  eos_token_ids=[2], min_admit=3, continuation_wait=2)
    long = [_seq(i, i, 2, max_tokens=30) for i in range(5)]
    turns = [_seq(5 + i, 5 + i, 2, max_tokens=1) for i in range(3)]
    for seq in long + turns:
        seq.session = seq.seq_id
        s.add(seq)
    step = s.schedule()
    assert len(s.update(step.seqs, [5] * 8, [0.0] * 8)) == 3 and len(s.parked) == 3  # the turns end, parked
    ids = iter(range(100, 200))

    def back(parked):  # the next turn of a parked sequence, continuing in its slot
        assert s.unpark(parked)
        seq = _seq(next(ids), parked.prompt_index, 4, max_tokens=1)
        seq.slot, seq.cached, seq.session = parked.slot, 2, parked.session
        s.add(seq)
        return seq

    first = [back(p) for p in list(s.parked.values())]  # three return at once: min_admit -> one prefill
    step = s.schedule()
    assert isinstance(step, PrefillBatch) and {q.seq_id for q in step.seqs} == {q.seq_id for q in first}
    s.update(step.seqs, [5] * 3, [0.0] * 3)  # parked again
    parked = list(s.parked.values())
    back(parked[0])
    assert not s.can_admit() and isinstance(s.schedule(), DecodeBatch)  # one waits: the decode batch runs on
    s.update(long, [5] * 5, [0.0] * 5)
    back(parked[1])
    assert not s.can_admit()  # two wait, the first for one step
    s.update(long, [5] * 5, [0.0] * 5)
    step = s.schedule()  # the first has waited two steps: both in one prefill
    assert isinstance(step, PrefillBatch) and len(step.seqs) == 2 and s.can_admit() is False


def test_park_slots_keep_sessions_that_outnumber_the_decode_slots():
    # 2 decode slots, 2 park slots: a waiting sequence takes the slot of the least recently parked session, whose KV
    # is copied to a park slot (a relocation the engine runs before the prefill), not evicted; its next turn comes
    # back to a free decode slot (another relocation); with the park slots full the next one is evicted
    s = Scheduler(num_slots=2, max_num_batched_tokens=256, max_model_len=64, granule=16, slot_len=64,
                  eos_token_ids=[2], park_slots=2)
    evicted = []
    s.on_evict = evicted.append
    assert s.buckets == [2]  # the decode batch never covers park slots
    turns = [_seq(i, i, 3, max_tokens=1) for i in range(5)]
    for seq in turns:
        seq.session = seq.seq_id

    def run(*seqs):
        for seq in seqs:
            s.add(seq)
        step = s.schedule()
        assert isinstance(step, PrefillBatch) and {q.seq_id for q in step.seqs} == {q.seq_id for q in seqs}
        s.update(step.seqs, [5] * len(seqs), [0.0] * len(seqs))  # each turn ends at once: parked

    run(turns[0], turns[1])
    assert sorted(s.parked) == [0, 1] and s.relocations == []
    run(turns[2])  # slot 0 (parked first) is copied to park slot 2: 4 positions (prompt and its token)
    assert s.relocations == [(0, 2, 4)] and turns[0].slot == 2 and turns[2].slot == 0
    assert s.is_parked(turns[0]) and s.has_parked() and not evicted
    s.relocations.clear()
    run(turns[3])
    assert s.relocations == [(1, 3, 4)] and sorted(s.stored) == [2, 3]
    s.relocations.clear()
    run(turns[4])  # the park slots are full: the least recently parked in a decode slot (turn 2) is evicted
    assert evicted == [turns[2]] and turns[2].slot == -1 and s.relocations == []
    # turn 0's next turn waits in park slot 2 and needs a decode slot, as a fresh sequence does: it takes the one of
    # the least recently parked (turn 3), which moves into the park slot turn 0 leaves (a swap through the spare
    # slot 4); the fresh sequence then takes turn 4's decode slot, and with no park slot free turn 4 is evicted
    assert s.unpark(turns[0])
    nxt = _seq(10, 0, 6, max_tokens=1)
    nxt.slot, nxt.cached, nxt.session = turns[0].slot, 4, 0
    fresh = _seq(11, 11, 2, max_tokens=1)
    s.add(nxt)
    s.add(fresh)
    assert list(s.waiting) == [nxt, fresh]  # a continuation in a park slot queues as a fresh sequence does
    assert s.can_admit()
    step = s.schedule()
    assert [q.seq_id for q in step.seqs] == [10, 11] and nxt.slot == 1 and fresh.slot == 0
    assert s.relocations == [(2, 4, 4), (1, 2, 4), (4, 1, 4)] and turns[3].slot == 2 and s.is_parked(turns[3])
    assert evicted == [turns[2], turns[4]] and not s._park_free
    s.update(step.seqs, [5, 5], [0.0] * 2)
    assert s.is_parked(nxt) and s.unpark(turns[3]) and s.free_slot(2) is None and s._park_free == [2]


def test_without_eviction_for_new_sequences_they_wait_while_others_run():
    # evict_parked_for_new=False: with every decode and park slot held, a new sequence does not take a parked
    # session's slot while another sequence runs (it would evict that session's KV); a returning continuation behind it
    # still goes in (it swaps with a parked one); once nothing runs the new one evicts (an idle engine admits)
    s = Scheduler(num_slots=2, max_num_batched_tokens=256, max_model_len=64, granule=16, slot_len=64,
                  eos_token_ids=[2], park_slots=1, evict_parked_for_new=False)
    evicted = []
    s.on_evict = evicted.append
    first = [_seq(i, i, 3, max_tokens=1) for i in range(3)]
    for q in first:
        q.session = q.seq_id
    for q in first[:2]:
        s.add(q)
    step = s.schedule()
    s.update(step.seqs, [5, 5], [0.0, 0.0])  # both parked in decode slots 0 and 1
    s.add(first[2])
    step = s.schedule()  # slot 0's session moves to the park slot 2
    assert [q.seq_id for q in step.seqs] == [2] and s.relocations == [(0, 2, 4)] and not evicted
    s.relocations.clear()
    new = _seq(20, 20, 2, max_tokens=5)
    s.add(new)
    assert not s.can_admit()  # sequence 2 runs; the only parked decode slot would evict sequence 1
    assert isinstance(s.schedule(), DecodeBatch) and new.slot == -1 and not evicted
    assert s.unpark(first[0])  # session 0's next turn, in park slot 2, arrives behind the new sequence
    nxt = _seq(10, 0, 6, max_tokens=1)
    nxt.slot, nxt.cached, nxt.session = first[0].slot, 4, 0
    s.add(nxt)
    step = s.schedule()
    assert [q.seq_id for q in step.seqs] == [10] and list(s.waiting) == [new] and not evicted  # a swap, no eviction
    s.update(step.seqs, [5], [0.0])
    s.update([first[2]], [2], [0.0])  # sequence 2 ends (EOS): nothing runs now
    assert not s.running and s.can_admit()
    assert [q.seq_id for q in s.schedule().seqs] == [20] and len(evicted) == 1


def test_a_continuation_waiting_in_a_park_slot_can_be_released_or_parked_again():
    # the queue: continuations holding a decode slot, then in arrival order those whose KV waits in a park slot and
    # fresh ones
    s = Scheduler(num_slots=2, max_num_batched_tokens=256, max_model_len=64, granule=16, slot_len=64,
                  eos_token_ids=[2], park_slots=2)
    first = [_seq(i, i, 3, max_tokens=1) for i in range(3)]
    for seq in first:
        seq.session = seq.seq_id
        s.add(seq)
    s.update(s.schedule().seqs, [5, 5], [0.0] * 2)  # two run and park; the third waits for a slot
    s.update(s.schedule().seqs, [5], [0.0])  # it takes slot 0: its parked owner moves to park slot 2
    assert first[0].slot == 2 and s.is_parked(first[0]) and s._park_free == [3]

    def turn(i, parked):  # the next turn of a parked sequence, its KV where the parked one left it
        assert s.unpark(parked)
        seq = _seq(i, parked.prompt_index, 6, max_tokens=1)
        seq.slot, seq.cached = parked.slot, 4
        s.add(seq)
        return seq

    fresh = _seq(10, 10, 2, max_tokens=1)
    s.add(fresh)
    returning = turn(11, first[0])  # in park slot 2
    holding = turn(12, first[1])  # still in decode slot 1
    assert list(s.waiting) == [holding, fresh, returning]  # fresh queued before the returning turn
    s.release(returning)  # dropped while waiting: its park slot is free again, the order kept
    assert sorted(s._park_free) == [2, 3] and list(s.waiting) == [holding, fresh]
    assert s.park_unfinished(holding) and s.is_parked(holding) and list(s.waiting) == [fresh]
    assert s._reserved == s._returning == 0
