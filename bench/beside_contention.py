"""What slows a decode step run beside training (rollout/beside.py): the GPU the two share, or the interpreter lock?

    python -m bench.beside_contention --model llama-1b --rows 64 --seconds 2

The engine's own decode (its CUDA graphs, a partial rollout of `rows` samples in groups of 8 with 128-token
prompts) runs on DecodeBeside's thread and stream while this thread runs a load on the default stream for
`seconds`, one load after another:

- `none`: the thread sleeps (the decode alone, through the same thread and stream);
- `python`: a pure Python loop (the interpreter lock only, the GPU idle);
- `gemm`: back-to-back 8192^3 bf16 matmuls, never waited for (the GPU only: few launches, a full launch queue);
- `gemm_sync`: the same, each waited for (the lock released while it runs);
- `train`: forward, backward and AdamW of a second copy of the model on `train_tokens` packed tokens, eager (the
  update's many launches, each under the lock).

Each load also runs alone, so the row gives both sides of the sharing: the decode's milliseconds per step beside
the load against alone, and the load's rate beside the decode against alone. Variants (--priorities,
--switch-intervals) repeat the loads with the decode stream's priority and the interpreter's switch interval
changed, and --partitions with the load kept off some SMs: `carveout:N` (the matmuls through cuBLASLt, leaving N
SMs free: torch._C._set_sm_carveout_experimental; cuBLAS ignores it), `green:N` (the load runs on a stream of a
CUDA green context of N SMs). Graphs are captured up front (a first decode of every length alone), so steps beside
replay them (`ungraphed` counts those that did not). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

from bench.common import git_commit, git_tree

LOADS = ("none", "python", "gemm", "gemm_sync", "train")


class Load:
    """One load on this thread's default stream: step() runs one unit of it; rate = units per second."""

    def __init__(self, kind: str, *, model=None, vocab: int = 0, tokens: int = 8192, gemm: int = 8192,
                 device: torch.device):
        self.kind, self.units, self.device = kind, 0, device
        if kind in ("gemm", "gemm_sync"):
            self.a = torch.randn(gemm, gemm, device=device, dtype=torch.bfloat16)
            self.b = torch.randn(gemm, gemm, device=device, dtype=torch.bfloat16)
        if kind == "train":
            self.model = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
            self.ids = torch.randint(3, vocab, (1, tokens), device=device)
            self.pos = torch.arange(tokens, device=device)[None]

    def step(self) -> None:
        if self.kind == "python":
            x = 0
            for i in range(20000):
                x += i
        elif self.kind in ("gemm", "gemm_sync"):
            self.a @ self.b
            if self.kind == "gemm_sync":
                _sync(self.device)
        elif self.kind == "train":
            h = self.model.hidden_states(self.ids, self.pos)
            h.float().pow(2).mean().backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.units += 1

    def run(self, seconds: float) -> float:
        """Units per second over `seconds` (the GPU's queue drained at the end)."""
        if self.kind == "none":
            time.sleep(seconds)
            return 0.0
        self.units, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            self.step()
        _sync(self.device)
        return self.units / (time.perf_counter() - t0)


_GREEN: dict[int, tuple] = {}  # SMs -> (green context, its stream)


