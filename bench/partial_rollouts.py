"""The long tail of generation, synchronous vs over-provisioned partial rollouts (rollout/partial.py), on one GPU.

    python -m bench.partial_rollouts --model llama-1b --device cuda --dtype bfloat16 \
        --prompts 32 --n 8 --prompt-len 128 --max-tokens 4096 --steps 6 --warmup 1 --over 2 --max-staleness 1
    python -m bench.partial_rollouts --model tiny --device cpu --prompts 4 --n 2 --prompt-len 8 \
        --max-tokens 48 --steps 3 --warmup 1                              # CPU check of the mechanics

A heavy-tailed GRPO generation workload: each group (one prompt, n samples) gets a length cap drawn from a
log-normal (median --median-tokens, --sigma) clipped to [16, --max-tokens], and ignore_eos, since random weights
never stop early. Two modes, the same groups in the same order:

- sync: every step generates --prompts fresh groups to the end (engine.generate): the step waits for its
  longest group, the engine decoding fewer and fewer rows meanwhile;
- partial: --over x --prompts groups in flight; every step hands over the first --prompts complete groups (the
  due ones first: admitted at least --max-staleness versions ago, waited for), refills as many new groups,
  then swaps the weights (the same tensors, version + 1: an update's cost without a trainer), so the
  unfinished groups continue as partial rollouts with their KV recomputed under the "new" weights (or, with
  --partial-kv keep, continued from the KV they have: one token prefilled each, rollout.partial_kv=keep).

--train-s adds that many seconds per step to both modes (the rest of a PPO step, e.g. the update measured by
bench.placement; default 0: generation alone). Reported per mode, after --warmup steps: samples/s (delivered
samples over wall time), tokens delivered per decode step (how full the decode batches ran: the tail), and for
partial the staleness of the delivered groups (delivery version - admission version: mean, max), tokens recomputed at
swaps, and the speed-up over sync. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

import torch

from bench.generate import random_model
from rollout import NativeEngine, RolloutConfig, SamplingParams
from rollout.partial import PartialRollouts


def length_caps(count: int, *, median: int, sigma: float, max_tokens: int, seed: int) -> list[int]:
    """Per-group caps from a log-normal with the given median, clipped to [16, max_tokens]."""
    rng = random.Random(seed)
    return [int(min(max_tokens, max(16, rng.lognormvariate(math.log(median), sigma)))) for _ in range(count)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _groups(args, count: int, *, vocab: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    caps = length_caps(count, median=args.median_tokens, sigma=args.sigma, max_tokens=args.max_tokens, seed=seed)
    return [([rng.randrange(3, vocab) for _ in range(args.prompt_len)],
             SamplingParams(temperature=1.0, max_tokens=cap, n=args.n, seed=seed + i, ignore_eos=True))
            for i, cap in enumerate(caps)]


def run_sync(engine, groups, args, device, *, weights) -> dict:
    delivered, t0 = 0, None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            _sync(device)
            t0, engine.stats["decode_steps"], rows0 = time.perf_counter(), 0, 0
        batch = groups[step * args.prompts:(step + 1) * args.prompts]
        outs = engine.generate([p for p, _ in batch], [s for _, s in batch])
        time.sleep(args.train_s)
        if step >= args.warmup:
            delivered += len(outs)
            rows0 += sum(len(c.token_ids) for c in outs)
    _sync(device)
    wall = time.perf_counter() - t0
    return {"samples_per_s": delivered / wall, "wall_s": wall, "samples": delivered,
            "tokens_per_decode_step": rows0 / max(1, engine.stats["decode_steps"])}


def run_partial(engine, groups, args, device, *, weights) -> dict:
    """weights: the HF-named tensors every swap loads (an update's transfer, without a trainer)."""
    rollouts = PartialRollouts(engine, version=0, kv=args.partial_kv)
    in_flight, nxt = math.ceil(args.over * args.prompts), 0
    for prompt, params in groups[:in_flight]:
        rollouts.add_group(prompt, params)
    nxt = in_flight
    delivered, tokens, gaps, t0 = 0, 0, [], None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            _sync(device)
            t0, engine.stats["decode_steps"] = time.perf_counter(), 0
            recomputed0 = rollouts.stats["recomputed_tokens"]
            reused0, prefilled0 = engine.stats["kv_reused_tokens"], engine.stats["prefill_tokens"]
        due = step - args.max_staleness + 1  # admitted before it: trained at `step` at most K versions late
        done = rollouts.run_until(groups=args.prompts, due_before=due)
        for prompt, params in groups[nxt:nxt + len(done)]:
            rollouts.add_group(prompt, params)
        nxt += len(done)
        time.sleep(args.train_s)
        rollouts.swap_weights(weights, version=step + 1)
        if step >= args.warmup:
            delivered += sum(len(g) for g in done)
            tokens += sum(len(t.token_ids) for g in done for t in g)
            gaps += [step - min(t.versions[0] for t in g) for g in done]
    _sync(device)
    wall = time.perf_counter() - t0
    return {"samples_per_s": delivered / wall, "wall_s": wall, "samples": delivered,
            "tokens_per_decode_step": tokens / max(1, engine.stats["decode_steps"]),
            "staleness_mean": sum(gaps) / max(1, len(gaps)), "staleness_max": max(gaps, default=0),
            "recomputed_tokens": rollouts.stats["recomputed_tokens"] - recomputed0,
            "prefill_tokens": engine.stats["prefill_tokens"] - prefilled0,
            "kv_reused_tokens": engine.stats["kv_reused_tokens"] - reused0,
            "in_flight_groups": in_flight}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=32, help="groups per step (data.batch_size)")
    ap.add_argument("--n", type=int, default=8, help="samples per group (rollout.n)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--median-tokens", type=int, default=256)
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the caps (the tail's weight)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--over", type=float, default=2.0, help="groups in flight / groups per step (partial)")
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--train-s", type=float, default=0.0, help="seconds added per step (the rest of the step)")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--gpu-memory-fraction", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--partial-kv", choices=("recompute", "keep"), default="recompute",
                    help="at a swap: re-prefill the samples in flight, or keep their KV (rollout.partial_kv)")
    args = ap.parse_args(argv)
    if args.over < 1 or args.max_staleness < 1:
        ap.error("--over must be >= 1 and --max-staleness >= 1")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    model = random_model(args.model, device=device, dtype=dtype, seed=args.seed)
    max_len = args.prompt_len + args.max_tokens
    config = RolloutConfig(max_model_len=max_len, max_num_seqs=args.max_num_seqs,
                           gpu_memory_fraction=args.gpu_memory_fraction, max_num_batched_tokens=max(16384, max_len),
                           kv_cache_tokens=None if device.type == "cuda" else args.max_num_seqs * max_len)
    total = math.ceil(args.over * args.prompts) + (args.warmup + args.steps) * args.prompts
    groups = _groups(args, total, vocab=model.config.vocab_size, seed=args.seed)
    row = {"bench": "partial_rollouts", "model": args.model, "device": torch.cuda.get_device_name(device)
           if device.type == "cuda" else "cpu", "dtype": str(dtype).removeprefix("torch."),
           "args": {k: v for k, v in vars(args).items() if k not in ("device", "dtype", "model")}}
    for mode, run in (("sync", run_sync), ("partial", run_partial)):
        engine = NativeEngine.from_model(model, config=config)
        out = run(engine, groups, args, device, weights=list(model.state_dict().items()))
        row[mode] = {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    row["speedup"] = round(row["partial"]["samples_per_s"] / row["sync"]["samples_per_s"], 3)
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
