"""Non-finite steps are contained (ppo/trainer/): a step whose gradient norm, loss or advantages are not finite is
not applied (weights and optimizer state as before it), counted in train/nonfinite_skipped with a WARNING naming the
step and the quantity, and trainer.max_nonfinite_steps such steps in a row stop the run (exit 2 in the launcher)
with the last checkpoint untouched. Compared against the same run's weights before the skipped step."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.ppo.world import tiny_run, world_of_one


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(tmp_path, monkeypatch, caplog):
    import ppo.trainer.step as trainer_mod
    from ppo.run.checkpoint import load_model_state
    from ppo.trainer import NonFiniteStepsError

    nan_grads_at, nan_adv_at = {2}, {4, 5}  # 1-based steps
    current = [0]
    compute = trainer_mod.compute_step_batch

    def poisoned(exp, merged, **kw):
        batch, metrics, kl = compute(exp, merged, **kw)
        if current[0] in nan_adv_at:
            batch.advantages = batch.advantages.clone()
            batch.advantages[0, 0] = float("nan")
        return batch, metrics, kl

    monkeypatch.setattr(trainer_mod, "compute_step_batch", poisoned)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with world_of_one():
        t = tiny_run(tmp_path, "trainer.total_steps=6", "trainer.save_every=1", "trainer.max_nonfinite_steps=2",
                     "trainer.keep_last=10", "trainer.export_hf=every_save",
                     "reward.function=tests/launcher/fault_rewards.py:length_parity").trainer(run_dir)
        runner = t.roles.actor.runner
        fb = runner.forward_backward

        def nan_grads(batches, *, loss_fn):
            out = fb(batches, loss_fn=loss_fn)
            if current[0] in nan_grads_at:  # one gradient element: the global norm (and the step) is NaN
                p = next(p for p in runner.parameters() if p.grad is not None)
                p.grad.view(-1)[0] = float("nan")
            return out

        monkeypatch.setattr(runner, "forward_backward", nan_grads)
        weights = {}
        step = t.step

        def counted_step(i):
            current[0] = i + 1
            out = step(i)
            weights[i + 1] = {n: p.detach().clone() for n, p in runner.named_parameters()}
            return out

        monkeypatch.setattr(t, "step", counted_step)
        with caplog.at_level(logging.WARNING, logger="hybridrl"), pytest.raises(NonFiniteStepsError,
                                                                                 match="2 steps in a row"):
            t.fit()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["train/nonfinite_skipped"] for r in rows] == [0, 1, 0, 1, 1]
    same = lambda a, b: all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    assert same(weights[1], weights[2]) and not same(weights[2], weights[3])  # skipped, then trained again
    assert same(weights[3], weights[4]) and same(weights[4], weights[5])
    assert all(torch.isfinite(w).all() for w in weights[5].values())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("step 2: non-finite rank 0: actor: grad_norm=nan") for m in warnings), warnings
    assert any(m.startswith("step 4: non-finite rank 0: advantages (1 of") for m in warnings), warnings
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_1", "step_2", "step_3", "step_4"]  # step 5 stopped the run before its save
    last = load_model_state(run_dir / "checkpoints" / "step_4", "actor")  # verified against its checksums
    assert all(torch.equal(last[k], weights[3][k]) for k in weights[3])  # the last applied step's weights
