"""GRPO with the tiny Qwen3-MoE on one GPU in bf16, routing replay on: the trainer's grouped expert GEMMs (forward
and backward), the engine's graphed MoE decode and its expert records, the hybrid engine's weight handoff.

    make test-gpu   (or: pytest -q -m gpu tests/ppo/test_moe_gpu.py)
"""

from __future__ import annotations

import pytest
import torch

from tests.ppo.test_trainer import _ok, launch, metrics


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("compile_", ["false", "true"])
def test_grpo_with_a_moe_policy_runs_on_the_gpu(tmp_path, compile_):
    res = launch(tmp_path, 1, "conf/grpo_tiny.yaml", "model.preset=tiny-qwen3-moe", "trainer.device=cuda",
                 "model.dtype=bfloat16", "actor.router_replay=true", "trainer.total_steps=3",
                 "trainer.save_final=false", f"actor.compile={compile_}", f"ref.compile={compile_}",
                 f"rollout.compile={compile_}", timeout=600)
    _ok(res)
    rows = metrics(tmp_path / "grpo_tiny")
    assert len(rows) == 3
    for r in rows:
        assert 0.0 <= r["actor/router_mismatch"] <= 1.0 and r["actor/aux_loss"] > 0
        assert r["perf/mfu/actor"] > 0
