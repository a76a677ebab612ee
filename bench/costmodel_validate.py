"""Predicted vs measured: the cost model (launcher/planning/costmodel.py) against every committed PPO/GRPO run
and decode run.

    python -m bench.costmodel_validate                      # writes bench/results/costmodel_validation.json
    python -m bench.costmodel_validate --calibration h200 --out /tmp/v.json
    python -m bench.costmodel_validate --recipe-fixture /tmp/fx     # with the GSM8K recipe's runs

The recipe's runs (conf/grpo_gsm8k_qwen3.yaml on bench/gpu_suite.sh's fixture, /tmp/recipe_<preset> on the GPU
machine) are rebuilt on a bench.recipe_fixture output (--recipe-fixture: its tokenizer and data, the preset's shape
without weights); without one they are listed as excluded.

For each run of bench.placement under bench/results/ it rebuilds the run's config (the committed YAML
plus the mode's overrides and the run's own), plans it with launcher.planning.plan, estimates it with the
calibration (derived from micro-benchmarks only: nothing here feeds back into it) and records
predicted and measured step seconds, samples/s, useful utilization, peak memory and every stage,
with the relative error of each. Runs are then grouped by workload (config, GPUs) to check that the
predicted ranking of modes is the measured one. Eager shakeout runs (before training was compiled)
are listed as excluded: the calibration measures the compiled kernels.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.placement import MODES

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TARGET = 0.15  # step-time error the issue asks for
GIB = 2**30 / 1e9  # the trainer's mem/peak_gb is in GiB


# what each run's own record says about a miss (docs/history/measurements.md); reported, never fitted
KNOWN = {
    "grpo_a_noshare_h200": "the reference forward recompiled for a new packed shape inside a measured step "
                           "(README: ref 1.71 s against ~0.33 s); compilation is not modelled",
    "grpo_a_dynamic_h200": "compiled with dynamic=True, measured 9% slower updates than the automatic-dynamic "
                           "compile the micro-benchmark calibrates",
    "recipe_qwen3-0.6b_fp8_h200": "measured at e0661b3 with the fp8 decode tile of then (its record: generation "
                                  "14.93 s against bf16's 12.54, the fp8 loads and conversions costing more than the "
                                  "halved bytes save); the calibrated fp8 fraction is of the kernel since de6443b",
    "placement_b_colocated-sync_h200x2": "every role data parallel over 2 GPUs (FSDP): forwards and updates "
                                         "run 12-27% slower per token than one GPU's micro-benchmark; the model "
                                         "overlaps FSDP's gathers fully and misses that cost",
}


def _err(pred: float, meas: float | None) -> float | None:
    return None if not meas else round(pred / meas - 1, 4)


def _runs() -> tuple[list[tuple[Path, dict, dict]], list[dict]]:
    """(file, its JSON, one row) of every placement result, and the excluded ones with why."""
    runs, excluded = [], []
    for path in sorted(RESULTS.glob("*.json")):
        d = json.loads(path.read_text())
        res = d.get("result")
        if not isinstance(res, dict) or res.get("bench") != "placement":
            continue
        for row in res["rows"]:
            if "shakeout" in path.name:
                excluded.append({"file": path.name, "mode": row.get("mode"),
                                 "why": "eager shakeout run (training not compiled); the calibration is of compiled "
                                        "kernels"})
            elif not row.get("ok"):
                excluded.append({"file": path.name, "mode": row.get("mode"), "why": f"run failed: {row.get('error')}"})
            else:
                runs.append((path, d, row))
    return runs, excluded


class NeedsFixture(Exception):
    """A run whose config names the GPU machine's recipe fixture, with no local fixture given."""


def local_overrides(overrides: list[str], fixture: Path | None, tmp: Path) -> list[str]:
    """The run's overrides with the GPU machine's recipe fixture (/tmp/recipe_<preset>/{model,data}) replaced by the
    preset's shape and `fixture`'s data (bench.recipe_predict.shape_dir)."""
    import re

    from bench.recipe_predict import shape_dir

    out = []
    for o in overrides:
        m = re.search(r"/tmp/recipe_([\w.-]+?)/(model|data)", o)
        if m is None:
            out.append(o)
        elif fixture is None:
            raise NeedsFixture(m.group(1))
        elif m.group(2) == "model":
            out.append(f"model.path={shape_dir(m.group(1), fixture, tmp)}")
        else:
            out.append(o.replace(f"/tmp/recipe_{m.group(1)}/data", str(fixture / "data")))
    return out


