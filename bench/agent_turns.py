"""Multi-turn agent rollouts vs single-turn generation at the same generated tokens, with a sleeping tool.

    python -m bench.agent_turns --model qwen3-0.6b --trajectories 256 --turn-tokens 128 --turns 3 \
        --tool-delay-ms 200 --device cuda --dtype bfloat16
    python -m bench.agent_turns --model qwen3-0.6b --trajectories 1024 --max-num-seqs 256 --tool-workers 1024 \
        --turn-tokens 128 --turns 3 --tool-delay-ms 200 --device cuda --dtype bfloat16   # an RL step's queue
    python -m bench.agent_turns --model tiny --device cpu --trajectories 8 --turn-tokens 8 --tool-delay-ms 20
    python -m bench.agent_turns --model tiny --device cpu --dtype float32 --trajectories 256 --max-num-seqs 64 \
        --tool-workers 256 --turns 3 --turn-tokens 64 --prompt-len 32 --obs-tokens 16 --tool-delay-steps 45

Random-init weights (bench.generate.random_model), random prompts, ignore_eos. Each trajectory runs `--turns`
assistant turns through the agent driver (ppo/agents/driver.py) over the native engine's step API; turn
lengths are drawn in [T/2, 3T/2] so tool calls do not all fall on the same step; between turns a tool sleeps
`--tool-delay-ms` in the driver's thread pool (or, with `--tool-delay-steps K`, until the engine has taken K steps:
StepClock, for scheduling comparisons independent of the machine's step time, e.g. on a CPU) and returns
`--obs-tokens` observation tokens. The single-turn
baseline generates each trajectory's total sampled tokens in one turn (engine.generate). The multi-turn run is
measured in each of `--modes`: `keep` (agent.keep_kv=true: a trajectory's KV stays in the engine while its tool
sleeps, the next turn prefills only its new tokens) and `reprefill` (every turn prefills its whole context).
Each mode is timed after one untimed multi-turn pass (CUDA graphs of its decode shapes captured before either
mode is measured). Reported: single-turn generated tokens/s, and per mode (keys prefixed `keep_` / `reprefill_`):
tokens/s and its ratio to single-turn (none on the step clock), generated tokens per decode step
(rows_per_decode_step), the ratio's target: >= 0.8; critical_path_over_single: the ratio when
continuations cost nothing and decode steps what single-turn's did, single-turn's time plus the longest trajectory's
(turns - 1) tool calls, with every trajectory in the slots at once; an estimate, not a bound: steps of fewer rows
run faster), prefilled tokens (all, and per later turn: what turns 2..T prefilled, per trajectory and turn), tokens
the kept KV spared, parked KV evicted for room and turns that re-prefilled anyway, parked KV copied between decode
and park slots (kv_relocations; --max-parked-seqs), the engine steps taken while a
tool slept, busy_while_tools: the share of the wall time the tools slept in which the engine had decode work (1 -
the time the driver waited with nothing to decode / the time some tool was sleeping), the engine's prefill and
decode steps and the seconds inside each (NativeEngine.stats; single-turn's steps too), compiled_graphs: the graphs
torch.compile built in the timed pass (--compile; 0 unless a new shape recompiled), decode_graphs_captured: the
decode CUDA graphs captured in it (0 unless a new decode shape came up), and driver_host_ms_per_step: the wall time
outside the engine's steps and tool waits (the driver's and the loops' Python) per engine step. One JSON line.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import json
import random
import threading
import time

import torch
from torch._dynamo.utils import counters

from bench.common import kernel_profile, synchronize
from bench.generate import random_model
from launcher.dist import limit_host_threads
from models import preset_config
from ppo.agents.driver import Start, ToolPool, drive
from ppo.agents.loop import AgentTask, CallTool, Generate, TrajectoryBuilder
from rollout import NativeEngine, RolloutConfig, SamplingParams

STEP_STATS = ("prefill_steps", "decode_steps", "slot_moves", "device_drains")  # NativeEngine.stats per pass
PREFILL_KINDS = ("prefill_fresh_s", "prefill_continue_s", "prefill_fresh_rows", "prefill_continue_rows",
                 "prefill_continue_waves", "prefill_fresh_tokens", "prefill_fresh_padded", "prefill_continue_tokens",
                 "prefill_continue_padded")


class StepClock:
    """Engine steps as the tools' clock (--tool-delay-steps): a tool returns once the engine has taken that many
    steps since its call, so how full the decode rows run no longer depends on how fast this machine steps (on a CPU
    the scheduling comparisons are then repeatable). One watcher thread reads the engine's step count every 0.2 ms
    and wakes the tools whose time has come (the tools block on events: a thousand of them polling would starve
    the engine's own thread); while the engine has nothing to run (every trajectory in a tool) the clock ticks on
    its own every 0.5 ms, so the earliest caller still returns first. close() stops the watcher."""

    def __init__(self, engine):
        self.engine, self.idle_ticks, self.lock = engine, 0, threading.Lock()
        self.due: list[tuple[int, int, threading.Event]] = []  # (deadline, call number, event), a heap
        self.calls = itertools.count()
        self.closed = threading.Event()
        self.watcher = threading.Thread(target=self._watch, daemon=True, name="step-clock")
        self.watcher.start()

    def close(self) -> None:
        self.closed.set()
        self.watcher.join()

    def now(self) -> int:
        return self.engine.stats["decode_steps"] + self.engine.stats["prefill_steps"] + self.idle_ticks

    def wait(self, steps: int) -> None:
        event = threading.Event()
        with self.lock:
            heapq.heappush(self.due, (self.now() + steps, next(self.calls), event))
        event.wait()

    def _watch(self) -> None:
        last_tick = time.perf_counter()
        while not self.closed.wait(2e-4):
            with self.lock:
                if not self.due:
                    continue
                t = time.perf_counter()
                if not self.engine.has_unfinished() and t - last_tick > 5e-4:
                    self.idle_ticks, last_tick = self.idle_ticks + 1, t
                now = self.now()
                while self.due and self.due[0][0] <= now:
                    heapq.heappop(self.due)[2].set()


def turns_loop(lengths: list[int], *, tool, obs: list[int], slept: list[float]):
    """A loop of len(lengths) turns of exactly those token counts, `tool()` (a sleep) between turns."""

    def run(task: AgentTask):
        traj = TrajectoryBuilder(task.prompt_ids)
        for turn, n in enumerate(lengths):
            traj.add_sampled((yield Generate(traj.token_ids, n)))
            if turn < len(lengths) - 1:
                began = time.perf_counter()
                yield CallTool(tool)
                slept.append((began, time.perf_counter()))
                traj.add_observation(obs)
        return traj.finish(text=None)

    return run


def covered(spans: list[tuple[float, float]]) -> float:
    """Seconds of the union of [start, end) spans."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--trajectories", type=int, default=256)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--obs-tokens", type=int, default=32)
    ap.add_argument("--tool-delay-ms", type=float, default=200.0)
    ap.add_argument("--tool-delay-steps", type=int, default=0,
                    help="instead of --tool-delay-ms: a tool returns after this many engine steps (StepClock), for "
                         "scheduling comparisons that do not depend on the machine's step time")
    ap.add_argument("--tool-workers", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=0,
                    help="the engine's slots (rollout.max_num_seqs); 0: every trajectory at once. Fewer: the rest wait "
                         "in the engine's queue, as an RL step's trajectories do, and take the slots tools free")
    ap.add_argument("--max-parked-seqs", type=int, default=None,
                    help="KV slots beyond --max-num-seqs where a trajectory's KV waits while its tool runs "
                         "(rollout.max_parked_seqs); default: the trajectories beyond the slots, as the launcher's "
                         "auto choice. 0: parked KV is evicted when queued trajectories need its slot")
    ap.add_argument("--continuation-wait-steps", type=int, default=None,
                    help="engine steps a returning turn whose KV holds its decode slot waits for company before its "
                         "prefill (RolloutConfig.continuation_wait_steps; default: the engine's)")
    ap.add_argument("--evict-parked-for-new", action=argparse.BooleanOptionalAction, default=True,
                    help="RolloutConfig.evict_parked_for_new: --no-evict-parked-for-new makes a new trajectory wait "
                         "for a slot instead of evicting a parked one's KV while others run")
    ap.add_argument("--fresh-rows-in-waves", action=argparse.BooleanOptionalAction, default=False,
                    help="RolloutConfig.fresh_rows_in_waves: single-sequence fresh rows run in their prefill step's "
                         "continuation wave (one forward, CUDA-graphed) instead of a prompt forward of their own")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="keep,reprefill", help="comma-separated: keep, reprefill")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed passes, one single-turn and one kept-KV pass under torch.profiler: the "
                         "kernels' device time by name, busy time and idle gaps (profile_single, profile_keep)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile the engine (rollout.compile); default: on CUDA, as the launcher's auto choice")
    args = ap.parse_args(argv)
    if args.compile is None:
        args.compile = torch.device(args.device).type == "cuda"
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"keep", "reprefill"}:
        ap.error(f"--modes {args.modes!r}: choose from keep, reprefill")
    limit_host_threads(torch.device(args.device).type)  # as the launcher does on a CUDA rank
    dtype = getattr(torch, args.dtype) if args.device != "cpu" else torch.float32
    cfg = preset_config(args.model)
    model = random_model(args.model, device=args.device, dtype=dtype, seed=args.seed)
    rng = random.Random(args.seed)
    b, t = args.trajectories, args.turn_tokens
    lengths = [[rng.randint(max(1, t // 2), t + t // 2) for _ in range(args.turns)] for _ in range(b)]
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(args.prompt_len)] for _ in range(b)]
    obs = [rng.randrange(cfg.vocab_size) for _ in range(args.obs_tokens)]
    max_len = args.prompt_len + sum(max(x) for x in zip(*lengths)) + args.obs_tokens * args.turns + 8
    slots = args.max_num_seqs or b
    parked = max(0, b - slots) if args.max_parked_seqs is None else args.max_parked_seqs
    rc = RolloutConfig(max_model_len=max_len, max_num_seqs=slots, max_parked_seqs=parked,
                       max_num_batched_tokens=max(16384, max_len), gpu_memory_fraction=0.8, compile=args.compile,
                       evict_parked_for_new=args.evict_parked_for_new, fresh_rows_in_waves=args.fresh_rows_in_waves,
                       **({} if args.continuation_wait_steps is None
                          else {"continuation_wait_steps": args.continuation_wait_steps}))
    engine = NativeEngine.from_model(model, config=rc)
    sampling = SamplingParams(temperature=1.0, ignore_eos=True)
    total_tokens = sum(sum(x) for x in lengths)
    clock = StepClock(engine) if args.tool_delay_steps else None
    tool = functools.partial(clock.wait, args.tool_delay_steps) if clock else \
        functools.partial(time.sleep, args.tool_delay_ms / 1e3)

    def single_turn() -> tuple[float, dict]:
        params = [SamplingParams(temperature=1.0, max_tokens=sum(x), seed=i, ignore_eos=True)
                  for i, x in enumerate(lengths)]
        before = dict(engine.stats)
        synchronize(torch.device(args.device))
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        synchronize(torch.device(args.device))
        assert sum(len(c.token_ids) for c in outs) == total_tokens
        return time.perf_counter() - t0, {k: engine.stats[k] - before[k] for k in STEP_STATS}

    def multi_turn(keep: bool) -> tuple[float, dict]:
        slept: list[tuple[float, float]] = []
        pool = ToolPool(workers=args.tool_workers, timeout_s=600.0)
        starts = [Start(turns_loop(x, tool=tool, obs=obs, slept=slept),
                        AgentTask(p, {}, None, max_response_tokens=max_len, max_total_tokens=max_len), i, key=i)
                  for i, (p, x) in enumerate(zip(prompts, lengths))]
        before = dict(engine.stats)
        graphs, captured = counters["stats"]["unique_graphs"], len(engine.runner.graphs)
        waves = engine.runner.continuations
        replays, captures = (waves.replays, waves.captures) if waves is not None else (0, 0)
        synchronize(torch.device(args.device))
        t0 = time.perf_counter()
        trajs, stats = drive(engine, starts, sampling=sampling, tools=pool, keep_kv=keep)
        synchronize(torch.device(args.device))
        wall = time.perf_counter() - t0
        pool.close()
        # prefill_{fresh,continue}_{s,rows}: the prefill forwards by kind (device seconds): what a prefill step costs
        spent = {k: engine.stats[k] - before[k] for k in (*STEP_STATS, "prefill_s", "decode_s", *PREFILL_KINDS)}
        assert sum(end - start for tr in trajs for start, end in tr.turns) == total_tokens
        sleeping = covered(slept)
        later = b * (args.turns - 1)
        return wall, {"tokens_per_s": total_tokens / wall, "s": wall, "prefill_tokens": stats.prefill_tokens,
                      "prefill_tokens_per_later_turn": (stats.prefill_tokens - b * args.prompt_len) / later
                      if later else None,
                      "kv_reused_tokens": stats.kv_reused_tokens, "kv_evictions": stats.kv_evictions,
                      "kv_misses": stats.kv_misses, "kv_relocations": stats.kv_relocations,
                      "engine_steps": stats.engine_steps,
                      "steps_during_tools": stats.steps_during_tools, "tool_sleep_covered_s": sleeping,
                      "driver_idle_s": stats.tool_wait_s,
                      "busy_while_tools": 1 - stats.tool_wait_s / sleeping if sleeping else None,
                      "compiled_graphs": counters["stats"]["unique_graphs"] - graphs,
                      "decode_graphs_captured": len(engine.runner.graphs) - captured,
                      # continuation waves replayed from CUDA graphs (the rest of prefill_continue_waves ran
                      # un-graphed) and the graphs captured inside this pass
                      "continuation_waves_graphed": waves.replays - replays if waves is not None else 0,
                      "continuation_graphs_captured": waves.captures - captures if waves is not None else 0,
                      **spent, "driver_host_ms_per_step":
                      1e3 * (wall - spent["prefill_s"] - spent["decode_s"] - stats.tool_wait_s) / stats.engine_steps}

    single_turn()  # warm-up: CUDA graphs of the decode shapes, kernels
    single_s, single_steps = single_turn()
    out = {"bench": "agent_turns", "model": args.model, "device": args.device, "dtype": str(dtype).split(".")[-1],
           "compile": args.compile, "trajectories": b, "max_num_seqs": slots,
           "max_parked_seqs": parked, "park_slots": engine.runner.park_slots,
           "continuation_wait_steps": rc.continuation_wait_steps, "evict_parked_for_new": rc.evict_parked_for_new,
           "fresh_rows_in_waves": rc.fresh_rows_in_waves,
           "turns": args.turns, "turn_tokens_mean": total_tokens / (b * args.turns),
           "prompt_len": args.prompt_len, "obs_tokens": args.obs_tokens,
           "tool_delay_ms": None if args.tool_delay_steps else args.tool_delay_ms,
           "tool_delay_steps": args.tool_delay_steps or None,
           "generated_tokens": total_tokens, "single_turn_tokens_per_s": total_tokens / single_s,
           "single_turn_s": single_s, **{f"single_turn_{k}": v for k, v in single_steps.items()},
           # a trajectory's turns run in sequence: the longest one's decode steps (single-turn's run, when every
           # trajectory fits the slots at once) and its tool calls are the multi-turn run's critical path
           "critical_path_over_single": single_s / (single_s + (args.turns - 1) * args.tool_delay_ms / 1e3)
           if b <= slots and not args.tool_delay_steps else None}
    try:
        multi_turn(keep=True)  # warm-up: the decode shapes of staggered turns and the continuation prefills
        for mode in modes:
            multi_s, detail = multi_turn(keep=mode == "keep")
            # (on the step clock the wall time is the CPU's and the clock's: compare decode steps and rows per step)
            out[f"{mode}_over_single"] = None if clock else single_s / multi_s
            out[f"{mode}_rows_per_decode_step"] = total_tokens / detail["decode_steps"]
            out.update({f"{mode}_{k}": v for k, v in detail.items()})
        if args.profile:  # where the device time goes (bench.common.kernel_profile), each pass's wall time beside it
            for name, run in (("single", single_turn), ("keep", lambda: multi_turn(keep=True))):
                t0 = time.perf_counter()
                out[f"profile_{name}"] = kernel_profile(run, device=torch.device(args.device), top=20)
                out[f"profile_{name}"]["wall_s"] = time.perf_counter() - t0
    finally:
        if clock is not None:  # its watcher thread would outlive the bench (a test process runs more than this)
            clock.close()
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
