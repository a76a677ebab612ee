"""ppo/roles/workers.py, ppo/roles/actor_critic.py and ppo/roles/build.py in one process: the workers' log-probs and
values equal a plain per-sequence forward of the same weights, and the fused old-log-prob updates (one mini-batch, or
the first of several) equal the recomputed one."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from models.heads import LlamaForValue
from models.llama import LlamaForCausalLM
from ppo.batch.step_batch import DeviceRows, StepBatch
from ppo.metrics.timing import StageTimer
from ppo.roles.build import _build
from ppo.run.state import load_worker_state, worker_state
from ppo.settings import UpdateSettings
from tests.ppo.world import tiny_run, world_of_one


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    with world_of_one():
        run = tiny_run(tmp_path_factory.mktemp("workers"))
        t = run.trainer()
        exp, _ = t.generate(0, StageTimer(run.env.device))
        yield t, exp


def _reference(cls, trainer):
    """The role's model before any update, unparallelized: the same seeded init."""
    return _build(cls, trainer.roles.model_config, path=None, device="cpu", seed=trainer.settings.run.seed)


def test_policy_logprobs_equal_per_sequence_forward(trainer):
    t, exp = trainer
    actor = t.roles.actor
    # a small token budget: several packed micro-batches, each with several documents
    plan = t.roles.actor_plan(exp, max_tokens=24)
    assert len(plan[0]) > 1 and max(len(mb) for mb in plan[0]) > 1
    got = actor.compute_logprobs(exp, plan, with_entropy=True)
    assert sorted(got["logp"]) == [s.uid for s in exp.samples]
    ref = _reference(LlamaForCausalLM, t)
    temp = t.settings.generation.temperature
    with torch.no_grad():
        for s in exp.samples:
            ids = torch.tensor(s.prompt_ids + s.response_ids)
            logp = F.log_softmax(ref(ids[None])[0, :-1].float() / temp, -1)[len(s.prompt_ids) - 1:]
            want = logp.gather(-1, ids[len(s.prompt_ids):, None])[:, 0]
            torch.testing.assert_close(got["logp"][s.uid], want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got["entropy"][s.uid], -(logp.exp() * logp).sum(-1), rtol=1e-4, atol=1e-5)
            # the generation engine sampled with the same weights: its log-probs agree
            torch.testing.assert_close(torch.tensor(s.behaviour_logprobs), want, rtol=1e-4, atol=1e-4)


def test_critic_values_equal_per_sequence_forward(trainer):
    t, exp = trainer
    critic = t.roles.critic
    ref = _reference(LlamaForValue, t)
    head = dict(critic.runner.named_parameters())["score.weight"]
    with torch.no_grad():  # the critic starts with a zero head: give both the same random one
        w = torch.randn(head.shape, generator=torch.Generator().manual_seed(0))
        head.copy_(w)
        ref.score.weight.copy_(w)
        got = critic.compute_values(exp, t.roles.critic_plan(exp, max_tokens=30))["values"]
        for s in exp.samples:
            values = ref(torch.tensor(s.prompt_ids + s.response_ids)[None])[0]
            p, r = len(s.prompt_ids), len(s.response_ids)
            torch.testing.assert_close(got[s.uid], values[p - 1:p - 1 + r], rtol=1e-5, atol=1e-5)
        head.zero_()


def test_fused_old_logp_update_equals_recomputed(trainer):
    t, exp = trainer
    roles, actor = t.roles, t.roles.actor
    mask = exp.response_mask()
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    before = copy.deepcopy(worker_state(actor))  # model shards, optimizer and LR schedule
    start = {n: p.detach().clone() for n, p in actor.runner.named_parameters()}
    fused_m = roles.update_actor(exp, StepBatch(mask=mask, advantages=adv), max_tokens=40, old_logp="fused")
    fused = {n: p.detach().clone() for n, p in actor.runner.named_parameters()}
    load_worker_state(actor, before)
    old = actor.compute_logprobs(exp, roles.actor_plan(exp, 40))["logp"]
    batch = StepBatch(mask=mask, advantages=adv, old_logp=exp.stack(old))
    recomputed_m = roles.update_actor(exp, batch, max_tokens=40, old_logp="recompute")
    for n, p in actor.runner.named_parameters():
        torch.testing.assert_close(p.detach(), fused[n], rtol=0, atol=1e-6, msg=n)
        assert not torch.equal(p.detach(), start[n]), f"{n} did not move"
    for m in (fused_m, recomputed_m):
        assert m["clipfrac"] == 0.0 and m["ratio_mean"] == pytest.approx(1.0)
    assert fused_m["pg_loss"] == pytest.approx(recomputed_m["pg_loss"], abs=1e-6)
    assert "entropy" in fused_m and "entropy" not in recomputed_m  # fused: the update measures the entropy
    load_worker_state(actor, before)


