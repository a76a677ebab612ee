"""The two-GPU runs of issue 41 item 6 (bench/gpu_suite.sh part async2): PPO workload (b) in split placement,
synchronous, K = 1 and K = 2, pass the launcher's checks on a world of 2 before any GPU is lent."""

import json
from pathlib import Path

import pytest

from bench.placement import MODES
from launcher.config.load import load_config
from launcher.planning.plan import (
    compute_plan,
    resolve_model_config,
    resolve_reward_model_config,
    validate_batch,
    validate_context,
)
from launcher.planning.plan import main as plan_main

CONFIG = str(Path(__file__).resolve().parents[2] / "conf" / "bench_ppo_1b.yaml")


@pytest.mark.parametrize("mode,staleness", [("split-sync", 0), ("split-async", 1), ("split-async2", 2)])
def test_async2_runs_plan_on_two_gpus(mode, staleness, capsys):
    overrides = [*MODES[mode], "trainer.total_steps=10"]
    cfg = load_config(CONFIG, overrides)
    assert cfg.trainer.max_staleness == staleness
    model, rm = resolve_model_config(cfg), resolve_reward_model_config(cfg)
    plan = compute_plan(cfg, world_size=2, model=model, reward_model=rm)
    validate_batch(cfg, plan)
    validate_context(cfg, model)
    assert plan.mode == "split" and plan.groups["actor"].ranks == [0] and plan.groups["critic"].ranks == [1]
    assert plan_main([CONFIG, *overrides, "--world-size", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["groups"]["rollout"]["ranks"] == [0]


def test_the_heavy_tail_beside_mode_passes_the_launch_checks_on_one_gpu():
    """bench/gpu_suite.sh part heavy_beside: conf/bench_grpo_1b.yaml with colocated-partial-beside on CUDA (its
    engine resident from the start, gen_tp 1) passes validation and planning for one GPU."""
    conf = str(Path(CONFIG).parent / "bench_grpo_1b.yaml")
    cfg = load_config(conf, [*MODES["colocated-partial-beside"], "trainer.device=cuda"])
    assert cfg.rollout.decode_beside and cfg.rollout.free_memory_on_sleep is False
    model = resolve_model_config(cfg)
    plan = compute_plan(cfg, world_size=1, model=model)
    validate_batch(cfg, plan)
    assert plan.gen_tp == 1


@pytest.mark.parametrize("mode", ["colocated-partial-keep", "colocated-partial-beside-keep"])
def test_the_heavy_tail_kept_kv_modes_pass_the_launch_checks_on_one_gpu(mode):
    """bench/gpu_suite.sh parts heavy_keep and heavy_beside: partial rollouts keeping their KV across the swap need the
    engine resident, which conf/bench_grpo_1b.yaml keeps."""
    conf = str(Path(CONFIG).parent / "bench_grpo_1b.yaml")
    cfg = load_config(conf, [*MODES[mode], "trainer.device=cuda"])
    assert cfg.rollout.partial_kv == "keep" and cfg.rollout.free_memory_on_sleep is False
    validate_batch(cfg, compute_plan(cfg, world_size=1, model=resolve_model_config(cfg)))