def predict_run(d: dict, row: dict, cal, *, fixture: Path | None = None):
    """(Estimate, config) of one measured row: its config, mode overrides and extra overrides."""
    from launcher.config.load import load_config
    from launcher.planning.autoplan import candidate_from_plan
    from launcher.planning.costmodel import build_workload
    from launcher.planning.plan import compute_plan, resolve_model_config, resolve_reward_model_config
    from launcher.planning.stepmodel import estimate

    res = d["result"]
    overrides = [*MODES[row["mode"]], *(res.get("overrides") or [])]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(ROOT / res["config"], local_overrides(overrides, fixture, Path(tmp)))
        model, rm = resolve_model_config(cfg), resolve_reward_model_config(cfg)
        plan = compute_plan(cfg, world_size=res["nproc"], model=model, reward_model=rm)
        w = build_workload(cfg, model=model, reward_model=rm)
    return estimate(w, cal, candidate_from_plan(plan, is_async=cfg.trainer.max_staleness > 0)), overrides


def record(path: Path, d: dict, row: dict, cal, *, fixture: Path | None = None) -> dict:
    est, overrides = predict_run(d, row, cal, fixture=fixture)
    meas = row["timing_s"]
    stages = {}
    for stage, pred in est.stages.items():
        m = meas.get(stage)
        if m is None and pred < 1e-3:
            continue
        stages[stage] = {"predicted_s": round(pred, 4), "measured_s": m, "error": _err(pred, m)}
    for stage in sorted(set(meas) - set(est.stages) - {"step"}):
        stages[stage] = {"predicted_s": None, "measured_s": meas[stage], "error": None}
    peak_meas = row.get("peak_mem_gb")
    return {
        "run": f"{path.stem}:{row['mode']}", "file": path.name, "config": d["result"]["config"],
        "gpus": d["result"]["nproc"], "mode": row["mode"], "overrides": overrides,
        "measured_commit": d.get("git_commit"),
        "plan": est.candidate.describe(),
        "predicted_step_s": round(est.step_s, 4), "measured_step_s": round(row["step_s"], 4),
        "step_error": _err(est.step_s, row["step_s"]),
        "within_target": abs(est.step_s / row["step_s"] - 1) <= TARGET,
        "predicted_samples_per_s": round(est.samples_per_s, 2),
        "measured_samples_per_s": round(row["samples_per_s"], 2),
        "predicted_useful_util": round(est.useful_utilization(cal) * cal.peak_flops / 790e12, 4),
        "measured_useful_util": round(row["useful_util"], 4),
        "predicted_pool_busy": [round(u, 3) for u in est.pool_utilization()],
        "measured_nvml_util": round(row["nvml_util"], 3) if row.get("nvml_util") else None,
        "predicted_peak_gb": round(max(est.peak_gb), 1),
        "measured_peak_gb": round(peak_meas * GIB, 1) if peak_meas else None,
        "stages": stages,
        "known_miss": KNOWN.get(path.stem),
    }


def decode_records(cal) -> list[dict]:
    """Predicted vs measured wall time of every committed bench.generate run of the native engine at 256 rows on the
    calibration's machine (issue 39's decode target: prefill, then new_tokens - 1 decode steps, one wave): the cost
    model's generation_s for a workload of those prompts and lengths, bf16 cache, no sharing."""
    from launcher.planning.costmodel import ModelShape, Workload, generation_s
    from models import preset_config

    out = []
    for path in sorted(RESULTS.glob("generate*.json")):
        d = json.loads(path.read_text())
        for run in d.get("runs") or [d]:
            res = run.get("result") or {}
            device = str(run.get("device") or d.get("device") or res.get("device_name") or "")
            if cal.name.upper() not in device.upper():  # another machine's run: not this calibration's to predict
                continue
            # older records kept only the printed row: a flat result of one engine at one batch
            rows = res.get("results") or ([dict(res, engine="native", new_tokens_per_s=res["tokens_per_s"])]
                                          if "tokens_per_s" in res else [])
            for row in rows:
                model = res.get("model") or row.get("model")
                if row.get("batch") != 256 or not str(row.get("engine", "")).startswith("native") or \
                        "fp8" in row["engine"] or res.get("samples_per_prompt", 1) != 1 or model is None:
                    continue
                m = ModelShape.of(preset_config(model))
                w = Workload(actor=m, critic=None, ref=None, reward_model=None, prompts=256, n=1,
                             prompt_len=res["prompt_len"], response_len=res["new_tokens"])
                pred = generation_s(w, cal, gen_tp=1, gen_dp=1, slots=256)
                meas = row["wall_s"]
                out.append({"run": f"{path.stem}:{model}:{row['engine']}", "file": path.name,
                            "measured_commit": run.get("git_commit"), "predicted_s": round(pred, 4),
                            "measured_s": meas, "error": _err(pred, meas),
                            "within_target": abs(pred / meas - 1) <= TARGET})
    return out


