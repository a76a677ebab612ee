"""Trainer.step's deferred reference wait (ppo/trainer/step.py): the advantages are computed while the reference
forward runs, and, with the reference placed like the actor, the update reads the reference's log-probs on the
device without waiting for them at all; each way the step trains exactly as one that waits for the reference
first."""

from __future__ import annotations

import pytest
import torch

from tests.ppo.world import tiny_run, world_of_one


def test_reference_logprobs_on_device_deferred_or_waited_train_identically(tmp_path, monkeypatch):
    """GRPO with a KL loss and fused old log-probs: the step whose update reads the reference's log-probs on the
    device (DeviceRows), the step that merges them on the host while the advantages are computed, and the step
    that waits for them first end with the same metrics and the same actor weights, bit for bit. Each step reads
    them through one ReferenceLogprobs handle."""
    from ppo.batch.step_batch import DeviceRows, ReferenceLogprobs
    from ppo.trainer import PPOTrainer, ReferenceRoute

    def one_step(name: str, *, beside: bool = True):
        with world_of_one():
            t = tiny_run(tmp_path / name, config="conf/grpo_tiny.yaml").trainer()
            assert t.old_logp_source() == "fused" and t.ref_beside_actor  # one rank hosts every role
            t.ref_beside_actor = beside
            metrics = t.step(0)
            return metrics, {n: p.detach().clone() for n, p in t.roles.actor.runner.named_parameters()}

    handed, taken = [], []  # (the rows were on the host before get(), what get() returned) per step
    get, take = ReferenceLogprobs.get, DeviceRows.take

    def recorded_get(self):
        ready = self.host is not None
        value = get(self)
        handed.append((ready, type(value)))
        return value

    monkeypatch.setattr(ReferenceLogprobs, "get", recorded_get)
    monkeypatch.setattr(DeviceRows, "take", lambda self, mb: taken.append(len(mb)) or take(self, mb))
    device_m, device_w = one_step("device")
    assert handed == [(False, DeviceRows)] and sum(taken) > 0  # no host round trip: the update took the rows
    n_taken = len(taken)
    deferred_m, deferred_w = one_step("deferred", beside=False)
    assert handed[-1] == (False, torch.Tensor) and len(taken) == n_taken  # waited for after the advantages
    monkeypatch.setattr(PPOTrainer, "reference_route", lambda self, old_logp: ReferenceRoute())
    waited_m, waited_w = one_step("waited")
    assert handed[-1] == (True, torch.Tensor) and len(taken) == n_taken  # merged with the other scores
    for key in ("actor/pg_loss", "actor/kl", "actor/grad_norm", "reward/mean"):
        assert device_m[key] == waited_m[key] == deferred_m[key], key
    for n, w in waited_w.items():
        torch.testing.assert_close(device_w[n], w, rtol=0, atol=0)
        torch.testing.assert_close(deferred_w[n], w, rtol=0, atol=0)


def test_a_kl_loss_without_the_reference_role_stops_the_step():
    """No reference in the plan: the handle holds nothing, and a KL loss that needs it stops the step saying so."""
    from types import SimpleNamespace

    from ppo.batch.experience import Experience
    from ppo.settings import AdvantageSettings
    from ppo.trainer import PPOTrainer, ReferenceRoute

    t = PPOTrainer.__new__(PPOTrainer)  # only what reference_logprobs reads: no process group, no roles
    t.plan = SimpleNamespace(groups={"actor": None, "rollout": None})
    t.loop = SimpleNamespace(advantages=AdvantageSettings(name="grpo"))
    assert t.reference_logprobs(Experience([]), {}, None, route=ReferenceRoute(), timer=None).get() is None
    t.loop = SimpleNamespace(advantages=AdvantageSettings(name="grpo", use_kl_loss=True))
    with pytest.raises(RuntimeError, match=r"actor.use_kl_loss needs the reference role \(ref.enabled=true\)"):
        t.reference_logprobs(Experience([]), {}, None, route=ReferenceRoute(), timer=None)