@contextlib.contextmanager
def partition(spec: str, device: torch.device):
    """The load's SMs: 'none', 'carveout:N' or 'green:N' (module docstring)."""
    kind, _, n = spec.partition(":")
    if kind == "none":
        yield
    elif kind == "carveout":  # honoured by cuBLASLt only (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET): matmuls go there
        cuda = device.type == "cuda"
        library = torch.backends.cuda.preferred_blas_library()
        if cuda:
            torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(int(n))
        try:
            yield
        finally:
            torch._C._set_sm_carveout_experimental(None)
            if cuda:
                torch.backends.cuda.preferred_blas_library(library)
    elif kind == "green":
        if int(n) not in _GREEN:  # a context must outlive its stream and the memory allocated on it: kept to the end
            context = torch.cuda.GreenContext.create(num_sms=int(n), device_id=device.index or 0)
            _GREEN[int(n)] = (context, context.Stream())
        stream = _GREEN[int(n)][1]
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream(device).wait_stream(stream)
    else:
        raise SystemExit(f"--partitions: {spec!r} is none, carveout:N or green:N")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def start_rows(engine, rollouts, *, rows: int, prompt_len: int, max_tokens: int, vocab: int, seed: int) -> None:
    """rows // 8 groups of 8 samples, prefilled and decoding (nothing left waiting) on return."""
    from rollout.base import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    for g in range(rows // 8):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        rollouts.add_group(prompt, SamplingParams(temperature=1.0, max_tokens=max_tokens, n=8, ignore_eos=True,
                                                  seed=seed * 1000 + g))
    while engine.has_unfinished() and not (engine.is_decoding() and not engine.num_waiting()):
        rollouts.advance()  # the prefill, then decoding


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.beside_contention", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--loads", default=",".join(LOADS))
    ap.add_argument("--train-tokens", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=2048, help="each case's response cap: more than it decodes")
    ap.add_argument("--priorities", default="-100,0", help="decode stream priorities (rollout.beside.STREAM_PRIORITY)")
    ap.add_argument("--switch-intervals", default="0.0005",
                    help="interpreter switch intervals, s (rollout.beside.SWITCH_INTERVAL_S)")
    ap.add_argument("--partitions", default="none", help="the load's SMs: none, carveout:N, green:N (comma-separated)")
    ap.add_argument("--compile", action="store_true", help="the engine's decode forward compiled (rollout.compile)")
    ap.add_argument("--gemm-size", type=int, default=8192)
    ap.add_argument("--device", default="cuda", help="cpu: the mechanics only (tests), no timing worth reading")
    args = ap.parse_args(argv)

    import rollout.beside as beside_mod
    from bench.generate import random_model
    from models import preset_config
    from rollout import NativeEngine, RolloutConfig
    from rollout.beside import DecodeBeside
    from rollout.partial import PartialRollouts

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = random_model(args.model, device=dev, dtype=dtype, seed=0)
    vocab = preset_config(args.model).vocab_size
    loads, cases = args.loads.split(","), []
    # each case starts its rows afresh; every length a case reaches is decoded alone first, so that the steps beside
    # replay captured graphs, as in the trainer
    max_tokens = args.max_tokens
    config = RolloutConfig(max_model_len=args.prompt_len + max_tokens + 1, max_num_seqs=args.rows,
                           max_num_batched_tokens=max(8192, args.prompt_len * args.rows), compile=args.compile,
                           gpu_memory_fraction=0.3, free_memory_on_sleep=False,
                           kv_cache_tokens=None if dev.type == "cuda"
                           else args.rows * (args.prompt_len + max_tokens + 1))
    engine = NativeEngine.from_model(model, config=config)
    warm = PartialRollouts(engine, version=0)
    start_rows(engine, warm, rows=args.rows, prompt_len=args.prompt_len, max_tokens=max_tokens, vocab=vocab, seed=1)
    warm.run_until(groups=args.rows // 8)
    trainee = None
    if "train" in loads:
        trainee = random_model(args.model, device=dev, dtype=dtype, seed=1).train().requires_grad_(True)
    combos = [(int(p), float(s), part) for p in args.priorities.split(",") for s in args.switch_intervals.split(",")
              for part in args.partitions.split(",")]
    load_alone = {}
    for part in dict.fromkeys(c[2] for c in combos):
        for kind in loads:
            load = Load(kind, model=trainee, vocab=vocab, tokens=args.train_tokens, gemm=args.gemm_size, device=dev)
            with partition(part, dev):
                load.run(0.5)  # warm-up
                load_alone[kind, part] = load.run(args.seconds)
    for priority, switch, part in combos:
        beside_mod.STREAM_PRIORITY, beside_mod.SWITCH_INTERVAL_S = priority, switch
        for i, kind in enumerate(loads):
            rollouts = PartialRollouts(engine, version=0)
            start_rows(engine, rollouts, rows=args.rows, prompt_len=args.prompt_len, max_tokens=max_tokens,
                       vocab=vocab, seed=2 + i)
            load = Load(kind, model=trainee, vocab=vocab, tokens=args.train_tokens, gemm=args.gemm_size, device=dev)
            _sync(dev)
            beside = DecodeBeside(rollouts, device=dev)
            with partition(part, dev):
                rate = load.run(args.seconds)
            report = beside.stop()
            steps = max(1.0, report["async/beside_steps"])
            alone = load_alone[kind, part]
            cases.append({"load": kind, "priority": priority, "switch_interval_s": switch, "partition": part,
                          "decode_ms_per_step": report["async/beside_s"] * 1e3 / steps,
                          "decode_steps": report["async/beside_steps"],
                          "rows_per_step": report["async/beside_tokens"] / steps,
                          "ungraphed": report["async/beside_ungraphed_steps"],
                          "finished_early": not engine.is_decoding(),
                          "load_rate": rate, "load_rate_alone": alone,
                          "load_slowdown": alone / rate if rate else None})
            print(json.dumps(cases[-1]), flush=True)
            rollouts.suspend()
    row = {"bench": "beside_contention", "model": args.model, "rows": args.rows, "prompt_len": args.prompt_len,
           "seconds": args.seconds, "compile": args.compile, "max_tokens": max_tokens,
           "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "git_commit": git_commit(),
           "git_tree": git_tree(), "cases": cases}
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
