"""Trainer.step's deferred reference wait (ppo/trainer.py): the advantages are computed while the reference
forward runs, and, with the reference placed like the actor, the update reads the reference's log-probs on the
device without waiting for them at all; each way the step trains exactly as one that waits for the reference
first."""

from __future__ import annotations

import torch

from tests.ppo.world import tiny_run, world_of_one


def test_reference_logprobs_on_device_deferred_or_waited_train_identically(tmp_path, monkeypatch):
    """GRPO with a KL loss and fused old log-probs: the step whose update reads the reference's log-probs on the
    device (DeviceRows), the step that merges them on the host while the advantages are computed, and the step
    that waits for them first end with the same metrics and the same actor weights, bit for bit."""
    from ppo.roles.workers import DeviceRows
    from ppo.trainer import PPOTrainer

    def one_step(name: str, *, beside: bool = True):
        with world_of_one():
            t = tiny_run(tmp_path / name, config="conf/grpo_tiny.yaml").trainer()
            assert t.old_logp_source() == "fused" and t.ref_beside_actor  # one rank hosts every role
            t.ref_beside_actor = beside
            metrics = t.step(0)
            return metrics, {n: p.detach().clone() for n, p in t.roles.actor.runner.named_parameters()}

    finished, taken = [], []
    finish, take = PPOTrainer.finish_scoring, DeviceRows.take
    monkeypatch.setattr(PPOTrainer, "finish_scoring", staticmethod(
        lambda deferred, timer: finished.append([d[0] for d in deferred]) or finish(deferred, timer)))
    monkeypatch.setattr(DeviceRows, "take", lambda self, mb: taken.append(len(mb)) or take(self, mb))
    device_m, device_w = one_step("device")
    assert ["ref"] not in finished and sum(taken) > 0  # no host round trip: the update took the rows
    n_taken = len(taken)
    deferred_m, deferred_w = one_step("deferred", beside=False)
    assert ["ref"] in finished and len(taken) == n_taken
    score = PPOTrainer.score
    monkeypatch.setattr(PPOTrainer, "score", lambda self, *a, defer=(), **k: score(self, *a, **k))
    waited_m, waited_w = one_step("waited")
    for key in ("actor/pg_loss", "actor/kl", "actor/grad_norm", "reward/mean"):
        assert device_m[key] == waited_m[key] == deferred_m[key], key
    for n, w in waited_w.items():
        torch.testing.assert_close(device_w[n], w, rtol=0, atol=0)
        torch.testing.assert_close(deferred_w[n], w, rtol=0, atol=0)