def test_fused_first_update_equals_recomputed_over_two_mini_batches(trainer):
    """One epoch over two mini-batches: the first takes its old log-probs from its own forward (before any optimizer
    step), the second from a forward of its samples only, before the update; the update equals the one that
    recomputed every sample's, and it does read the second mini-batch's rows."""
    t, exp = trainer
    roles, actor = t.roles, t.roles.actor
    saved = roles.settings
    roles.settings = dataclasses.replace(saved, actor_update=UpdateSettings(epochs=1, mini_batch_size=4))
    try:
        plan = roles.actor_plan(exp, 40)
        assert len(plan) == 2  # 8 samples in mini-batches of 4
        # the mini-batches' members do not depend on the token budget (the pass before and the update may differ)
        assert [sorted(i for mb in mini for i in mb) for mini in roles.actor_plan(exp, 12)] == \
            [sorted(i for mb in mini for i in mb) for mini in plan]
        mask = exp.response_mask()
        adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3)) * mask
        before = copy.deepcopy(worker_state(actor))

        def update(old_logp, source):
            load_worker_state(actor, before)
            m = roles.update_actor(exp, StepBatch(mask=mask, advantages=adv, old_logp=old_logp), max_tokens=40,
                                   old_logp=source)
            return m, {n: p.detach().clone() for n, p in actor.runner.named_parameters()}

        every = exp.stack(actor.compute_logprobs(exp, plan)["logp"])
        later = actor.compute_logprobs(exp, plan[1:])["logp"]
        first = {exp.samples[i].uid for mb in plan[0] for i in mb}
        assert set(later) == {s.uid for s in exp.samples} - first
        recomputed_m, recomputed = update(every, "recompute")
        fused_m, fused = update(exp.stack(later, partial=True), "fused_first")
        for n, p in fused.items():
            torch.testing.assert_close(p, recomputed[n], rtol=0, atol=1e-6, msg=n)
        assert fused_m["pg_loss"] == pytest.approx(recomputed_m["pg_loss"], abs=1e-6)
        assert "entropy" in fused_m and "entropy" not in recomputed_m  # the update measures the entropy
        # the second mini-batch's rows are read: wrong ones train differently
        _, wrong = update(exp.stack(later, partial=True) - 1.0, "fused_first")
        assert any(not torch.allclose(p, recomputed[n], atol=1e-6) for n, p in wrong.items())
        with pytest.raises(RuntimeError, match="fused_first"):
            roles.update_actor(exp, StepBatch(mask=mask, advantages=adv), max_tokens=40, old_logp="fused")
    finally:
        roles.settings = saved
        load_worker_state(actor, before)


def test_loss_metrics_do_not_depend_on_the_micro_batch_count(trainer):
    """pg_loss is the update's loss whether its samples ran as one micro-batch or several (each micro-batch's
    metric is its share over the global denominator: summed, not averaged)."""
    t, exp = trainer
    roles, actor = t.roles, t.roles.actor
    mask = exp.response_mask()
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2)) * mask
    before = copy.deepcopy(worker_state(actor))
    old = actor.compute_logprobs(exp, roles.actor_plan(exp, 10_000))["logp"]
    batch = StepBatch(mask=mask, advantages=adv, old_logp=exp.stack(old))
    assert len(roles.actor_plan(exp, 24)[0]) > 2 and len(roles.actor_plan(exp, 10_000)[0]) == 1
    many = roles.update_actor(exp, batch, max_tokens=24, old_logp="recompute")
    load_worker_state(actor, before)
    one = roles.update_actor(exp, batch, max_tokens=10_000, old_logp="recompute")
    load_worker_state(actor, before)
    # at the generating policy the ratios are 1: the loss is minus the token mean of the advantages
    want = -(adv * mask).sum().item() / mask.sum().item()
    assert one["pg_loss"] == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert many["pg_loss"] == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_lazy_packs_build_each_item_once_on_first_access():
    from ppo.roles.workers import LazyList

    built = []
    items = LazyList(3, lambda k: built.append(k) or k * 10)
    assert built == [] and len(items) == 3
    assert items[1] == 10 and items[1] == 10 and built == [1]
    assert list(items) == [0, 10, 20] and built == [1, 0, 2]  # a pipeline runner's list(): all, in order


def test_to_host_is_one_copy_of_every_shape():
    from ppo.roles.workers import to_host

    xs = [torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(4), torch.randn(1, 1, dtype=torch.float64)]
    for x, y in zip(xs, to_host(xs)):
        assert y.dtype == torch.float32 and torch.equal(y, x.float())


def test_metric_floats_read_every_tensor_in_one_copy(monkeypatch):
    from ppo.roles.workers import metric_floats

    ms = [{"pg_loss": torch.tensor(0.25), "n": 3, "ratio_max": torch.tensor(1.5, dtype=torch.bfloat16)},
          {"ratio_max": torch.tensor(2.0), "pg_loss": torch.tensor(-1.0, dtype=torch.float64), "n": 4}]
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real(t))
    out = metric_floats(ms)
    assert reads == [torch.Size([4])]  # one stacked read, not one per value
    assert out == [{"pg_loss": 0.25, "n": 3, "ratio_max": 1.5}, {"ratio_max": 2.0, "pg_loss": -1.0, "n": 4}]
    assert [list(m) for m in out] == [list(m) for m in ms]
    assert metric_floats([{}, {"a": 1.0}]) == [{}, {"a": 1.0}]


