"""Turn a GPU batch's summary (bench/gpu_suite.sh) into bench/results/*.json records.

    python -m bench.collect_results /work/.device/N/summary.jsonl --device "2x NVIDIA H200" \
        --commit <git sha the batch ran> [--suffix h200x2] [--env "EXTRA=..."]

Each record keeps the exact command (from gpu_suite.sh's part table), the device, the date, the
commit and the benchmark's own JSON line, so every number in docs/results.md can be traced.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

COMMANDS = {
    "env": "python -m bench.env_check",
    "tests": "python -m pytest -q -m gpu $TESTS",
    "decode_attention": "python -m bench.decode_attention --batches 32,64,256 --contexts 256,384",
    "train_step": "python -m bench.train_step --model llama-1b --seq 2048 --batch 4 --sweep",
    "generate": "python -m bench.generate --model llama-1b --prompt-len 128 --new-tokens 256 --engine $GEN_ENGINE "
                "--batches 32,64,256 --hf-cache dynamic --native-variants $GEN_VARIANTS",
    "reshard": "torchrun --nproc_per_node 2 -m bench.reshard --model llama-1b --train-tp 2 --gen-tp 1 --verify "
               "--device cuda",
    "grpo_a": "python -m bench.placement --config conf/bench_grpo_1b.yaml --nproc 1 --warmup 3 --modes $GRPO_MODES "
              "$EXTRA",
    "grpo_long": "python -m bench.placement --config conf/bench_grpo_1b.yaml --nproc 1 --warmup 2 "
                 "--modes colocated-sync data.task=random:256 data.max_prompt_length=256 "
                 "rollout.max_response_length=1024 trainer.total_steps=5 "
                 "actor.max_tokens_per_micro_batch=36864 ref.max_tokens_per_micro_batch=36864 $EXTRA",
    "ppo_1gpu": "python -m bench.ppo_step --config conf/bench_ppo_1b.yaml --nproc 1 $EXTRA",
    "placement_b": "python -m bench.placement --config conf/bench_ppo_1b.yaml --nproc 2 --warmup $PLACEMENT_WARMUP "
                   "--modes <mode> $EXTRA",
}


def command_of(part: str) -> str:
    """The command of a summary part; suffixed parts (grpo_a_noshare, placement_b_split-sync) share a base."""
    for base in sorted(COMMANDS, key=len, reverse=True):
        if part == base or part.startswith(base + "_"):
            cmd = COMMANDS[base]
            return cmd.replace("<mode>", part[len(base) + 1:].replace("_", "+")) if "<mode>" in cmd else cmd
    return part


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.collect_results")
    ap.add_argument("summary")
    ap.add_argument("--device", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--suffix", default="h200")
    ap.add_argument("--env", default="", help="the environment knobs of the batch (EXTRA=..., ...)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for line in Path(args.summary).read_text().splitlines():
        d = json.loads(line)
        if d["result"] is None:
            print(f"{d['part']}: rc={d['rc']}, no JSON result; not recorded")
            continue
        if isinstance(d["result"], dict) and "git_commit" in d["result"]:
            d["result"]["git_commit"] = args.commit  # the device's copy may carry a stale .git
        rec = {"command": command_of(d["part"]), "env": args.env, "device": args.device,
               "date": datetime.date.today().isoformat(), "git_commit": args.commit, "rc": d["rc"],
               "seconds": d["seconds"], "result": d["result"]}
        path = out / f"{d['part']}_{args.suffix}.json"
        path.write_text(json.dumps(rec, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
