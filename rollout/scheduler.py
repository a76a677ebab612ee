"""The engine's brain, pure Python: sequences, KV-slot allocation, continuous-batching decisions.

Each running sequence owns one KV slot (a contiguous cache row of `slot_len` tokens, see
rollout/kv_cache.py). Every step is either a prefill (admit waiting sequences into free slots under
the token budget; samples of one prompt admitted together share one prefill row) or a decode over
cache rows [0, num_rows), where num_rows is a CUDA-graph batch bucket covering the highest busy slot.
New sequences take the lowest free slot, and when the tail of a generation leaves holes that inflate
the bucket, `compaction()` moves high sequences down so the decode batch shrinks with the work.

An admitted sequence can never run out of cache (its slot holds max_model_len tokens), so there is
no mid-decode preemption; when all slots are busy requests wait, and a request that needs more than
max_model_len tokens finishes with "length" exactly at that limit, never silently cut.

Parking (kept KV across an agent's turns): a finished sequence with a `session` keeps its slot instead of
freeing it, so a later request that extends its tokens (the engine's continuation) prefills only the new
tokens into the same slot. Parked slots never make a waiting sequence wait: admission counts them as free and
takes the least recently parked one when no slot is free. With park slots (slots past the decode rows, for more
sessions than decode at once) that parked sequence is relocated there (its KV copied: `relocations`, run by the
engine before the prefill) and comes back to a free decode slot when its next turn is admitted; without a free
park slot it is evicted (`on_evict`; the session then re-prefills).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from itertools import islice

from rollout.base import SamplingParams


@dataclass(slots=True)
class Sequence:
    seq_id: int
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams
    key: int  # RNG key (rollout/sampler.request_key)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    slot: int = -1
    finish_reason: str | None = None
    prefill_row: int = -1  # sequences admitted in one prefill row hold identical KV for their prompt
    routes: list = field(default_factory=list)  # a mixture of experts: [n, L_moe, k] expert ids of the tokens run
    session: Hashable | None = None  # park the slot when finished (kept KV); the engine's session key
    cached: int = 0  # tokens whose KV the slot already holds at admission (a continuation prefills the rest)
    kv_start: object = None  # a parked slot's KV at position 0, saved before padding rows overwrite it
    kept: list[int] | None = None  # parked: its tokens when it finished (the lists handed out may grow after)
    queued_at: int = 0  # Scheduler.steps when it was added (how long a waiting continuation has waited)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)


@dataclass(slots=True)
class PrefillBatch:
    rows: list[list[Sequence]]  # each row: sequences with identical tokens so far (samples of one prompt)
    padded_len: int  # longest row; rows are right-padded to it

    @property
    def seqs(self) -> list[Sequence]:
        return [s for row in self.rows for s in row]


@dataclass(slots=True)
class DecodeBatch:
    seqs: list[Sequence]  # running sequences, ascending slot
    num_rows: int  # cache rows [0, num_rows) are computed; rows without a sequence are padding
    kv_len: int  # attention reads cache positions [0, kv_len)


def batch_buckets(num_slots: int) -> list[int]:
    """Decode batch sizes that get a CUDA graph: 2, 4, 8, 16, 32, then every 32, and num_slots. No bucket of one
    row (unless there is one slot): under rollout.compile Dynamo specialises a size of 1, so a one-row decode
    would compile the whole model a second time in the middle of a run (~20-60 s on a GPU, seen in the partial
    rollouts' tails); one padding row costs nothing measurable at decode sizes."""
    sizes = {b for b in (2, 4, 8, 16, 32) if b < num_slots}
    sizes.update(range(64, num_slots, 32))
    sizes.add(num_slots)
    return sorted(sizes)


def bucket_of(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} rows exceed the largest bucket {buckets[-1]}")


def length_bucket(n: int, *, granule: int, cap: int) -> int:
    """KV length rounded up to a multiple of max(granule, ~n/16): at most one granule or ~12% over-read,
    and only ~8 buckets per doubling of the context, so few graphs are captured."""
    step = max(granule, 1 << max(0, n.bit_length() - 4))
    return min(cap, -(-n // step) * step)


class Scheduler:
    def __init__(self, *, num_slots: int, max_num_batched_tokens: int, max_model_len: int, granule: int,
                 slot_len: int, eos_token_ids: list[int], min_admit: int = 1, continuation_wait: int = 0,
                 park_slots: int = 0, evict_parked_for_new: bool = True):
        if slot_len < max_model_len:
            raise ValueError(f"slot_len({slot_len}) must hold max_model_len({max_model_len}) tokens")
        self.num_slots = num_slots  # decode rows: slots [0, num_slots); park slots follow them
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.granule, self.slot_len = granule, slot_len
        self.eos = frozenset(eos_token_ids)
        # admit only once this many slots are free (or everything waiting fits): one prefill for a batch
        # of finished sequences instead of one stalled decode step per EOS
        self.min_admit = max(1, min_admit)
        # continuations (kept KV, slot held) are admitted in waves too: once min_admit of them wait, or once the
        # oldest has waited this many steps (one prefill for many returning agent turns, not one per turn)
        self.continuation_wait = continuation_wait
        # False: a new sequence never evicts a parked KV while others run (RolloutConfig.evict_parked_for_new)
        self.evict_parked_for_new = evict_parked_for_new
        # True: nothing waiting is admitted (decoding beside training, rollout/beside.py); the running rows decode on
        self.admission_paused = False
        self.steps = 0  # update() calls: engine steps (prefill or decode) whose tokens were applied
        self.buckets = batch_buckets(num_slots)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self._free = list(range(num_slots))  # a heap: the lowest free slot is taken first
        self._rows_admitted = 0  # prefill rows so far (Sequence.prefill_row)
        self.parked: OrderedDict[int, Sequence] = OrderedDict()  # slot -> finished sequence keeping its KV (LRU first)
        self._park_free = list(range(num_slots, num_slots + park_slots))  # a heap of free park slots
        self.spare = num_slots + park_slots  # the cache's spare slot (kv_cache.KVCache): a swap's scratch
        self.stored: OrderedDict[int, Sequence] = OrderedDict()  # park slot -> parked sequence (LRU first)
        # KV copies (src slot, dst slot, positions) decided by admission, for the engine to run before the prefill
        self.relocations: list[tuple[int, int, int]] = []
        self.on_evict: Callable[[Sequence], None] | None = None
        # the queue holds continuations holding a decode slot first (they need no room), then in arrival order
        # continuations whose KV waits in a park slot and fresh sequences: a returning turn needs a decode slot as a
        # fresh one does, and putting it ahead of sequences queued before it finishes trajectories one by one while
        # the queued ones start late, so an RL step's last trajectories run their turns and tool calls with the
        # decode rows half empty (bench.agent_turns --tool-delay-steps: 999-1,003 decode steps against 835)
        self._reserved = 0
        self._returning = 0

    def add(self, seq: Sequence) -> None:
        seq.queued_at = self.steps
        if 0 <= seq.slot < self.num_slots:  # a continuation holding its decode slot goes first: it needs no free one
            self.waiting.appendleft(seq)
            self._reserved += 1
        elif seq.slot >= 0:  # one in a park slot needs a decode slot: in arrival order with fresh sequences
            self.waiting.append(seq)
            self._returning += 1
        else:
            self.waiting.append(seq)

    def is_parked(self, seq: Sequence) -> bool:
        """Whether `seq` keeps its KV parked now (in a decode slot or a park slot)."""
        return seq.slot >= 0 and (self.parked.get(seq.slot) is seq or self.stored.get(seq.slot) is seq)

    def has_parked(self) -> bool:
        return bool(self.parked or self.stored)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> PrefillBatch | DecodeBatch:
        """Prefill when waiting sequences can be admitted (prefill-first keeps the batch full), else decode."""
        if self.can_admit():
            return self._admit()
        if not self.running:
            raise RuntimeError("schedule() called with no work; check has_work() first")
        return self.decode_batch(sorted(self.running.values(), key=lambda s: s.slot))

    def decode_batch(self, seqs: list[Sequence], *, lookahead: int = 0) -> DecodeBatch:
        """Decode shape for `seqs` (ascending slots) when `lookahead` earlier steps are still in flight
        (each writes one more position than the host-side lengths show)."""
        num_rows = bucket_of(seqs[-1].slot + 1, self.buckets)
        kv_len = length_bucket(max(s.length for s in seqs) + lookahead, granule=self.granule, cap=self.slot_len)
        return DecodeBatch(seqs, num_rows, kv_len)

    @staticmethod
    def shared_prompts(seqs: list[Sequence]) -> list[tuple[int, list[int]]]:
        """(prompt length, slots) of each prefill row's sequences among `seqs`: their KV at positions
        [0, prompt length) is identical (one prefill computed it), so decode may read it once per group."""
        groups: dict[int, tuple[int, list[int]]] = {}
        for s in seqs:
            groups.setdefault(s.prefill_row, (len(s.prompt_ids), []))[1].append(s.slot)
        return [g for g in groups.values() if len(g[1]) > 1]

    def can_admit(self) -> bool:
        """Whether the next step is a prefill. An idle engine admits whatever waits. Fresh sequences go in once
        min_admit slots are free (parked ones count: admission evicts them) or all of them fit; continuations
        (their slot held) once min_admit of them wait or the oldest has waited `continuation_wait` steps; a
        prefill admits every continuation waiting and the fresh ones that fit."""
        if not self.waiting or self.admission_paused:
            return False
        if not self.running:
            return True
        # fresh sequences and continuations in park slots need a decode slot (parked ones count: they move to a park
        # slot, swap with a returning continuation's, or are evicted unless evict_parked_for_new is off)
        fresh, new = len(self.waiting) - self._reserved, len(self.waiting) - self._reserved - self._returning
        room = self.room()
        if not self.evict_parked_for_new:
            room = min(self._returning, room) + min(new, self._new_room(evict=False))
        if fresh and room and room >= min(self.min_admit, fresh):
            return True
        if not self._reserved:
            return False
        if self._reserved >= self.min_admit:
            return True
        oldest = min(s.queued_at for s in islice(self.waiting, self._reserved))  # continuations lead the queue
        return self.steps - oldest >= self.continuation_wait

    def room(self) -> int:
        """Decode slots a sequence can take now: free ones and parked ones (admission moves or evicts their KV)."""
        return len(self._free) + len(self.parked)

    def needs_compaction(self) -> bool:
        if self.waiting or not self.running:
            return False
        top = max(self.running)  # (parked slots may hold the low free slots: move only downwards)
        return top >= bucket_of(len(self.running), self.buckets) and bool(self._free) and self._free[0] < top

    def surely_finishes_next(self, seq: Sequence) -> bool:
        """True when the next token ends `seq` by length, whatever it is (no need to decode it further)."""
        return len(seq.token_ids) + 1 >= seq.params.max_tokens or seq.length + 1 >= self.max_model_len

    def _new_room(self, *, evict: bool) -> int:
        """Decode slots a new sequence can take now: free ones, and parked ones whose KV moves to a free park slot
        (or, with `evict`, is evicted)."""
        return len(self._free) + (len(self.parked) if evict else min(len(self.parked), len(self._park_free)))

    def _admit(self) -> PrefillBatch:
        rows: dict[tuple[int, int], list[Sequence]] = {}
        padded = 0
        blocked: list[Sequence] = []  # new sequences that would evict: they keep their place at the queue's head
        evict = self.evict_parked_for_new or not self.running
        while self.waiting and (self._free or self.parked or 0 <= self.waiting[0].slot < self.num_slots):
            seq = self.waiting[0]
            if seq.slot < 0 and not self._new_room(evict=evict):
                blocked.append(self.waiting.popleft())
                continue
            # only fresh samples share a row
            row_key = (seq.prompt_index, seq.seq_id if seq.token_ids or seq.cached else -1)
            if row_key not in rows:
                new_len = max(padded, seq.length - seq.cached)
                # the budget counts padded tokens; the first row is always admitted (it fits max_model_len)
                if rows and new_len * (len(rows) + 1) > self.max_num_batched_tokens:
                    break
                rows[row_key] = []
                padded = new_len
                self._rows_admitted += 1
            self.waiting.popleft()
            if seq.slot < 0:
                seq.slot = self._take_slot()
            elif seq.slot >= self.num_slots:  # a continuation in a park slot: its KV comes back to a decode slot
                self._returning -= 1
                self._bring_back(seq)
            else:  # a continuation keeps the slot that holds its KV
                self._reserved -= 1
            seq.prefill_row = self._rows_admitted
            self.running[seq.slot] = seq
            rows[row_key].append(seq)
        self.waiting.extendleft(reversed(blocked))
        return PrefillBatch(list(rows.values()), padded)

    def _bring_back(self, seq: Sequence) -> None:
        """Give a continuation waiting in a park slot a decode slot, its KV copied there. The park slot is freed first,
        so a parked sequence the decode slot is taken from moves into it (a swap, through the cache's spare slot)
        rather than being evicted when every park slot is full."""
        park = seq.slot
        heapq.heappush(self._park_free, park)
        mark = len(self.relocations)
        seq.slot = self._take_slot()
        displaced = self.relocations[mark:]  # the parked sequence moved out of that decode slot, if any
        if displaced and displaced[0][1] == park:
            self.relocations[mark:] = [(park, self.spare, seq.cached), displaced[0], (self.spare, seq.slot, seq.cached)]
        else:
            self.relocations.append((park, seq.slot, seq.cached))

    def _take_slot(self) -> int:
        """A decode slot: a free one, else the least recently parked one's, which moves to a free park slot (or
        is evicted when none is free)."""
        if self._free:
            return heapq.heappop(self._free)
        slot, seq = self.parked.popitem(last=False)
        if self._park_free:
            seq.slot = heapq.heappop(self._park_free)
            # a finished sequence holds the KV of its whole length (the last position is never read); a
            # continuation parked again before its prefill only its first `cached` positions
            self.relocations.append((slot, seq.slot, seq.length if seq.finish_reason else seq.cached))
            self.stored[seq.slot] = seq
            return slot
        seq.slot, seq.kv_start = -1, None
        if self.on_evict is not None:
            self.on_evict(seq)
        return slot

    def unpark(self, seq: Sequence) -> bool:
        """Take a parked sequence out of the parked set (its slot stays reserved for the caller); False if it
        was evicted meanwhile."""
        for held in (self.parked, self.stored):
            if seq.slot >= 0 and held.get(seq.slot) is seq:
                del held[seq.slot]
                return True
        return False

    def park_unfinished(self, seq: Sequence) -> bool:
        """Stop a running sequence, or a continuation waiting with its slot, and keep the slot parked (an abort that
        keeps the KV); False if it holds no slot."""
        if seq.slot >= 0 and self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
        elif seq.slot >= 0 and any(s is seq for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if s is not seq)
            if seq.slot >= self.num_slots:
                self._returning -= 1
                self.stored[seq.slot] = seq
                return True
            self._reserved -= 1
        else:
            return False
        self.parked[seq.slot] = seq
        return True

    def free_slot(self, slot: int) -> None:
        """Give back a slot reserved by unpark()."""
        heapq.heappush(self._free if slot < self.num_slots else self._park_free, slot)

    def compaction(self) -> list[tuple[int, int]]:
        """Slot moves (src, dst) that shrink the decode bucket; applied here, the caller copies the KV."""
        if not self.needs_compaction():
            return []
        moves = []
        target = bucket_of(len(self.running), self.buckets)
        while max(self.running) >= target and self._free and self._free[0] < max(self.running):
            src = max(self.running)
            dst = heapq.heappop(self._free)
            seq = self.running.pop(src)
            seq.slot = dst
            self.running[dst] = seq
            heapq.heappush(self._free, src)
            moves.append((src, dst))
        return moves

    def release(self, seq: Sequence) -> bool:
        """Drop `seq` (an abort): out of the queue, or out of its slot, which is freed. True if it ran."""
        if seq.slot >= 0 and self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
            heapq.heappush(self._free, seq.slot)
            return True
        if seq.slot >= 0 and any(s is seq for s in self.waiting):  # a continuation's reserved slot
            self.free_slot(seq.slot)
            if seq.slot < self.num_slots:
                self._reserved -= 1
            else:
                self._returning -= 1
        self.waiting = deque(s for s in self.waiting if s is not seq)
        return False

    def finish_check(self, seq: Sequence) -> str | None:
        tok, p = seq.token_ids[-1], seq.params
        if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if len(seq.token_ids) >= p.max_tokens or seq.length >= self.max_model_len:
            return "length"
        return None

    def update(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float]) -> list[Sequence]:
        """Append one sampled token per sequence; returns the sequences that finished (slots freed)."""
        self.steps += 1
        done = []
        for seq, tok, lp in zip(seqs, tokens, logprobs, strict=True):
            seq.token_ids.append(int(tok))
            seq.logprobs.append(float(lp))
            reason = self.finish_check(seq)
            if reason is not None:
                seq.finish_reason = reason
                del self.running[seq.slot]
                if seq.session is not None and seq.length < self.max_model_len:  # a next turn can follow
                    self.parked[seq.slot] = seq
                else:
                    heapq.heappush(self._free, seq.slot)
                done.append(seq)
        return done
