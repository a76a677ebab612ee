"""What over-provisioned partial rollouts can gain on the heavy-tailed workload at best (issue 41): a step-level model
of synchronous GRPO and of the partial scheduler's policy, with nothing lost to recompute, engine wake-ups or host
work, so the ratio it gives is a ceiling for `bench.heavy_tail`'s measured one.

    python -m bench.heavy_tail_model [--staleness 1] [--groups-in-flight 64] [--median-tokens 256] [--sigma 1]
    python -m bench.heavy_tail_model --grid 64,128,256:1,1.5,2     # the ceiling across log-normal workloads

A decode step of R rows over T cached tokens takes max(floor, (weights + T x KV bytes per token) / bandwidth); the
training stages of a step take --train-s. The defaults are llama-1b's bytes and bench.heavy_tail's workload (32
prompts x 8 samples, 129-token prompts, per-prompt caps log-normal median 256, sigma 1, up to 3,967 tokens), with
floor and bandwidth calibrated on the synchronous H200 run of bench/results/heavy_tail_h200.json (44.9 samples/s,
step 5.70 s, generation 3.5 s: the model gives 45.3 and 5.66 s) and its update + reference + advantages (2.2 s).

Synchronous: every step decodes its groups until the longest ends. Partial (rollout.batches_in_flight x
data.batch_size = --groups-in-flight groups): each step refills to that many groups, decodes until the groups
admitted --staleness steps ago are complete (pacing) and data.batch_size groups are, and trains data.batch_size of
them, oldest first, none older than --staleness versions (asserted). --grid MEDIANS:SIGMAS models each log-normal
workload of the grid, its training time scaled from --train-s by its mean response length (the update and reference
passes are per token). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys


class StepModel:
    def __init__(self, *, weights_bytes: float = 2.47e9, kv_bytes_per_token: int = 32768,
                 hbm_bytes_per_s: float = 2.5e12, floor_s: float = 1.5e-3, prompt_len: int = 129,
                 samples_per_prompt: int = 8, groups: int = 32,
                 train_s: float = 2.2, median: int = 256, sigma: float = 1.0, max_tokens: int = 3967):
        self.w, self.kvb, self.bw, self.floor = weights_bytes, kv_bytes_per_token, hbm_bytes_per_s, floor_s
        self.p, self.n, self.b, self.train_s = prompt_len, samples_per_prompt, groups, train_s
        self.median, self.sigma, self.max_tokens = median, sigma, max_tokens

    def decode_s(self, groups_tokens: list[int]) -> float:
        """One decode step of these groups (each: its tokens generated so far)."""
        kv = sum((self.p + t) * self.n for t in groups_tokens)
        return max(self.floor, (self.w + kv * self.kvb) / self.bw) if groups_tokens else 0.0

    def mean_tokens(self, draws: int = 20000) -> float:
        """The mean response length of this workload's caps."""
        rng = random.Random(12345)
        return sum(self.cap(rng) for _ in range(draws)) / draws

    def cap(self, rng: random.Random) -> int:
        return min(self.max_tokens, max(16, int(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)))))

    def sync(self, steps: int, seed: int = 0, slots: int | None = None) -> float:
        """Mean step seconds of synchronous GRPO. slots: the engine's decode rows (None: every sample at once);
        groups beyond them wait for a finished group's rows, in order."""
        rng, total = random.Random(seed), 0.0
        for _ in range(steps):
            caps = [self.cap(rng) for _ in range(self.b)]
            total += self.train_s
            if slots is None:
                total += sum(self.decode_s([s] * sum(c > s for c in caps)) for s in range(max(caps)))
                continue
            waiting, running, complete = [[c, 0, 0] for c in caps], [], []
            while waiting or running:
                room = self.rows(slots) - len(running)
                running, waiting = running + waiting[:room], waiting[room:]
                total += self.decode_s([g[1] for g in running])
                running = _decode_step(running, complete)
        return total / steps

    def rows(self, slots: int | None) -> int:
        """Groups that decode at once in `slots` decode rows (a group's samples end together: one cap)."""
        return sys.maxsize if slots is None else max(1, slots // self.n)

    def partial(self, steps: int, *, in_flight: int, staleness: int, seed: int = 0,
                overlap: tuple[float, float] | None = None, due_only: bool = False,
                slots: int | None = None) -> tuple[float, float]:
        """(mean step seconds, mean seconds a step decodes past its first data.batch_size complete groups: pacing).
        overlap (decode_slow, train_slow): the groups in flight keep decoding while the trainer updates, as
        rollout.decode_beside does (on the same GPU, beside it: decode steps
        decode_slow x longer, the update train_slow x longer) with the weights before the update; none is
        admitted meanwhile (it would count a version older against the bound). due_only: once data.batch_size groups
        are complete, only the due groups decode (the others wait), so the due tail runs at the small batch's
        step time (a policy not built). slots: as in sync(); the groups in flight take the rows oldest first."""
        if in_flight > 2 * self.b:  # as the trainer: more batches in flight could leave groups staler than the bound
            raise ValueError(f"{in_flight} groups in flight: at most 2 x {self.b} (rollout.batches_in_flight <= 2 "
                             f"with pacing)")
        rng, running, complete, total, paced = random.Random(seed), [], [], 0.0, 0.0
        for k in range(steps):
            while len(running) + len(complete) < in_flight:
                running.append([self.cap(rng), 0, k])  # cap, tokens so far, step admitted
            while running and (len(complete) < self.b or any(g[2] <= k - staleness for g in running)):
                pacing = len(complete) >= self.b
                active, rest = running, []
                if due_only and pacing:
                    due = k - staleness
                    active, rest = [g for g in running if g[2] <= due], [g for g in running if g[2] > due]
                if len(active) > self.rows(slots):  # the rows are full: the youngest wait
                    rest, active = rest + active[self.rows(slots):], active[: self.rows(slots)]
                dt = self.decode_s([g[1] for g in active])
                total += dt
                paced += dt if pacing else 0.0
                running = _decode_step(active, complete) + rest
            complete.sort(key=lambda g: g[2])
            trained, complete = complete[:self.b], complete[self.b:]
            assert all(k - g[2] <= staleness for g in trained), "a trained group is staler than the bound"
            if overlap is None:
                total += self.train_s
                continue
            decode_slow, train_slow = overlap  # no refill here: new groups would be a version older when trained
            update_s, t = self.train_s * train_slow, 0.0
            # the rows decoding when the update starts (rollout.beside: nothing is admitted while it runs)
            active, rest = running[: self.rows(slots)], running[self.rows(slots):]
            while active and t < update_s:
                t += self.decode_s([g[1] for g in active]) * decode_slow
                active = _decode_step(active, complete)
            running = active + rest
            total += update_s
        return total / steps, paced / steps


def _decode_step(running: list[list[int]], complete: list[list[int]]) -> list[list[int]]:
    """One token for every running group ([cap, tokens so far, step admitted]); those that reach their cap move
    to `complete` (in place). -> the groups still running."""
    for g in running:
        g[1] += 1
    complete += [g for g in running if g[1] >= g[0]]
    return [g for g in running if g[1] < g[0]]


def grid(a) -> dict:
    """The staleness-bound ceiling of each log-normal workload of a.grid (synchronous and partial, as main())."""
    medians, sigmas = ([float(x) for x in part.split(",")] for part in a.grid.split(":"))
    base = StepModel(median=a.median_tokens, sigma=a.sigma).mean_tokens()
    rows = []
    for median in medians:
        for sigma in sigmas:
            mean = StepModel(median=int(median), sigma=sigma).mean_tokens()
            m = StepModel(median=int(median), sigma=sigma, train_s=a.train_s * mean / base)
            sync_s = m.sync(a.steps, slots=a.slots)
            part_s, _ = m.partial(a.steps, in_flight=a.groups_in_flight, staleness=a.staleness, seed=1,
                                  slots=a.slots)
            rows.append({"median_tokens": int(median), "sigma": sigma, "mean_tokens": round(mean, 1),
                         "train_s": round(m.train_s, 3), "sync_step_s": round(sync_s, 3),
                         "partial_step_s": round(part_s, 3), "ceiling_speedup": round(sync_s / part_s, 3)})
    out = {"bench": "heavy_tail_model", "grid": a.grid, "staleness": a.staleness,
           "groups_in_flight": a.groups_in_flight, "train_s_at": {"median_tokens": a.median_tokens, "sigma": a.sigma,
                                                                  "train_s": a.train_s}, "rows": rows,
           "best": max(rows, key=lambda r: r["ceiling_speedup"])}
    print(json.dumps(out))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.heavy_tail_model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--groups-in-flight", type=int, default=64)
    ap.add_argument("--median-tokens", type=int, default=256)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--train-s", type=float, default=2.2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--overlap", default=None, metavar="DECODE_SLOW:TRAIN_SLOW",
                    help="model decoding beside the update (a policy not built): decode steps and the update that "
                         "much slower while they share the GPU, e.g. 2:1.1")
    ap.add_argument("--slots", type=int, default=None,
                    help="the engine's decode rows (default: every sample at once); the H100 heavy tail had ~138")
    ap.add_argument("--due-only", action="store_true",
                    help="model pacing that decodes only the due groups (a policy not built)")
    ap.add_argument("--grid", default=None, metavar="MEDIANS:SIGMAS",
                    help="e.g. 64,128,256:1,1.5,2: every workload of the grid, training time scaled by mean length")
    a = ap.parse_args(argv)
    if a.grid:
        return grid(a)
    overlap = tuple(float(x) for x in a.overlap.split(":")) if a.overlap else None
    m = StepModel(median=a.median_tokens, sigma=a.sigma, train_s=a.train_s)
    sync_s = m.sync(a.steps, slots=a.slots)
    part_s, paced_s = m.partial(a.steps, in_flight=a.groups_in_flight, staleness=a.staleness, seed=1, overlap=overlap,
                                 due_only=a.due_only, slots=a.slots)
    samples = m.b * m.n
    out = {"bench": "heavy_tail_model", "staleness": a.staleness, "groups_in_flight": a.groups_in_flight,
           "median_tokens": a.median_tokens, "sigma": a.sigma, "train_s": a.train_s, "overlap": overlap,
           "due_only": a.due_only, "slots": a.slots,
           "sync_samples_per_s": round(samples / sync_s, 2), "sync_step_s": round(sync_s, 3),
           "partial_samples_per_s": round(samples / part_s, 2), "partial_step_s": round(part_s, 3),
           "partial_paced_s": round(paced_s, 3), "ceiling_speedup": round(sync_s / part_s, 3)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