def test_score_enqueues_the_forwards_before_rewards_and_waits_last(trainer, monkeypatch):
    """Trainer.score launches every forward, scores rule rewards while their kernels run, then waits; a deferred
    reference comes back as a handle whose get() waits for it, or hands over its rows on the device."""
    from ppo.roles.workers import PendingResults
    from ppo.trainer import ReferenceRoute

    t, exp = trainer
    roles, calls = t.roles, []

    def recorded(obj, name, label):
        fn = getattr(obj, name)
        monkeypatch.setattr(obj, name, lambda *a, **k: calls.append(label) or fn(*a, **k))

    recorded(roles.actor, "launch_logprobs", "launch actor")
    recorded(roles.ref, "launch_logprobs", "launch ref")
    recorded(roles.critic, "launch_values", "launch critic")
    recorded(roles.reward, "score", "reward")
    result = PendingResults.result
    monkeypatch.setattr(PendingResults, "result", lambda self: calls.append("wait") or result(self))
    timer = StageTimer(t.device)
    got, ref_pass = t.score(exp, timer, old_logp="recompute")
    assert calls == ["launch actor", "launch ref", "launch critic", "reward", "wait", "wait", "wait"]
    assert ref_pass is None
    want = roles.ref.compute_logprobs(exp, roles.ref_plan(exp, t.budgets["ref"]))["logp"]
    assert sorted(got) == sorted(["old_logp", "entropy", "ref_logp", "values", "score", "reward_failed"])
    for uid, logp in want.items():
        torch.testing.assert_close(got["ref_logp"][uid], logp)
    # a deferred reference is launched but not waited for: the step's ReferenceLogprobs handle does that, once
    calls.clear()
    route = ReferenceRoute(defer=True)
    got, ref_pass = t.score(exp, timer, old_logp="fused", route=route)
    assert calls == ["launch ref", "launch critic", "reward", "wait"] and "ref_logp" not in got
    ref = t.reference_logprobs(exp, got, ref_pass, route=route, timer=timer)
    assert ref.host is None and calls[-1] == "wait" and len(calls) == 4
    late = ref.get()
    assert calls[-1] == "wait" and len(calls) == 5 and ref.get() is late and len(calls) == 5
    torch.testing.assert_close(late, exp.stack(want), rtol=0, atol=0)
    # waited for with the other scores: the handle holds the host rows, for the advantages' KL
    got, ref_pass = t.score(exp, timer, old_logp="fused")
    ref = t.reference_logprobs(exp, got, ref_pass, route=ReferenceRoute(), timer=timer)
    assert ref_pass is None and ref.host is ref.get() and torch.equal(ref.get(), late)
    # on the device: the deferred pass's rows, the same values, and no wait
    route = ReferenceRoute(defer=True, on_device=True)
    got, ref_pass = t.score(exp, timer, old_logp="fused", route=route)
    calls.clear()
    rows = t.reference_logprobs(exp, got, ref_pass, route=route, timer=timer).get()
    assert isinstance(rows, DeviceRows) and calls == []
    torch.testing.assert_close(rows.take(list(range(len(exp.samples)))), late, rtol=0, atol=0)



def test_device_rows_equal_the_host_rows_for_any_partition(trainer):
    """DeviceRows.take: the reference pass's own tensor for one of its micro-batches, and for a micro-batch of
    another plan (another token budget) the same rows gathered, each equal to the host path's exp.stack rows."""
    t, exp = trainer
    actor = t.roles.actor
    pending = actor.launch_logprobs(exp, t.roles.actor_plan(exp, max_tokens=24))
    rows = pending.logp_rows
    host = exp.stack(pending.result()["logp"])
    own = t.roles.actor_plan(exp, max_tokens=24)[0][0]
    assert rows.take(own) is not None and rows._by_mb[tuple(own)].data_ptr() == rows.take(own).data_ptr()
    for mb in [m for mini in t.roles.actor_plan(exp, max_tokens=40) for m in mini] + [[len(exp.samples) - 1, 0]]:
        got = rows.take(mb)
        width = max(len(exp.samples[i].response_ids) for i in mb)
        assert got.shape == (len(mb), width)
        torch.testing.assert_close(got, host[mb, :width], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="other ranks"):
        DeviceRows(exp, [(own, rows.take(own))]).take([i for i in range(len(exp.samples)) if i not in own][:1])


def test_plans_and_packs_are_derived_once_per_batch(trainer):
    """The reference's forward and the update with the same token budget share one plan and its packed
    micro-batches (Experience.derive), and another budget plans anew."""
    t, exp = trainer
    fresh = type(exp)(exp.samples)
    a = t.roles.ref_plan(fresh, 24)
    assert t.roles.actor_plan(fresh, 24) is a and t.roles.actor_plan(fresh, 40) is not a
    packs, _ = t.roles.actor._packs(fresh, a[0], t.roles.actor.pad_id)
    ref_packs, _ = t.roles.ref._packs(fresh, a[0], t.roles.ref.pad_id)
    assert all(packs[k] is ref_packs[k] for k in range(len(a[0])))
