"""`NativeEngine`: continuous-batching generation with a KV cache, CUDA graphs and TP decoding.

    engine = NativeEngine.from_model(model, config=RolloutConfig(max_model_len=512, kv_cache_tokens=8192))
    outs = engine.generate([[1, 5, 7], [1, 9]], SamplingParams(temperature=1.0, max_tokens=64, n=4, seed=0))

Under TP every rank of `tp_group` calls generate with the same prompts and params (same schedule,
same collectives) and gets the same completions. The hybrid engine's cycle is
wake_up() -> update_weights(shards) -> generate(...) -> sleep().
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Hashable, Iterable
from collections.abc import Sequence as Seq

import torch

from models.config import ModelConfig
from models.llama import LlamaForCausalLM
from models.lora import LoRASpec
from rollout.base import (
    Completion,
    RolloutConfig,
    SamplingParams,
    check_request,
    error_completions,
    generate_by_steps,
)
from rollout.model_runner import EngineModelRunner
from rollout.sampler import any_filtered, request_key
from rollout.scheduler import DecodeBatch, PrefillBatch, Scheduler, Sequence

log = logging.getLogger(__name__)


class NativeEngine:
    def __init__(self, model_config: ModelConfig, *, config: RolloutConfig, tp_group=None,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 eos_token_ids: list[int] | None = None, lora: LoRASpec | None = None):
        """lora: the engine applies LoRA adapters of this shape in its GEMMs (rollout/engine_lora.py):
        update_weights then takes "<module>.lora_A/B" tensors too, and a base kept across sleep
        (config.drop_weights_on_sleep=False) need not be sent again."""
        config.validate()
        self.model_config, self.config = model_config, config
        self.eos_token_ids = list(model_config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.runner = EngineModelRunner(model_config, config=config, tp_group=tp_group, device=device, dtype=dtype,
                                        lora=lora)
        self._rng = random.Random(config.seed)  # same seed on every TP rank -> same keys
        self._source: LlamaForCausalLM | None = None
        self.asleep = False
        # step-API state: the scheduler of the requests in flight (None when idle), their sequences by
        # request id, the ids that finished a sample since the last report, the decode step in flight
        self._sched: Scheduler | None = None
        self._requests: dict[int, list[Sequence]] = {}
        self._finished: set[int] = set()
        self._ready: list[Completion] = []
        self._pending: tuple[list[Sequence], object] | None = None
        self._updates: dict[int, tuple] = {}
        self._next_request = self._next_seq = 0
        # kept KV (add_request's `sessions`): session key -> its parked sequence (slot -1 once evicted); the parked
        # sequences whose position-0 KV must be saved before the next decode launch; weights loaded since the
        # last finish_loading while the scheduler lived
        self._sessions: dict[Hashable, Sequence] = {}
        self._to_save: list[Sequence] = []
        self._weights_changed = False
        # prefill_tokens: tokens run by prefills (a row shared by n samples counts once); kv_reused_tokens: tokens
        # a continuation did not re-run (its session's KV kept); kv_evictions: parked sessions evicted for room;
        # kv_relocations: parked KV copied between a decode slot and a park slot (RolloutConfig.max_parked_seqs);
        # kv_misses: continuations that re-prefilled (KV evicted, or the prompt did not extend the session's tokens);
        # device_drains: waits on the device that left it nothing queued while requests remained (pipeline bubbles;
        # a prefill's wait, or a decode step collected with none launched behind it); prefill_s: a prefill's time,
        # with the decode step it ran behind; prefill_{fresh,continue}_{s,rows}: the prefill forwards by kind, device
        # seconds (EngineModelRunner.last_prefill), prefill_continue_waves: prefill steps that ran continuations,
        # prefill_{fresh,continue}_{tokens,padded}: the tokens they ran and
        # the positions they computed with padding; sampled_tokens: tokens sampled (a prefill's first token, each
        # decode row's)
        self.stats = {"prefill_steps": 0, "decode_steps": 0, "slot_moves": 0, "prefill_s": 0.0, "decode_s": 0.0,
                      "prefill_tokens": 0, "kv_reused_tokens": 0, "kv_evictions": 0, "kv_misses": 0,
                      "kv_relocations": 0, "device_drains": 0, "prefill_fresh_s": 0.0, "prefill_continue_s": 0.0,
                      "prefill_fresh_rows": 0, "prefill_continue_rows": 0, "prefill_continue_waves": 0,
                      "sampled_tokens": 0,
                      "prefill_fresh_tokens": 0, "prefill_fresh_padded": 0, "prefill_continue_tokens": 0,
                      "prefill_continue_padded": 0}

    @classmethod
    def from_model(cls, model: LlamaForCausalLM, *, config: RolloutConfig, device=None, dtype=None,
                   eos_token_ids: list[int] | None = None) -> NativeEngine:
        """Engine over a single-device model (tp=1). Its weights are aliased, not copied, when device and
        dtype match; sleep() then drops only the aliases and wake_up() re-aliases them."""
        first = next(model.parameters())
        engine = cls(model.config, config=config, device=device or first.device, dtype=dtype or first.dtype,
                     eos_token_ids=eos_token_ids)
        engine._source = model
        engine._load_source()
        return engine

    def _load_source(self) -> None:
        self.runner.load_weights(self._source.state_dict(keep_vars=False).items(), share=True)
        if self.runner.device.type == self._source.model.inv_freq.device.type:
            self.runner.model.model.inv_freq = self._source.model.inv_freq.to(self.runner.device)

    # ---- RolloutEngine protocol ----
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, share: bool = False) -> None:
        """Load HF-named local TP shards. `share=True` aliases tensors already on the engine's device and
        dtype instead of copying (zero-copy; the caller must keep them unchanged until sleep())."""
        if self.asleep:
            raise RuntimeError("update_weights on a sleeping engine: call wake_up() first")
        self.runner.load_weights(named_tensors, share=share)
        self._weights_changed = self._sched is not None  # folded before the next step (rollout.fold_norms)

    def holds_weights(self) -> bool:
        """Whether the engine still holds every base weight (then an update may send the LoRA adapters alone)."""
        return self.runner.holds_weights()

    def set_beside_training(self, on: bool) -> None:
        """While decoding runs beside training (rollout/beside.py): no CUDA graph is captured (a shape without one
        replays the graph of more rows, or runs un-graphed) and nothing waiting is admitted (a prefill is
        compute-bound, as the update is: beside it, it would share nothing and hold the host). step() then only
        decodes the running rows: see is_decoding()."""
        self.runner.may_capture = not on
        if self._sched is not None:
            self._sched.admission_paused = on

    def can_admit(self) -> bool:
        """Whether the next step() would admit (prefill) sequences waiting for a slot."""
        return self._sched is not None and self._sched.can_admit()

    def num_waiting(self) -> int:
        """Sequences waiting for a slot (fresh samples and continuations)."""
        return 0 if self._sched is None else len(self._sched.waiting)

    def free_slots(self) -> int:
        """Decode slots free now (a parked KV's slot counts: admission moves or evicts it)."""
        return 0 if self._sched is None else self._sched.room()

    def is_decoding(self) -> bool:
        """Whether a step() would decode: rows running or a decode step in flight (waiting sequences aside)."""
        return self._sched is not None and (bool(self._sched.running) or self._pending is not None)

    def sleep(self) -> None:
        if self.asleep:
            return
        if self.has_unfinished():
            raise RuntimeError("sleep() with unfinished requests: step them to the end or abort them first")
        if not self.config.free_memory_on_sleep:  # keep everything resident: wake_up has nothing to redo
            self.asleep = True  # (parked sessions keep their KV)
            return
        self._drop_sessions()  # the KV cache goes: kept KV with it
        self._sched = None
        before = self._mem()
        drop = self.config.drop_weights_on_sleep or self._source is not None
        self.runner.free_runtime(drop_weights=drop)
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = True
        log.info("rollout sleep: allocated %.2f GB -> %.2f GB (weights dropped: %s)", before, self._mem(), drop)

    def wake_up(self) -> None:
        if not self.asleep:
            return
        if self.runner.cache is not None:  # slept without freeing (free_memory_on_sleep=false): nothing to redo
            self.asleep = False
            return
        before = self._mem()
        self.runner.wake()
        if self._source is not None:
            self._load_source()
        self.asleep = False
        log.info("rollout wake_up: allocated %.2f GB -> %.2f GB", before, self._mem())

    def _mem(self) -> float:
        return torch.cuda.memory_allocated(self.runner.device) / 1e9 if self.runner.device.type == "cuda" else 0.0

    def generate(self, prompts: list[list[int]],
                 sampling: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """The batch call: every request added, then the engine stepped until all finished."""
        return generate_by_steps(self, prompts, sampling)

    # ---- step API (rollout/base.py: SteppingEngine) ----
    def add_request(self, prompt: list[int], params: SamplingParams, *,
                    sessions: Seq[Hashable] | None = None) -> int:
        """Queue `params.n` samples of `prompt`; usable while the engine runs (between step() calls).
        Returns the request id that its completions carry as `Completion.prompt_index`. A bad request
        comes back as "error" completions from the next step().

        sessions: one key per sample (kept KV across turns). A sample that finishes ("stop"/"length") keeps its
        KV slot parked under its key; a later request under that key whose prompt extends the sample's tokens
        (its prompt, its tokens, then anything new) prefills only the new tokens. When a waiting sequence needs its
        slot, the parked KV moves to a park slot (RolloutConfig.max_parked_seqs; stats "kv_relocations"), or without a
        free one is evicted (the continuation then re-prefills: stats "kv_evictions", "kv_misses");
        release_session() frees it at once."""
        if self.asleep:
            raise RuntimeError("add_request on a sleeping engine: call wake_up() (and update_weights) first")
        if sessions is not None and (not isinstance(getattr(params, "n", None), int) or len(sessions) != params.n):
            raise ValueError(f"{len(sessions)} sessions for n={getattr(params, 'n', None)} samples: give one key per "
                             "sample")
        if self._sched is None:
            self.runner.finish_loading()
            self._weights_changed = False
            self._sched = Scheduler(
                num_slots=self.runner.num_slots, max_num_batched_tokens=self.config.max_num_batched_tokens,
                max_model_len=self.config.max_model_len, granule=self.config.block_size,
                slot_len=self.runner.slot_len, eos_token_ids=self.eos_token_ids,
                min_admit=int(self.config.min_admit_fraction * self.runner.num_slots),
                continuation_wait=self.config.continuation_wait_steps, park_slots=self.runner.park_slots,
                evict_parked_for_new=self.config.evict_parked_for_new)
            self._sched.on_evict = self._evicted
        else:  # a scheduler kept alive by parked sessions follows the budget the batch controller moves
            self._sched.max_num_batched_tokens = self.config.max_num_batched_tokens
        rid = self._next_request
        self._next_request += 1
        prompt = [int(t) for t in prompt]
        err = check_request(prompt, params, max_model_len=self.config.max_model_len,
                            vocab_size=self.model_config.vocab_size)
        if err is not None:
            for key in sessions or ():
                self.release_session(key)
            self._ready.extend(error_completions(rid, prompt, params, err))
            return rid
        # unseeded requests draw their seed here, in request order, so every TP rank agrees
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        seqs = [Sequence(self._next_seq + j, rid, j, prompt, params, request_key(seed, j)) for j in range(params.n)]
        self._next_seq += params.n
        self._requests[rid] = seqs
        for seq, key in zip(seqs, sessions or [None] * len(seqs), strict=True):
            if key is not None:
                seq.session = key
                self._continue(seq, self._sessions.pop(key, None))
            self._sched.add(seq)
        return rid

    def release_session(self, key: Hashable) -> None:
        """Free the KV slot parked under `key` (the trajectory ended); unknown keys: nothing."""
        seq = self._sessions.pop(key, None)
        if seq is not None and self._sched is not None and self._sched.unpark(seq):
            self._sched.free_slot(seq.slot)
        if not self._requests and not self._ready and self._sched is not None and not self._sched.has_parked():
            self._idle()

    def _continue(self, seq: Sequence, parked: Sequence | None) -> None:
        """Make `seq` a continuation of its session's parked sequence when that one's KV is still in its slot and
        `seq`'s prompt extends its tokens (the KV of positions [0, length - 1): the last sampled token never ran)."""
        if parked is None:
            return
        if not self._sched.unpark(parked):  # evicted meanwhile
            self.stats["kv_misses"] += 1
            return
        cached = len(parked.kept) - 1
        if cached < 1 or len(seq.prompt_ids) <= cached or seq.prompt_ids[:cached] != parked.kept[:cached]:
            self._sched.free_slot(parked.slot)
            self.stats["kv_misses"] += 1
            return
        seq.slot, seq.cached, seq.kv_start = parked.slot, cached, parked.kv_start
        if seq.kv_start is None:  # not saved yet: save it before the next decode launch, as for a parked one
            self._to_save.append(seq)
        if parked.routes:  # a mixture of experts: the records of the tokens kept, then the new ones' at prefill
            seq.routes = [torch.cat(parked.routes)[:cached]]

    def _evicted(self, seq: Sequence) -> None:
        self.stats["kv_evictions"] += 1

    def _park(self, seq: Sequence) -> None:
        """A finished sequence kept its slot (Scheduler.update): file it under its session."""
        old = self._sessions.get(seq.session)
        if old is not None and old is not seq:
            self.release_session(seq.session)
        self._sessions[seq.session] = seq
        # a copy (the completion hands these lists to the caller); a continuation parked again before its prefill
        # ran holds the KV of its first `cached` tokens only
        seq.kept = seq.prompt_ids[: seq.cached + 1] if seq.prefill_row < 0 else seq.prompt_ids + seq.token_ids
        self._to_save.append(seq)

    def _drop_sessions(self) -> None:
        if self._sessions and self._sched is not None:
            for seq in self._sessions.values():
                if self._sched.unpark(seq):
                    self._sched.free_slot(seq.slot)
        self._sessions.clear()
        self._to_save.clear()

    def has_unfinished(self) -> bool:
        """True while an added request has completions that step() has not returned yet."""
        return bool(self._requests or self._ready)

    def step(self) -> list[Completion]:
        """One engine iteration (a prefill, one decode step, or a prefill behind the decode step in flight and
        that step); returns the completions of the requests that finished in it, each request's `n` samples
        together. Decode stays pipelined one step ahead, so a decode step may still be in flight on return: call
        settle() before swapping weights."""
        ready, self._ready = self._ready, []
        if self._weights_changed:  # weights swapped between steps with requests in flight
            self.runner.finish_loading()
            self._weights_changed = False
        if self._sched is not None and (self._sched.has_work() or self._pending is not None):
            self._iterate(self._sched)
        return ready + self._collect_finished()

    def settle(self) -> list[Completion]:
        """Wait for the decode step in flight (if any) and apply its tokens; afterwards no device work is
        pending, so update_weights() may run before the next step(). Returns what finished."""
        if self._pending is not None:
            seqs, handle = self._pending
            self._pending = None
            self._apply_decode(self._sched, seqs, handle)
        ready, self._ready = self._ready, []
        return ready + self._collect_finished()

    def abort(self, request_id: int, *, park: bool = False) -> list[Completion]:
        """Stop a request now and free its slots; returns its samples as they stand (tokens and log-probs
        sampled so far; finish_reason "abort" for those still running). Unknown or finished ids: [].
        park: a running sample with a session keeps its KV parked under it instead (a later request under the
        session that extends its tokens continues from that KV: partial rollouts' rollout.partial_kv=keep)."""
        seqs = self._requests.pop(request_id, None)
        if seqs is None:
            return []
        for s in seqs:
            if s.finish_reason is None:
                s.finish_reason = "abort"
                if park and s.session is not None and self._sched.park_unfinished(s):
                    if s.slot < self._sched.num_slots:  # a decode row (not a continuation waiting in a park slot)
                        self._updates[s.slot] = _PAD
                    self._park(s)
                    continue
                if self._sched.release(s):  # was running: its device row must stop advancing
                    self._updates[s.slot] = _PAD
                s.session = None
        return [_completion(s) for s in seqs]

    def _collect_finished(self) -> list[Completion]:
        done = [rid for rid in self._finished if rid in self._requests]
        self._finished.clear()
        out = []
        for rid in done:
            seqs = self._requests[rid]
            if all(s.finish_reason is not None for s in seqs):
                del self._requests[rid]
                out.extend(_completion(s) for s in seqs)
            else:
                self._finished.add(rid)  # samples still running: report the request when all are done
        if not self._requests and not self._ready:
            self._idle()
        return out

    def _idle(self) -> None:
        """No request left: wait out a step still in flight (rows that all finished) and leave every device
        row inactive for whatever comes next. The scheduler stays while sessions keep parked slots."""
        if self._pending is not None:
            seqs, handle = self._pending
            self._pending = None
            self._apply_decode(self._sched, seqs, handle)
        if self._sched is not None:
            self._save_parked()
            self.runner.set_rows(self._updates)
            self._updates.clear()
            if not self._sched.has_parked():
                self._sched = None

    def _save_parked(self) -> None:
        """Save position 0 of the slots parked since the last decode launch: padding rows write there."""
        for s in self._to_save:
            waiting = s.cached and s.prefill_row < 0 and s.finish_reason is None  # a continuation not yet admitted
            if self._sched.is_parked(s) or waiting:
                s.kv_start = self.runner.save_slot_start(s.slot)
        self._to_save.clear()

    def _iterate(self, sched: Scheduler) -> None:
        """One iteration of prefill-first continuous batching. Decode is pipelined one step ahead: while
        step k runs, step k+1 is already enqueued (its inputs are produced on the device by step k), so
        host bookkeeping overlaps the GPU. A sequence that finishes at step k costs one discarded row in
        step k+1. Sequences admitted while step k runs are prefilled behind it (the prefill's launches overlap
        step k; its tokens come back with step k's): one wait with the device left idle per admission, not two."""
        t0 = time.perf_counter()
        updates = self._updates  # decode rows to (re)write before the next launch
        if self._pending is None:
            step = sched.schedule()
            if isinstance(step, PrefillBatch):
                self.stats["device_drains"] += bool(sched.running.keys() - {s.slot for s in step.seqs})
                self._prefill(sched, step)
                self.stats["prefill_s"] += time.perf_counter() - t0
                return
            moves = sched.compaction()
            if moves:
                # the KV of positions [0, length - 1) is in the cache; the last token is written next step
                self.runner.move_slots(moves, lengths=[sched.running[dst].length - 1 for _, dst in moves])
                for src, dst in moves:
                    updates[src], updates[dst] = _PAD, _row(sched.running[dst])
                self.stats["slot_moves"] += len(moves)
                step = sched.schedule()
            self._pending = (step.seqs, self._launch(step, updates))
        seqs, handle = self._pending
        self._pending = None
        if sched.can_admit():  # prefill behind step k (stream order: it reads and writes the KV after step k)
            self.stats["device_drains"] += 1
            self._prefill(sched, sched.schedule(), before=(seqs, handle))
            self.stats["prefill_s"] += time.perf_counter() - t0
            return
        if not sched.needs_compaction():
            ahead = [s for s in seqs if s.finish_reason is None and not sched.surely_finishes_next(s)]
            if ahead:
                self._pending = (ahead, self._launch(sched.decode_batch(ahead, lookahead=1), updates))
        self.stats["device_drains"] += self._pending is None and sched.has_work()
        self._apply_decode(sched, seqs, handle)
        self.stats["decode_steps"] += 1
        self.stats["decode_s"] += time.perf_counter() - t0

    def _prefill(self, sched: Scheduler, step: PrefillBatch, *, before: tuple | None = None) -> None:
        """Run the admitted rows and apply their first tokens; `before`: the decode step in flight (its
        sequences, its handle), applied first (the prefill's results wait for it anyway)."""
        if sched.relocations:  # parked KV admission moved between decode and park slots (stream-ordered)
            moves, sched.relocations = sched.relocations, []
            self.runner.move_slots([m[:2] for m in moves], lengths=[m[2] for m in moves])
            self.stats["kv_relocations"] += len(moves)
        tokens, logprobs, routes = self.runner.prefill(step)
        for k, v in self.runner.last_prefill.items():
            self.stats[k] += v
        if before is not None:
            self._apply_decode(sched, *before)
            self.stats["decode_steps"] += 1
        if routes is not None:  # a mixture of experts: the tokens each row ran (a continuation's new ones)
            for r, row in enumerate(step.rows):
                for s in row:
                    s.routes.append(routes[r])
        for row in step.rows:
            self.stats["prefill_tokens"] += row[0].length - row[0].cached
            self.stats["kv_reused_tokens"] += row[0].cached
        self.stats["sampled_tokens"] += len(step.seqs)
        for s in sched.update(step.seqs, tokens, logprobs):
            self._finished.add(s.prompt_index)
            if sched.is_parked(s):
                self._park(s)
        for s in step.seqs:
            self._updates[s.slot] = _PAD if s.finish_reason else _row(s)
        self.stats["prefill_steps"] += 1

    def _apply_decode(self, sched: Scheduler, seqs: list[Sequence], handle) -> None:
        tokens, logprobs, routes = self.runner.collect(handle)
        live = [s for s in seqs if s.finish_reason is None]  # rows that finished (or aborted) are discarded
        if routes is not None:  # the experts of the token each live row ran (its last one so far)
            for s in live:
                s.routes.append(routes[s.slot: s.slot + 1])
        self.stats["sampled_tokens"] += len(live)
        for s in sched.update(live, [tokens[s.slot] for s in live], [logprobs[s.slot] for s in live]):
            self._updates[s.slot] = _PAD
            self._finished.add(s.prompt_index)
            if sched.is_parked(s):
                self._park(s)

    def _launch(self, step: DecodeBatch, updates: dict[int, tuple]):
        if self._to_save:
            self._save_parked()
        self.runner.set_shared_prompts(Scheduler.shared_prompts(step.seqs))
        self.runner.set_rows(updates)
        updates.clear()
        return self.runner.launch_decode(step.num_rows, step.kv_len, any_filtered(step.seqs))


_PAD = ((0, 0, 0, 0, 0), (0.0, 1.0))  # inactive row: greedy on token 0 at position 0 of a free slot


def _completion(s: Sequence) -> Completion:
    return Completion(s.prompt_index, s.sample_index, s.prompt_ids, s.token_ids, s.logprobs, s.finish_reason,
                      routed_experts=_routed_experts(s))


def _routed_experts(seq: Sequence) -> torch.Tensor | None:
    """[P + R - 1, L_moe, k]: the experts of every token the engine ran for `seq` (None for a dense model)."""
    if not seq.routes:
        return None
    return torch.cat(seq.routes)[: seq.length - 1]


def _row(seq: Sequence) -> tuple[tuple[int, ...], tuple[float, float]]:
    """Device decode row of a running sequence: its last token goes at position length - 1."""
    p = seq.params
    return (seq.token_ids[-1], seq.length - 1, seq.key, p.top_k, 1), (float(p.temperature), float(p.top_p))
