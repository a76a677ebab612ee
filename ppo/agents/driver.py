"""Run many agent loops over one rollout engine: `drive(engine, trajectories, ...)`.

    results, stats = drive(engine, [Start(loop, task, seed, key=(row, j)) for ...], sampling=base, tools=pool)

Every loop is primed to its first action. Loops of one prompt whose first action generates from the prompt
alone share one request with n samples (one prefill; the same requests as batch generation, so a single-turn
step does exactly the work of `engine.generate`). After that each Generate is its own request, added while the
engine runs (rollout/base.py SteppingEngine); each CallTool goes to the tool pool, and the engine keeps stepping
the other trajectories while it runs. Both engines, native and vLLM, have the step API.

keep_kv (agent.keep_kv; an engine with sessions, the native one): every request names its trajectories as
sessions, so a finished turn keeps its KV in the engine while the tool runs and the next turn, which extends
its tokens, prefills only the new ones; a trajectory's session is released the moment its loop returns.
Plain generation (the single_turn loop) never continues: its requests take no session, so a finished sample frees
its slot at once, as without keep_kv.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import Any

from ppo.agents.loop import AgentRun, AgentTask, CallTool, Generate, Generated, ToolFailure, Trajectory, single_turn
from rollout.base import Completion, SamplingParams


@dataclass(slots=True)
class Start:
    """One trajectory to run: its loop (a generator function), its task, the seed of its prompt's requests
    (samples of one prompt share it: sample j draws request_key(seed, j)) and the caller's key for it."""

    loop: Callable[[AgentTask], AgentRun]
    task: AgentTask
    seed: int
    key: Hashable
    sample: int = 0  # its index among its prompt's samples (the first turn's key)


@dataclass(slots=True)
class DriveStats:
    engine_steps: int = 0
    steps_during_tools: int = 0  # engine steps taken while at least one tool call was running
    tool_wait_s: float = 0.0  # wall time the driver waited on tools with nothing to decode
    # the engine's prefill work (native engine: rollout.engine.NativeEngine.stats; ENGINE_COUNTERS): tokens
    # prefilled, tokens whose KV a later turn kept instead (keep_kv), parked KV evicted for room, turns that
    # re-prefilled anyway, parked KV moved between decode and park slots (rollout.max_parked_seqs)
    prefill_tokens: int = 0
    kv_reused_tokens: int = 0
    kv_evictions: int = 0
    kv_misses: int = 0
    kv_relocations: int = 0


ENGINE_COUNTERS = ("prefill_tokens", "kv_reused_tokens", "kv_evictions", "kv_misses", "kv_relocations")


class ToolPool:
    """Tool calls in threads, each with a timeout (a call past it answers ToolFailure; its thread finishes
    in the background). `run_here=False` (a generation TP rank other than 0): calls are not run here, their
    results arrive through the driver's `sync`."""

    def __init__(self, *, workers: int = 8, timeout_s: float = 30.0, run_here: bool = True):
        self.timeout_s, self.run_here = timeout_s, run_here
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agent-tool") if run_here else None
        self._running: dict[int, tuple[cf.Future, float]] = {}

    def submit(self, tid: int, call: Callable[[], Any]) -> None:
        if self._pool is not None:
            self._running[tid] = (self._pool.submit(call), time.monotonic())

    def ready(self, *, block: bool) -> list[tuple[int, Any]]:
        """(trajectory id, result) of the calls that finished or timed out; block: wait for at least one."""
        if not self._running:
            return []
        if block:
            now = time.monotonic()
            left = min(start + self.timeout_s - now for _, start in self._running.values())
            cf.wait([f for f, _ in self._running.values()], timeout=max(left, 0.0), return_when=cf.FIRST_COMPLETED)
        out, now = [], time.monotonic()
        for tid, (fut, start) in list(self._running.items()):
            if fut.done():
                exc = fut.exception()
                out.append((tid, ToolFailure(f"{type(exc).__name__}: {exc}") if exc is not None else fut.result()))
            elif now - start >= self.timeout_s:
                fut.cancel()
                out.append((tid, ToolFailure(f"timed out after {self.timeout_s:g} s")))
            else:
                continue
            del self._running[tid]
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def tp_tool_sync(group) -> Callable[[list], list] | None:
    """drive()'s `sync` under generation TP: every rank of `group` gets its rank 0's finished tool calls (only
    rank 0 runs them: ToolPool(run_here=False) elsewhere), so every rank adds the same requests at the same
    engine step. None for a group of one (or none)."""
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    src, me = dist.get_global_rank(group, 0), dist.get_rank(group)

    def sync(done: list) -> list:
        box = [done if me == 0 else None]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    return sync