def rankings(records: list[dict]) -> list[dict]:
    """Per workload (config, GPUs) with 2+ modes: measured and predicted order of the modes."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["overrides"][len(MODES[r["mode"]]):]:  # runs with extra overrides are not a mode of the workload
            continue
        groups.setdefault((r["config"], r["gpus"]), []).append(r)
    out = []
    for (config, gpus), rs in sorted(groups.items()):
        if len(rs) < 2:
            continue
        measured = [r["mode"] for r in sorted(rs, key=lambda r: r["measured_step_s"])]
        predicted = [r["mode"] for r in sorted(rs, key=lambda r: r["predicted_step_s"])]
        # modes whose measured times are within 5% of each other are a tie: either order is right
        ties = [(a["mode"], b["mode"]) for a in rs for b in rs
                if a is not b and abs(a["measured_step_s"] / b["measured_step_s"] - 1) < 0.05]
        out.append({"config": config, "gpus": gpus, "measured_fastest_first": measured,
                    "predicted_fastest_first": predicted, "same_order": measured == predicted,
                    "same_order_up_to_ties": _same_up_to_ties(measured, predicted, ties), "ties_within_5pct": ties})
    return out


def _same_up_to_ties(measured: list[str], predicted: list[str], ties: list[tuple[str, str]]) -> bool:
    tied = set(ties)
    pos = {m: i for i, m in enumerate(predicted)}
    return all(pos[a] < pos[b] or (a, b) in tied for i, a in enumerate(measured) for b in measured[i + 1:])


def main(argv: list[str] | None = None) -> dict:
    from bench.common import git_commit
    from launcher.planning.costmodel import load_calibration

    ap = argparse.ArgumentParser(prog="python -m bench.costmodel_validate", description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default="h200")
    ap.add_argument("--out", default=str(RESULTS / "costmodel_validation.json"))
    ap.add_argument("--recipe-fixture", type=Path, default=None,
                    help="a bench.recipe_fixture output: rebuild the GSM8K recipe's runs on it")
    args = ap.parse_args(argv)
    cal = load_calibration(args.calibration)
    runs, excluded = _runs()
    records = []
    for p, d, row in runs:
        try:
            records.append(record(p, d, row, cal, fixture=args.recipe_fixture))
        except NeedsFixture as e:
            excluded.append({"file": p.name, "mode": row.get("mode"),
                             "why": f"the recipe's run on the GPU machine's fixture: give --recipe-fixture "
                                    f"(python -m bench.recipe_fixture --preset {e} --out DIR)"})
    errors = [abs(r["step_error"]) for r in records]
    decode = decode_records(cal)
    out = {
        "command": "python -m bench.costmodel_validate" + (" --recipe-fixture DIR" if args.recipe_fixture else ""),
        "git_commit": git_commit(), "calibration": cal.name,
        "calibration_source": cal.source.get("how"), "target_step_error": TARGET,
        "summary": {"runs": len(records), "within_target": sum(r["within_target"] for r in records),
                    "max_abs_step_error": round(max(errors), 4),
                    "mean_abs_step_error": round(sum(errors) / len(errors), 4),
                    "decode_runs": len(decode), "decode_within_target": sum(r["within_target"] for r in decode)},
        "rankings": rankings(records), "records": records, "excluded": excluded, "decode": decode,
        "notes": ["useful utilization: both against 790 TFLOP/s as the trainer reports it",
                  "measured peak memory converted from the trainer's GiB to GB",
                  "predicted_pool_busy: fraction of the step each pool computes (no host stages), beside NVML's "
                  "utilization of the run (NVML also counts kernels that wait, e.g. NCCL)"],
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for r in records:
        print(f"{r['run']:60} pred {r['predicted_step_s']:7.3f}  meas {r['measured_step_s']:7.3f}  "
              f"err {r['step_error']:+.1%}")
    for r in decode:
        print(f"{r['run']:60} pred {r['predicted_s']:7.3f}  meas {r['measured_s']:7.3f}  err {r['error']:+.1%}")
    for g in out["rankings"]:
        print(f"ranking {g['config']} x{g['gpus']}: same={g['same_order']} measured={g['measured_fastest_first']} "
              f"predicted={g['predicted_fastest_first']}")
    print(json.dumps(out["summary"]))
    return out


if __name__ == "__main__":
    main()
