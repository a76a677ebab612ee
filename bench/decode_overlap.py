"""Does splitting a decode step's rows over CUDA streams overlap its memory-bound attention with its
GEMMs? The engine's own model, KV cache and kernels (llama-1b, bf16, torch.compile'd forward), timed as
CUDA graphs of one decode forward (logits, no sampling):

    python -m bench.decode_overlap --rows 256 --contexts 160,256,384 --splits 1,2,4

`split` s runs the rows as s slices of B / s rows each, every slice on its own stream forked from the
capture stream (s = 1: the engine's step as it is); `serial` runs the same slices one after another on
one stream, so serial - split is what the overlap buys and serial - (s = 1) what the slices cost (each
GEMM reads its weight once per slice). With --share n, rows come in groups of n sharing a 128-token
prompt (the shared-prompt kernel, GRPO's layout), each group inside one slice. Every row sits at the
given context. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.common import git_commit, git_tree
from bench.generate import random_model
from rollout import NativeEngine, RolloutConfig
from rollout.shared_prefix import shared_prefix_tables


class Slice:
    """Rows [lo, lo + n) of the engine's cache as a decode batch of their own (cache view, shared tables)."""

    def __init__(self, runner, lo: int, n: int, *, share: int, plen: int, ctx: int):
        dev = runner.device
        self.runner, self.n = runner, n
        self.cache = runner.cache.data[:, :, lo:]
        self.ids = torch.randint(0, runner.cfg.vocab_size, (n,), device=dev)
        self.pos = torch.full((n,), ctx, dtype=torch.int64, device=dev)
        self.kv_index = torch.arange(ctx + 1, device=dev)
        self.prefix = None
        if share:
            groups = [(plen, list(range(g, g + share))) for g in range(0, n, share)]
            tables = shared_prefix_tables(groups, rows=n, members_per_entry=runner.prefix_members)
            row_prefix, row_entry, members, group_len = (t.to(dev) for t in tables)
            counts = torch.zeros(members.shape[0], runner.cfg.num_key_value_heads, dtype=torch.int32, device=dev)
            self.prefix = (row_prefix, row_entry, members, group_len, counts)

    def forward(self, ids, pos, kv_index, cache, prefix):
        return self.runner.decode_forward(ids, pos, kv_index, cache, prefix=prefix, mode="triton")


def capture(slices, fn, *, streams: bool) -> torch.cuda.CUDAGraph:
    main = torch.cuda.Stream()
    side = [torch.cuda.Stream() for _ in slices]

    def run():
        for s, st in zip(slices, side, strict=True):
            if streams:
                st.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(st):
                    fn(s, s.ids, s.pos, s.kv_index, s.cache, s.prefix)
            else:
                fn(s, s.ids, s.pos, s.kv_index, s.cache, s.prefix)
        if streams:
            for st in side:
                torch.cuda.current_stream().wait_stream(st)

    main.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(main):
        run()
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=main):
            run()
    torch.cuda.current_stream().wait_stream(main)
    return graph


def time_graph(graph, reps: int) -> float:
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[1]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--contexts", default="160,256,384")
    p.add_argument("--splits", default="1,2,4")
    p.add_argument("--share", type=int, default=8, help="rows per shared prompt (0: none)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args(argv)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    contexts = [int(c) for c in args.contexts.split(",")]
    model = random_model(args.model, device=dev, dtype=dtype, seed=0)
    config = RolloutConfig(max_num_seqs=args.rows, max_model_len=max(contexts) + 2, decode_attention="triton",
                           share_prompt_kv=bool(args.share), compile=True)
    runner = NativeEngine.from_model(model, config=config).runner
    runner.finish_loading()  # as generate() does before its first forward (folds the norm weights)
    fn = torch.compile(Slice.forward, dynamic=True)
    out = []
    for ctx in contexts:
        row = {"context": ctx}
        for s in (int(x) for x in args.splits.split(",")):
            n = args.rows // s
            slices = [Slice(runner, i * n, n, share=args.share, plen=args.prompt_len, ctx=ctx) for i in range(s)]
            for mode, streams in (("streams", True), ("serial", False)) if s > 1 else (("one", False),):
                try:
                    ms = time_graph(capture(slices, fn, streams=streams), args.reps)
                    row[f"split{s}_{mode}_ms"] = round(ms, 4)
                except Exception as e:  # noqa: BLE001 - report and go on with the next variant
                    row[f"split{s}_{mode}_error"] = f"{type(e).__name__}: {e}"[:300]
                print(json.dumps({"partial": True, **row}), file=sys.stderr, flush=True)
        out.append(row)
    result = {"bench": "decode_overlap", "model": args.model, "rows": args.rows, "share": args.share,
              "prompt_len": args.prompt_len, "device_name": torch.cuda.get_device_name(), "git": git_commit(),
              "git_tree": git_tree(), "results": out}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
