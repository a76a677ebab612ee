"""Host-side packing of one PPO micro-batch (ppo/batch/packing.py): milliseconds per pack.

    python -m bench.pack                              # GRPO workload (a)'s shape: 8 groups x 8, on CPU
    python -m bench.pack --groups 14                  # a full 16384-token actor micro-batch (shared prompts)
    python -m bench.pack --device cuda                # + the one pinned host->device copy, synchronised
    OMP_NUM_THREADS=1 python -m bench.pack --groups 32 --steps 50 --warmup 5 --full-length   # GRPO (a), no early stops

Shape: `groups` prompts of `prompt_len` tokens, each with `group_size` responses of uniform random
length 1..max_response (seed 0), or all of max_response tokens with --full-length (a random policy
rarely stops early, so the real workload's responses are mostly full). Timed, median of --steps
after --warmup: the workers' path (`pack_prompt_responses` from token lists, as
ppo.batch.experience.Sample holds them) with shared prompts and without, and `pack()` over per-sequence
tensors. Before the vectorised packer (commit 10a6d45) the same shape took 6.5 ms (shared) /
1.6 ms (unshared) on the 2-core dev CPU.
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from bench.common import add_device_args, emit_json, resolve_device, run_info, time_steps
from ppo.batch.packing import pack, pack_prompt_responses


def workload(*, groups: int, group_size: int, prompt_len: int, max_response: int, full_length: bool = False,
             vocab: int = 32000):
    """(prompts, responses) token lists; a group's samples share one prompt list, as generation makes them."""
    rng = random.Random(0)
    prompts, responses = [], []
    for _ in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        for _ in range(group_size):
            prompts.append(prompt)
            n = max_response if full_length else rng.randint(1, max_response)
            responses.append([rng.randrange(3, vocab) for _ in range(n)])
    return prompts, responses


def main() -> None:
    ap = add_device_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-response", type=int, default=256)
    ap.add_argument("--full-length", action="store_true", help="every response max_response tokens long")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    device, _ = resolve_device(args)
    prompts, responses = workload(groups=args.groups, group_size=args.group_size, prompt_len=args.prompt_len,
                                  max_response=args.max_response, full_length=args.full_length)
    tensors = [torch.tensor(p + r) for p, r in zip(prompts, responses)]
    plens = [len(p) for p in prompts]
    cases = {
        "shared_ms": lambda: pack_prompt_responses(prompts, responses, pad_id=0, device=device, share_prompts=True),
        "unshared_ms": lambda: pack_prompt_responses(prompts, responses, pad_id=0, device=device),
        "tensors_shared_ms": lambda: pack(tensors, pad_id=0, prompt_lens=plens, device=device, share_prompts=True),
    }
    out = {"bench": "pack", "samples": len(prompts), "full_length": args.full_length,
           "tokens_shared": cases["shared_ms"]().num_tokens, "tokens_unshared": cases["unshared_ms"]().num_tokens}
    for name, fn in cases.items():
        times = time_steps(fn, device=device, warmup=args.warmup, steps=args.steps)
        out[name] = round(statistics.median(times) * 1e3, 4)
    emit_json({**out, **run_info(device)})


if __name__ == "__main__":
    main()
