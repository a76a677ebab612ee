"""The verl recipe end to end on a CPU: a task and a reward function written outside the repository in
verl's formats (Parquet rows with chat prompts, data_source, reward_model.ground_truth, extra_info; a
`compute_score(data_source, solution_str, ground_truth, extra_info)` returning a dict), run through
`conf/grpo_verl_tiny.yaml` with overrides only -- no adapter code -- learns, with validation logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import repo_pythonpath

ROOT = Path(__file__).resolve().parents[2]

# what a verl user already has: their data script's rows and their reward file
REWARD_PY = '''
def compute_score(data_source, solution_str, ground_truth, extra_info):
    answer = solution_str.strip()
    assert data_source in ("toy/copy", "toy/max") and extra_info["split"] in ("train", "test")
    return {"score": 1.0 if answer == ground_truth else 0.0, "format": float(answer.isdigit())}
'''


def write_verl_task(d: Path, *, n_train: int = 256, n_test: int = 32) -> None:
    """Two one-digit tasks, told apart by data_source: copy ("c7=" -> "7") and max ("3m5=" -> "5")."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    def rows(n, seed, split):
        rng, out = random.Random(seed), []
        for i in range(n):
            a, b = rng.randrange(10), rng.randrange(10)
            source, question, answer = (("toy/copy", f"c{a}=", str(a)) if i % 2 == 0
                                        else ("toy/max", f"{a}m{b}=", str(max(a, b))))
            out.append({"data_source": source, "prompt": [{"role": "user", "content": question}], "ability": "math",
                        "reward_model": {"style": "rule", "ground_truth": answer},
                        "extra_info": {"split": split, "index": i}})
        return out

    d.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows(n_train, 0, "train")), d / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows(n_test, 1, "test")), d / "test.parquet")
    (d / "reward.py").write_text(REWARD_PY)


def run_recipe(tmp_path: Path, *overrides: str, timeout: int = 300):
    task = tmp_path / "task"
    write_verl_task(task)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo_pythonpath(), HYBRIDRL_TRACEBACK="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(ROOT / "launcher" / "main.py"), str(ROOT / "conf" / "grpo_verl_tiny.yaml"),
           f"data.train_files={task / 'train.parquet'}", f"data.val_files={task / 'test.parquet'}",
           f"reward.function={task / 'reward.py'}:compute_score", f"trainer.runs_dir={tmp_path / 'runs'}",
           "trainer.progress_bar=false", "monitor.enabled=false", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


@pytest.mark.distributed
@pytest.mark.slow(seconds=40)
def test_verl_task_and_reward_learn_with_validation(tmp_path):
    res = run_recipe(tmp_path)
    assert res.returncode == 0, f"STDOUT\n{res.stdout[-3000:]}\nSTDERR\n{res.stderr[-5000:]}"
    run = tmp_path / "runs" / "grpo_verl_tiny"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if "val/reward/mean" in r]
    # before training (step 0, after the SFT warm-up on the data's answers), every 10 steps, after the last
    assert [r["step"] for r in val] == [0, 10, 20, 30]
    for key in ("val/pass@1", "val/pass@2", "val/toy/copy/reward/mean", "val/toy/max/reward/mean",
                "val/toy/copy/pass@2", "val/toy/max/pass@1", "val/reward/format/mean"):
        assert key in val[0] and key in val[-1], key
    train = [r for r in rows if "reward/mean" in r]
    assert len(train) == 30 and all("reward/format/mean" in r for r in train)  # the dict's extra key
    # it learns: sampled validation reward and training reward both rise
    assert val[-1]["val/reward/mean"] >= val[0]["val/reward/mean"] + 0.15, [r["val/reward/mean"] for r in val]
    first, last = (sum(r["reward/mean"] for r in part) / 5 for part in (train[:5], train[-5:]))
    assert last >= first + 0.15, (first, last)
    # samples: prompts as the user wrote them, with their data source and ground truth
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {10, 20, 30} and len(samples) == 12
    assert {s["data_source"] for s in samples} <= {"toy/copy", "toy/max"}
    assert all(s["prompt"][0] in "c0123456789" and s["ground_truth"].isdigit() for s in samples)
    assert "sample step 10 uid" in res.stderr + res.stdout
    # TensorBoard holds the validation scalars and the sample text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert "val/toy/max/pass@2" in events.Tags()["scalars"] and "samples/text_summary" in events.Tags()["tensors"]
    from launcher.report import render_report

    assert "validation.png" in {p.name for p in render_report(run)}


@pytest.mark.gpu
@pytest.mark.distributed
def test_verl_recipe_on_one_gpu_with_greedy_validation(tmp_path):
    """The same recipe on a GPU (CUDA graphs in the engine), validating greedily as verl does by default."""
    pytest.importorskip("pyarrow")
    res = run_recipe(tmp_path, "trainer.device=cuda", "rollout.val_n=1", "rollout.val_temperature=0",
                     "trainer.tensorboard=false")
    assert res.returncode == 0, f"STDOUT\n{res.stdout[-3000:]}\nSTDERR\n{res.stderr[-5000:]}"
    rows = [json.loads(line) for line in (tmp_path / "runs" / "grpo_verl_tiny" / "metrics.jsonl").read_text()
            .splitlines()]
    val = [r for r in rows if "val/reward/mean" in r]
    assert [r["step"] for r in val] == [0, 10, 20, 30]
    assert all("val/toy/copy/pass@1" in r and "val/pass@2" not in r for r in val)
    train = [r for r in rows if "reward/mean" in r]
    first, last = (sum(r["reward/mean"] for r in part) / 5 for part in (train[:5], train[-5:]))
    assert last >= first + 0.15, (first, last)
    assert val[-1]["val/reward/mean"] >= val[0]["val/reward/mean"], [r["val/reward/mean"] for r in val]
