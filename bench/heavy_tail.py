"""GRPO with heavy-tailed response lengths on one GPU: synchronous vs over-provisioned partial rollouts (issue 41).

    python -m bench.heavy_tail --modes colocated-sync          # one H200: 107 s at d4c1bd2
    python -m bench.heavy_tail --modes colocated-partial       # 217 s at d4c1bd2 (two steps compiled in generation)
    python -m bench.heavy_tail --modes colocated-partial-drop  # partial, trainer.stale_policy=drop
    python -m bench.heavy_tail --modes colocated-partial-beside  # partial, decoding beside the update
    python -m bench.heavy_tail --modes colocated-sync,colocated-partial --steps 3 --max-tokens 64 \
        --config conf/grpo_tiny.yaml --nproc 1 trainer.device=cpu model.dtype=float32   # CPU check

The workload is conf/bench_grpo_1b.yaml (GRPO, llama-1b shape, random weights, 32 prompts x 8 samples) with its
prompts written to a JSONL file whose `max_response_length` column caps each prompt's responses (ppo/roles/
generation.response_cap): caps drawn from a log-normal (median --median-tokens, sigma --sigma) clipped to
[16, --max-tokens] (3,967: the prompt and the longest response fill llama-1b's 4,096-token context), since random
weights never stop early. Each mode is a bench.placement mode run on it
(colocated-sync: every step waits for its longest response; colocated-partial: rollout.batches_in_flight=2 at
trainer.max_staleness=1, the first complete groups trained, the rest continue). The issue's target: partial at
>= 1.5x the samples/s of sync, async/staleness_max <= 1. Extra key=value overrides go to every run. The last
stdout line is bench.placement's JSON row with this workload's settings added.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from bench.partial_rollouts import length_caps


def write_prompts(path: Path, *, count: int, prompt_len: int, median: int, sigma: float, max_tokens: int,
                  seed: int) -> list[int]:
    """`count` JSONL rows: a random letter string of prompt_len - 1 letters and '=', its first letter as the
    answer (bench_grpo_1b's random task), and a log-normal length cap. -> the caps."""
    rng = random.Random(seed)
    caps = length_caps(count, median=median, sigma=sigma, max_tokens=max_tokens, seed=seed)
    with open(path, "w") as f:
        for cap in caps:
            s = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(prompt_len - 1))
            f.write(json.dumps({"prompt": s + "=", "ground_truth": s[0], "max_response_length": cap}) + "\n")
    return caps


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.heavy_tail", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="conf/bench_grpo_1b.yaml")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--modes", default="colocated-sync,colocated-partial")
    ap.add_argument("--steps", type=int, default=5, help="trainer.total_steps (the first --warmup not measured)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=1024, help="rows of the prompt file")
    ap.add_argument("--prompt-len", type=int, default=128)
    # llama-1b's context is 4,096 tokens: a 129-token prompt leaves responses up to 3,967 (the launcher refuses
    # prompt + response lengths past the model's context)
    ap.add_argument("--max-tokens", type=int, default=3967)
    ap.add_argument("--median-tokens", type=int, default=256)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs-dir", default=None, help="keep the run directories here (metrics.jsonl: async/* per step)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    from bench.placement import main as placement

    with tempfile.TemporaryDirectory(prefix="hybridrl_tail_") as tmp:
        data = Path(tmp) / "prompts.jsonl"
        caps = write_prompts(data, count=args.prompts, prompt_len=args.prompt_len, median=args.median_tokens,
                             sigma=args.sigma, max_tokens=args.max_tokens, seed=args.seed)
        overrides = [f"data.train_files={data}", "data.task=none", f"data.max_prompt_length={args.prompt_len + 1}",
                     f"rollout.max_response_length={args.max_tokens}", f"trainer.total_steps={args.steps}",
                     f"reward.function=builtin:task:random:{args.prompt_len}", *args.overrides]
        row = placement(["--config", args.config, "--nproc", str(args.nproc), "--modes", args.modes,
                         "--warmup", str(args.warmup), *(["--runs-dir", args.runs_dir] if args.runs_dir else []),
                         *overrides])
    row["heavy_tail"] = {"median_tokens": args.median_tokens, "sigma": args.sigma, "max_tokens": args.max_tokens,
                         "mean_cap": sum(caps) / len(caps), "max_cap": max(caps)}
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
