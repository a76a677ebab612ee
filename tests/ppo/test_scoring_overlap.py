"""Trainer.step's deferred reference wait (ppo/trainer.py): the advantages are computed while the reference
forward runs, and the step trains exactly as one that waits for it first."""

from __future__ import annotations

import torch

from tests.ppo.world import tiny_run, world_of_one


def test_deferred_reference_wait_trains_identically(tmp_path, monkeypatch):
    """GRPO with a KL loss and fused old log-probs computes the advantages while the reference forward runs;
    the step's metrics and the actor's weights equal those of a step that waits for the reference first."""
    from ppo.trainer import PPOTrainer

    def one_step(name: str):
        with world_of_one():
            t = tiny_run(tmp_path / name, config="conf/grpo_tiny.yaml").trainer()
            assert t.old_logp_source() == "fused"
            metrics = t.step(0)
            return metrics, {n: p.detach().clone() for n, p in t.roles.actor.runner.named_parameters()}

    finished = []
    finish = PPOTrainer.finish_scoring
    monkeypatch.setattr(PPOTrainer, "finish_scoring", staticmethod(
        lambda deferred, timer: finished.append([d[0] for d in deferred]) or finish(deferred, timer)))
    deferred_m, deferred_w = one_step("deferred")
    assert ["ref"] in finished
    score = PPOTrainer.score
    monkeypatch.setattr(PPOTrainer, "score", lambda self, *a, defer=(), **k: score(self, *a, **k))
    waited_m, waited_w = one_step("waited")
    for key in ("actor/pg_loss", "actor/kl", "actor/grad_norm", "reward/mean"):
        assert deferred_m[key] == waited_m[key], key
    for n, w in waited_w.items():
        torch.testing.assert_close(deferred_w[n], w, rtol=0, atol=0)
