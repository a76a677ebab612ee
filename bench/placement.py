"""One workload in several placement/scheduling modes, printed as a table and one JSON line.

    python -m bench.placement --config conf/bench_ppo_1b.yaml --nproc 2          # workload (b), 2 GPUs
    python -m bench.placement --config conf/bench_grpo_1b.yaml --nproc 1 --modes colocated-sync,colocated-async

Modes (each a set of overrides on the same config):
    colocated-sync              every role on every GPU, on-policy
    colocated-async             ... one step off-policy (no old-log-prob recompute)
    colocated-partial           ... two batches of prompts in flight, partial rollouts at staleness 1
                                (rollout.batches_in_flight=2; its gain needs responses of unequal length)
    colocated-partial-drop      ... the groups one step old not waited for but dropped (trainer.stale_policy=drop)
    colocated-partial-beside    ... the groups in flight decoding beside the scoring and update (rollout.decode_beside)
    colocated-partial-keep, colocated-partial-beside-keep   ... with rollout.partial_kv=keep (no re-prefill at the
                                weight swap; needs the engine resident, as conf/bench_grpo_1b.yaml keeps it)
    split-sync                  actor+rollout | critic+ref+reward on disjoint GPUs, on-policy
    split-async                 ... batch k+1 generated while batch k is scored and trained
    split-async2                ... staleness bound 2: batches k+1 and k+2 generated ahead (issue 41 item 6)
    split-async+controller      ... with the NVML feedback batch controller
    auto-sync, auto-async       placement.mode=auto: the cost model's best plan (launcher/planning/autoplan.py)
Each row: NVML utilization, useful utilization (counted FLOPs / time / peak), samples/s, tokens/s
per GPU, actor MFU, peak memory, and the speed-up over the first mode.
"""

from __future__ import annotations

import argparse
import json

from bench.ppo_step import run_workload

MODES = {
    "colocated-sync": ["placement.mode=colocated", "trainer.max_staleness=0"],
    "colocated-async": ["placement.mode=colocated", "trainer.max_staleness=1"],
    "colocated-partial": ["placement.mode=colocated", "trainer.max_staleness=1", "rollout.batches_in_flight=2"],
    "colocated-partial-drop": ["placement.mode=colocated", "trainer.max_staleness=1", "rollout.batches_in_flight=2",
                               "trainer.stale_policy=drop"],
    "colocated-partial-beside": ["placement.mode=colocated", "trainer.max_staleness=1", "rollout.batches_in_flight=2",
                                 "rollout.decode_beside=true"],
    "colocated-partial-keep": ["placement.mode=colocated", "trainer.max_staleness=1", "rollout.batches_in_flight=2",
                               "rollout.partial_kv=keep"],
    "colocated-partial-beside-keep": ["placement.mode=colocated", "trainer.max_staleness=1",
                                      "rollout.batches_in_flight=2", "rollout.decode_beside=true",
                                      "rollout.partial_kv=keep"],
    "split-sync": ["placement.mode=split", "trainer.max_staleness=0"],
    "split-async": ["placement.mode=split", "trainer.max_staleness=1"],
    "split-async2": ["placement.mode=split", "trainer.max_staleness=2"],
    "split-async+controller": ["placement.mode=split", "trainer.max_staleness=1", "controller.enabled=true"],
    "auto-sync": ["placement.mode=auto", "trainer.max_staleness=0"],
    "auto-async": ["placement.mode=auto", "trainer.max_staleness=1"],
}


def _fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.placement", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--modes", default="colocated-sync,split-sync,split-async,split-async+controller")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=1800,
                    help="seconds per mode before its run is killed (the row records it; the JSON line still prints)")
    ap.add_argument("--runs-dir", default=None,
                    help="keep the run directories here (e.g. for trainer.profile_steps); default: a temporary one")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    rows = []
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
        try:
            r = run_workload(args.config, nproc=args.nproc, overrides=[*MODES[mode], *args.overrides],
                             warmup=args.warmup, name=mode.replace("+", "_"), timeout=args.timeout,
                             runs_dir=args.runs_dir)
        except Exception as e:  # noqa: BLE001 - a broken run becomes a failed row; the JSON line still prints
            r = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        r["mode"] = mode
        rows.append(r)
    base = next((r for r in rows if r.get("ok")), None)
    header = f"{'mode':24} {'nvml_util':>9} {'useful':>7} {'samples/s':>9} {'tok/s/gpu':>10} {'mfu':>6} " \
             f"{'peak_GB':>8} {'host_GB':>8} {'speedup':>7}"
    print(header)
    for r in rows:
        if not r.get("ok"):
            print(f"{r['mode']:24} FAILED: {r.get('error')}")
            continue
        r["speedup"] = r["samples_per_s"] / base["samples_per_s"] if base else None
        print(f"{r['mode']:24} {_fmt(r['nvml_util'], '.2f'):>9} {_fmt(r['useful_util']):>7} "
              f"{_fmt(r['samples_per_s'], '.1f'):>9} {_fmt(r['tokens_per_s_per_gpu'], '.0f'):>10} "
              f"{_fmt(r['mfu_actor']):>6} {_fmt(r['peak_mem_gb'], '.1f'):>8} {_fmt(r['host_peak_gb'], '.1f'):>8} "
              f"{_fmt(r['speedup'], '.2f'):>7}")
        late = [i for i in r["compiled_steps"] if i > args.warmup]
        if late:  # a compile inside the measured window: its step time is the compiler's, not the workload's
            print(f"{'':24} measured step(s) {late} compiled; samples/s without them: "
                  f"{_fmt(r['samples_per_s_no_compile'], '.1f')}")
    from bench.common import git_commit, git_tree

    out = {"bench": "placement", "config": args.config, "nproc": args.nproc, "overrides": args.overrides,
           "git_commit": git_commit(), "git_tree": git_tree(), "rows": rows}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
