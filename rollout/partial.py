"""Partial rollouts over a stepping engine (rollout/base.py SteppingEngine): groups of samples that keep
decoding across weight updates, each token tagged with the weight version that sampled it, and
over-provisioning (more groups in flight than a batch needs; the first complete groups are taken, the others
continue).

    rollouts = PartialRollouts(engine, version=0)
    for prompt, params in requests:
        rollouts.add_group(prompt, params)               # n samples of one prompt (a GRPO group)
    done = rollouts.run_until(groups=8)                  # the first 8 groups whose samples all finished
    rollouts.swap_weights(new_named_tensors, version=1)  # between decode steps; the rest continue under v1
    for trajectory in done[0]:
        trajectory.token_ids, trajectory.logprobs, trajectory.versions   # [R] each, versions per token

A swap recomputes the KV of every sample in flight under the new weights: the engine is settled (no decode
step in flight), each unfinished sample is aborted and re-added as a continuation (its prompt plus the tokens
it has so far), whose prefill writes the KV with the new weights. A token's behaviour log-prob is therefore
exactly the log-prob of the version named beside it, given the whole prefix: what a trainer recomputes with
that version's weights.

`kv="keep"` (rollout.partial_kv=keep; an engine with sessions, the native one) keeps the old KV instead: suspend()
parks each sample's slot (engine.abort(..., park=True)) and resume() continues it from there, prefilling only its
last token under the new weights. Cheaper, but the tokens after the swap attend to keys and values of the old
weights, a mixture no trainer can reproduce: their behaviour log-probs are off by the stale-KV gap
(docs/async.md measures it). Where the KV is gone (evicted, or freed by a sleep) the sample re-prefills.

A continuation draws from its own seed (the group's seed, the sample and the swap count), so a run with the
same swaps is reproducible; it is not the token stream an uninterrupted sample would have drawn.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace

import torch

from rollout.base import Completion, SamplingParams


@dataclass(slots=True)
class Trajectory:
    """One sample of a group across weight versions."""

    group: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # behaviour log-probs, one per token
    versions: list[int] = field(default_factory=list)  # the weight version that sampled each token
    finish_reason: str | None = None  # None while in flight; else the engine's ("stop", "length", "error")
    error: str | None = None
    tag: object = None  # the caller's, given to add_group (e.g. the prompt's data row)
    # a mixture of experts: the experts of every token run, [P + R - 1, L_moe, k]; a continuation re-runs the whole
    # prefix, so its completion's records (the latest weights') cover the trajectory so far
    routed_experts: torch.Tensor | None = None

    def extend(self, c: Completion, *, version: int) -> None:
        self.token_ids += c.token_ids
        self.logprobs += c.logprobs
        self.versions += [version] * len(c.token_ids)
        if c.routed_experts is not None:
            self.routed_experts = c.routed_experts


@dataclass(slots=True)
class _Group:
    params: SamplingParams
    samples: list[Trajectory]
    admitted: int  # the weight version when the group was added (its oldest token's)
    swaps: int = 0  # how many swaps its unfinished samples went through (their continuations' seeds)


class PartialRollouts:
    """Groups in flight on one engine. Under TP every rank makes the same calls in the same order (as the
    engine requires). `version`: the version of the weights the engine holds now."""

    def __init__(self, engine, *, version: int = 0, kv: str = "recompute"):
        if kv not in ("recompute", "keep"):
            raise ValueError(f"kv={kv!r}: choose recompute or keep")
        self.engine, self.version = engine, version
        self.keep_kv = kv == "keep"
        self.groups: dict[int, _Group] = {}
        self._requests: dict[int, tuple[int, int | None]] = {}  # request id -> (group, sample or None: all)
        self._complete: list[int] = []  # groups whose samples all finished, in the order they did
        self._next_group = 0
        # recomputed_tokens: tokens re-prefilled at resume with kv="recompute" (with kv="keep" the engine's stats
        # count the tokens kept, kv_reused_tokens, and the prefills of samples whose KV was gone)
        self.stats = {"swaps": 0, "recomputed_tokens": 0, "aborted_samples": 0, "sampled_tokens": 0}

    def add_group(self, prompt: list[int], params: SamplingParams, *, tag: object = None) -> int:
        """Queue params.n samples of `prompt` as one group (each trajectory carries `tag`); returns the group id."""
        gid = self._next_group
        self._next_group += 1
        self.groups[gid] = _Group(params, [Trajectory(gid, j, list(prompt), tag=tag) for j in range(params.n)],
                                  admitted=self.version)
        self._requests[self.engine.add_request(prompt, params, **self._sessions(gid, range(params.n)))] = (gid, None)
        return gid

    def _sessions(self, gid: int, samples) -> dict:
        """add_request's sessions argument (kv="keep"): one engine session per sample."""
        return {"sessions": [("partial", gid, j) for j in samples]} if self.keep_kv else {}

    def in_flight(self) -> int:
        """Groups with a sample still decoding."""
        return sum(any(t.finish_reason is None for t in g.samples) for g in self.groups.values())

    def step(self) -> list[list[Trajectory]]:
        """One engine iteration; the groups complete since the last report (handed over: no longer held)."""
        self.advance()
        return self._take_complete(len(self._complete))

    def advance(self) -> None:
        """One engine iteration; groups that complete stay held (the next run_until hands them over first)."""
        self._absorb(self.engine.step())

    def admit_waiting(self) -> None:
        """Admit samples waiting for a slot into the slots free now (each step that admits prefills them, beside the
        decode step in flight; slots freed meanwhile by rows ending are left to the next generation): afterwards as
        many samples decode as those slots hold (rollout/beside.py)."""
        room = self.engine.free_slots()
        while room > 0 and self.engine.can_admit():
            waiting = self.engine.num_waiting()
            self.advance()
            admitted = waiting - self.engine.num_waiting()
            if admitted <= 0:
                break  # nothing could go in (admission would have evicted a parked KV)
            room -= admitted

    def settle(self) -> None:
        """Wait for the engine's decode step in flight and take its tokens (nothing is left pending on the device)."""
        self._absorb(self.engine.settle())

    def run_until(self, *, groups: int, due_before: int | None = None, wait: bool = True) -> list[list[Trajectory]]:
        """Step until `groups` groups are complete (or none is left in flight) and hand them over: the due
        groups first (admitted at a version below `due_before`: the call waits for them, which is how a
        staleness bound K is kept, due_before = the trainer's version - K + 1), then the others in the order
        they finished. Complete groups beyond `groups` stay here for the next call. wait=False: the due groups
        that are complete go first, the others are not waited for (drop() them after suspend()).
        stats["paced_s"] / ["paced_steps"]: the seconds and engine steps spent waiting for due groups once
        `groups` groups were complete."""
        def due() -> list[int]:
            return [] if due_before is None else [gid for gid, g in self.groups.items() if g.admitted < due_before]

        enough_at, steps = None, 0
        while self.engine.has_unfinished() and (len(self._complete) < groups or (
                wait and any(gid not in self._complete for gid in due()[:groups]))):
            if enough_at is None and len(self._complete) >= groups:
                enough_at = time.perf_counter()
            steps += enough_at is not None
            self.advance()
        if enough_at is not None:
            self.stats["paced_s"] = self.stats.get("paced_s", 0.0) + time.perf_counter() - enough_at
            self.stats["paced_steps"] = self.stats.get("paced_steps", 0) + steps
        first = [gid for gid in due() if gid in self._complete][:groups]
        self._complete = first + [gid for gid in self._complete if gid not in first]
        return self._take_complete(groups)

    def swap_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Load new weights between decode steps; every sample in flight continues under them, its KV
        recomputed (module docstring). named_tensors: as the engine's update_weights takes them."""
        self.suspend()
        self.engine.update_weights(named_tensors)
        self.resume(version=version)

    def suspend(self) -> None:
        """Stop every sample in flight, keeping its tokens: the engine is left idle (it may sleep, and its
        weights may change); resume() continues them."""
        self.settle()
        for rid in list(self._requests):
            self._absorb(self.engine.abort(rid, **({"park": True} if self.keep_kv else {})), aborting=True)
        # nothing left in flight: settle() idles the engine, so the next request finishes loading the new
        # weights (the native engine folds the norms into the projections then, rollout.fold_norms)
        self.settle()

    def resume(self, *, version: int) -> None:
        """Continue every suspended sample on the engine, whose weights are now `version`'s: each is re-added as
        its prompt plus its tokens so far (the prefill recomputes its KV)."""
        if self._requests:
            raise RuntimeError("resume() with samples still in flight: suspend() first")
        self.version = version
        self.stats["swaps"] += 1
        live = [t for g in self.groups.values() for t in g.samples if t.finish_reason is None]
        for gid in sorted({t.group for t in live}):
            self.groups[gid].swaps += 1
        for t in live:
            g = self.groups[t.group]
            left = g.params.max_tokens - len(t.token_ids)
            if left <= 0:  # the cap was reached in the step the swap settled
                t.finish_reason = "length"
                self._release(t)
                if all(s.finish_reason is not None for s in g.samples):
                    self._complete.append(t.group)
                continue
            seed = None if g.params.seed is None else hash((g.params.seed, t.sample_index, g.swaps)) % 2**62
            cont = replace(g.params, n=1, max_tokens=left, seed=seed)
            if not self.keep_kv:
                self.stats["recomputed_tokens"] += len(t.prompt_ids) + len(t.token_ids)
            self._requests[self.engine.add_request(t.prompt_ids + t.token_ids, cont,
                                                   **self._sessions(t.group, [t.sample_index]))] = (
                t.group, t.sample_index)

    def drop(self, *, admitted_before: int) -> list[list[Trajectory]]:
        """Give up the groups held (suspended or complete, none in flight) that were admitted at a version below
        `admitted_before`: returned, no longer held (their tokens are discarded; the caller accounts for their
        prompts). stats counts them: dropped_groups, dropped_samples, dropped_tokens (tokens decoded for nothing)."""
        if self._requests:
            raise RuntimeError("drop() with samples in flight: suspend() first")
        gone = [gid for gid, g in self.groups.items() if g.admitted < admitted_before]
        self._complete = [gid for gid in self._complete if gid not in gone]
        out = [self.groups.pop(gid).samples for gid in gone]
        for t in (t for g in out for t in g):  # kv="keep": their parked KV goes back at once
            self._release(t)
        for key, value in (("dropped_groups", len(out)), ("dropped_samples", sum(map(len, out))),
                           ("dropped_tokens", sum(len(t.token_ids) for g in out for t in g))):
            self.stats[key] = self.stats.get(key, 0) + value
        return out

    def state_dict(self) -> dict:
        """The groups held (suspended or complete), in plain containers (a checkpoint's weights_only load);
        only while suspended: nothing may be in flight on the engine."""
        if self._requests:
            raise RuntimeError("state_dict() with samples in flight: suspend() first")
        return {"version": self.version, "next_group": self._next_group, "complete": list(self._complete),
                "groups": [{"id": gid, "params": asdict(g.params), "admitted": g.admitted, "swaps": g.swaps,
                            "samples": [asdict(t) for t in g.samples]} for gid, g in self.groups.items()],
                "stats": dict(self.stats)}

    def load_state_dict(self, state: dict) -> None:
        """Restore state_dict()'s groups (suspended: resume() continues them)."""
        self.version, self._next_group = state["version"], state["next_group"]
        self._complete, self.stats = list(state["complete"]), dict(state["stats"])
        self.groups = {g["id"]: _Group(SamplingParams(**g["params"]), [Trajectory(**t) for t in g["samples"]],
                                       admitted=g["admitted"], swaps=g["swaps"]) for g in state["groups"]}
        self._requests = {}

    def _absorb(self, completions: list[Completion], *, aborting: bool = False) -> list[Trajectory]:
        """Fold completions into their trajectories. aborting: the samples cut off (returned, still in flight)."""
        cut = []
        for c in completions:
            gid, sample = self._requests[c.prompt_index]
            t = self.groups[gid].samples[c.sample_index if sample is None else sample]
            if t.finish_reason is not None:  # finished before this request was aborted: already folded in
                continue
            t.extend(c, version=self.version)
            self.stats["sampled_tokens"] += len(c.token_ids)
            if c.finish_reason == "abort":
                self.stats["aborted_samples"] += 1
                cut.append(t)
            else:
                t.finish_reason, t.error = c.finish_reason, c.error
                self._release(t)
                if all(s.finish_reason is not None for s in self.groups[gid].samples):
                    self._complete.append(gid)
        for rid in {c.prompt_index for c in completions}:
            if aborting or self._request_done(rid):
                self._requests.pop(rid, None)
        return cut

    def _release(self, t: Trajectory) -> None:
        """A finished sample's session (kv="keep") frees its slot at once."""
        if self.keep_kv:
            self.engine.release_session(("partial", t.group, t.sample_index))

    def _request_done(self, rid: int) -> bool:
        gid, sample = self._requests[rid]
        samples = self.groups[gid].samples
        return all(t.finish_reason is not None for t in (samples if sample is None else [samples[sample]]))

    def _take_complete(self, limit: int) -> list[list[Trajectory]]:
        taken, self._complete = self._complete[:limit], self._complete[limit:]
        return [self.groups.pop(gid).samples for gid in taken]


__all__ = ["PartialRollouts", "Trajectory"]
