"""GRPO with a tiny mixture of experts (routing replay on) over 2 gloo ranks through `torchrun launcher/main.py`:
the actor and the reference at ep = 2 (each rank holds 4 of the 8 experts, tokens by all-to-all, the engine's
weights gathered whole by the hybrid engine's reshard) run step for step as at ep = 1."""

from __future__ import annotations

import json

import pytest

from tests.ppo.test_trainer import _ok, launch, metrics

STEPS = 3


@pytest.mark.distributed
@pytest.mark.extended
def test_grpo_at_ep2_equals_ep1_step_for_step(tmp_path):
    rows = {}
    for ep in (1, 2):
        _ok(launch(tmp_path, 2, "conf/grpo_tiny.yaml", "model.preset=tiny-qwen3-moe", "actor.router_replay=true",
                   f"trainer.total_steps={STEPS}", f"actor.ep={ep}", f"ref.ep={ep}", "trainer.sft_warmup_steps=0",
                   "actor.optim.lr=1e-4", "actor.max_tokens_per_micro_batch=64", "trainer.save_final=false",
                   f"trainer.experiment_name=ep{ep}"))
        rows[ep] = metrics(tmp_path / f"ep{ep}")
        groups = json.loads((tmp_path / f"ep{ep}" / "plan.json").read_text())["groups"]
        assert (groups["actor"]["ep"], groups["ref"]["ep"], groups["rollout"]["ep"]) == (ep, ep, 1)
    assert [r["step"] for r in rows[2]] == list(range(1, STEPS + 1))
    for a, b in zip(rows[1], rows[2]):
        assert b["response_length/mean"] == a["response_length/mean"]  # the same samples every step
        assert b["reward/mean"] == a["reward/mean"]
        for key in ("actor/grad_norm", "actor/pg_loss", "actor/kl", "actor/aux_loss", "actor/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
        assert b["rollout_corr/logprob_diff_max"] <= 1e-5 and b["actor/router_mismatch"] == 0.0