def turn_seed(seed: int, sample: int, turn: int) -> int:
    """The seed of a later turn's request: a function of the prompt's seed, the sample and the turn only."""
    h = hashlib.blake2b(f"{seed}/{sample}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & (2**62 - 1)


@dataclass(slots=True)
class _Live:
    start: Start
    run: AgentRun
    turns: int = 0
    result: Trajectory | None = None


@dataclass(slots=True)
class _Request:
    prompt: list[int]
    params: SamplingParams
    tids: list[int]  # sample j of the request feeds trajectory tids[j]


def drive(engine, starts: list[Start], *, sampling: SamplingParams, tools: ToolPool | None = None,
          sync: Callable[[list], list] | None = None, keep_kv: bool = False) -> tuple[list[Trajectory], DriveStats]:
    """The trajectories of `starts` (same order) and what driving them took. sampling: temperature, top-k,
    top-p and stop tokens of every request (max_tokens, n and seed come from the loops and starts). sync: under
    generation TP, agrees the finished tool calls with TP rank 0 (the only rank that runs them). keep_kv: keep each
    trajectory's KV between its turns (module docstring); ignored by an engine without sessions (vLLM: its prefix
    cache serves the earlier turns)."""
    if not hasattr(engine, "add_request"):
        raise TypeError(f"{type(engine).__name__} has no step API (rollout.base.SteppingEngine): agent loops need one")
    live = [_Live(s, s.loop(s.task)) for s in starts]
    stats = DriveStats()
    pool = tools or ToolPool(workers=1)
    sessions = keep_kv and hasattr(engine, "release_session")
    engine_stats = dict(getattr(engine, "stats", {}))
    waiting_tools: set[int] = set()
    pending: list[tuple[int, Generate]] = []  # Generate actions not yet sent to the engine

    def advance(tid: int, value: Any) -> None:
        """Send `value` into trajectory tid and dispatch its next action."""
        t = live[tid]
        try:
            action = t.run.send(value)
        except StopIteration as stop:
            t.result = _checked(stop.value, t.start)
            if sessions:  # its turns are over: the KV it kept goes back at once
                engine.release_session(("agent", tid))
            return
        if isinstance(action, Generate):
            pending.append((tid, action))
        elif isinstance(action, CallTool):
            waiting_tools.add(tid)
            pool.submit(tid, action.call)
        else:
            raise TypeError(f"agent loop {t.start.loop.__name__} yielded {type(action).__name__}; "
                            "yield Generate(...) or CallTool(...)")

    def requests() -> list[_Request]:
        """The pending Generate actions as engine requests; a prompt's first turns share one (n samples)."""
        out, grouped = [], {}
        for tid, g in pending:
            t, turn = live[tid], live[tid].turns
            t.turns += 1
            if g.max_tokens <= 0:  # nothing left of the budget: answered without the engine
                out.append(_Request([], sampling, [tid]))
                continue
            if turn == 0 and g.token_ids == t.start.task.prompt_ids:
                key = (t.start.seed, g.max_tokens)
                req = grouped.get(key)
                if req is not None and len(req.tids) == t.start.sample:  # the prompt's next sample: one more of n
                    req.tids.append(tid)
                    req.params.n += 1
                    continue
                if t.start.sample == 0:  # sample j of this request draws request_key(seed, j), as generate()
                    req = grouped[key] = _Request(g.token_ids, replace(
                        sampling, max_tokens=g.max_tokens, n=1, seed=t.start.seed), [tid])
                    out.append(req)
                    continue
            out.append(_Request(g.token_ids, replace(
                sampling, max_tokens=g.max_tokens, n=1, seed=turn_seed(t.start.seed, t.start.sample, turn)), [tid]))
        pending.clear()
        return out

    def deliver(req: _Request, comps: list[Completion]) -> None:
        for c in sorted(comps, key=lambda c: c.sample_index):
            tid = req.tids[c.sample_index]
            # the engine's lists are handed over, not copied
            advance(tid, Generated(c.token_ids, c.logprobs, c.finish_reason, c.error, c.routed_experts))

    def tool_results(*, block: bool) -> None:
        if not waiting_tools:
            return
        t0 = time.perf_counter()
        done = pool.ready(block=block)
        if sync is not None:
            done = sync(done)
        stats.tool_wait_s += time.perf_counter() - t0 if block else 0.0
        for tid, result in done:
            waiting_tools.discard(tid)
            advance(tid, result)

    try:
        for tid in range(len(live)):
            advance(tid, None)
        in_engine: dict[int, _Request] = {}
        while pending or in_engine or waiting_tools:
            for req in requests():
                if not req.prompt:
                    deliver(req, [Completion(0, 0, [], [], [], "length")])
                elif sessions and any(live[tid].start.loop is not single_turn for tid in req.tids):
                    keys = [("agent", tid) for tid in req.tids]
                    in_engine[engine.add_request(req.prompt, req.params, sessions=keys)] = req
                else:
                    in_engine[engine.add_request(req.prompt, req.params)] = req
            if engine.has_unfinished():
                done = engine.step()
                stats.engine_steps += 1
                stats.steps_during_tools += bool(waiting_tools)
                by_request: dict[int, list[Completion]] = {}
                for c in done:
                    by_request.setdefault(c.prompt_index, []).append(c)
                for rid, comps in by_request.items():
                    deliver(in_engine.pop(rid), comps)
                tool_results(block=False)
            else:  # nothing to decode: wait for a tool
                tool_results(block=True)
    finally:
        if tools is None:
            pool.close()
        if sessions:  # a loop that raised leaves its session: none outlives the call
            for tid in range(len(live)):
                engine.release_session(("agent", tid))
    after = getattr(engine, "stats", {})
    for name in ENGINE_COUNTERS:
        setattr(stats, name, int(after.get(name, 0) - engine_stats.get(name, 0)))
    return [t.result for t in live], stats


def _checked(traj: Any, start: Start) -> Trajectory:
    if not isinstance(traj, Trajectory):
        raise TypeError(f"agent loop {start.loop.__name__} returned {type(traj).__name__}; return "
                        "TrajectoryBuilder.finish(text=...) (a Trajectory)")
    n = len(traj.response_ids)
    if (traj.loss_mask is not None and len(traj.loss_mask) != n) or len(traj.logprobs) != n:
        raise ValueError(f"agent loop {start.loop.__name__}: response of {n} tokens with a loss mask of "
                         f"{len(traj.loss_mask or [])} and {len(traj.logprobs)} log-probs")
    return traj
