"""The cost model's prediction of the GSM8K recipe (conf/grpo_gsm8k_qwen3.yaml at its defaults, one GPU), made
before the run is measured, for each model shape:

    python -m bench.recipe_predict --fixture DIR [--presets qwen3-0.6b,qwen3-8b] [--out FILE] [KEY=VALUE ...]

DIR is a bench.recipe_fixture output (its tokenizer and Parquet files; the prediction reads the data's prompt
lengths under that tokenizer). Each preset's shape is planned as the launcher plans it (auto settings, then
launcher.planning.fit's memory choices on CUDA, then the plan's estimate on placement.calibration), with the same
overrides as bench/gpu_suite.sh's `recipe` part, then the KEY=VALUE overrides given (gpu_suite's EXTRA, e.g.
rollout.kv_cache_dtype=fp8). Writes FILE (default bench/results/recipe_predictions.json) and
prints it as one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "conf/grpo_gsm8k_qwen3.yaml"


def recipe_overrides(model_dir: Path, data_dir: Path, *, steps: int = 5) -> list[str]:
    """bench/gpu_suite.sh's `recipe` part: the data, no validation, a fixed number of steps."""
    return [f"model.path={model_dir}", f"data.train_files=[{data_dir / 'train.parquet'}]", "data.val_files=[]",
            "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.total_epochs=0",
            f"trainer.total_steps={steps}", "trainer.device=cuda"]


def shape_dir(preset: str, fixture: Path, parent: Path) -> Path:
    """A model directory of the preset's shape under `parent`: its config.json (the fixture's special ids) and the
    fixture's tokenizer, no weights (planning reads config.json only)."""
    from models import preset_config

    tok = json.loads((fixture / "model" / "config.json").read_text())  # the fixture's special ids
    shape = preset_config(preset, bos_token_id=tok.get("bos_token_id"), eos_token_id=tok.get("eos_token_id"),
                          pad_token_id=tok.get("pad_token_id"))
    model_dir = parent / preset
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(shape.to_hf()))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fixture / "model" / name, model_dir / name)
    return model_dir


def predict(preset: str, fixture: Path, extra: tuple[str, ...] = ()) -> dict:
    from launcher.config.load import load_config
    from launcher.planning.fit import fit_memory
    from launcher.planning.plan import compute_plan, resolve_model_config

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = shape_dir(preset, fixture, Path(tmp))
        choices: list[str] = []
        cfg = load_config(str(ROOT / CONFIG), [*recipe_overrides(model_dir, fixture / "data"), *extra],
                          auto_choices=choices)
        model = resolve_model_config(cfg)
        choices += fit_memory(cfg, lambda c: compute_plan(c, world_size=1, model=model).predicted, cuda=True)
        plan = compute_plan(cfg, world_size=1, model=model)
    return {"preset": preset, "overrides": list(extra), "auto": choices, **plan.predicted}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.recipe_predict", description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixture", required=True, type=Path)
    ap.add_argument("--presets", default="qwen3-0.6b,qwen3-8b")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "recipe_predictions.json")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides after the recipe's")
    args = ap.parse_args(argv)
    from bench.common import git_commit, git_tree

    out = {"bench": "recipe_predict", "config": CONFIG, "fixture": str(args.fixture),
           "date": datetime.date.today().isoformat(), "git_commit": git_commit(), "git_tree": git_tree(),
           "command": " ".join(["python -m bench.recipe_predict --fixture DIR --presets", args.presets,
                                *args.overrides]),
           "predictions": [predict(p, args.fixture, tuple(args.overrides)) for p in args.presets.split(",")]}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
