"""ppo/run/state.py and the step loop in one process: a step's metrics (by old-log-prob source), metrics.jsonl,
and a checkpoint that restores workers, sampler, KL and batch controllers, and exports HF directories."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.ppo.world import tiny_run, world_of_one


@pytest.fixture(scope="module")
def world():
    with world_of_one():
        yield


def _trainer(tmp_path, *overrides, config="conf/ppo_tiny.yaml"):
    return tiny_run(tmp_path, *overrides, config=config).trainer(tmp_path)


def test_step_metrics_follow_the_old_logp_source(world, tmp_path):
    # ppo_tiny: KL penalty against the reference -> the old log-probs are recomputed before the update
    ppo = _trainer(tmp_path / "ppo")
    assert ppo.old_logp_source() == "recompute"
    m = ppo.step(0)
    for key in ("timing_s/old_log_prob", "timing_s/reshard", "timing_s/gen", "reshard/bytes_received",
                "mem/hybrid_peak_gb", "actor/entropy", "actor/kl", "critic/vf_loss", "perf/flops"):
        assert key in m, key
    assert m["rollout/logprob_diff_max"] < 1e-4  # engine and trainer agree on the same weights
    # grpo, one epoch over one mini-batch: the update's forward is the old log-probs' (no extra pass)
    grpo = _trainer(tmp_path / "grpo", config="conf/grpo_tiny.yaml")
    assert grpo.old_logp_source() == "fused"
    m = grpo.step(0)
    assert "timing_s/old_log_prob" not in m and "rollout/logprob_diff_max" not in m
    assert m["actor/clipfrac"] == 0.0 and "actor/entropy" in m and "reshard/bytes_received" in m
    # two mini-batches: the first's forward serves it, a forward before the update computes the second's only
    halves = _trainer(tmp_path / "halves", "actor.mini_batch_size=16", config="conf/grpo_tiny.yaml")
    assert halves.old_logp_source() == "fused_first"
    m = halves.step(0)
    assert "timing_s/old_log_prob" in m and "rollout/logprob_diff_max" not in m and "actor/entropy" in m
    assert m["rollout_corr/logprob_diff_max"] < 1e-4  # the engine's log-probs against both mini-batches' old ones
    async_ = _trainer(tmp_path / "async", "trainer.max_staleness=1", config="conf/grpo_tiny.yaml")
    assert async_.old_logp_source() == "behaviour"


def test_log_metrics_writes_null_for_non_finite(world, tmp_path):
    t = _trainer(tmp_path)
    t.state.log_metrics({"step": 1, "a": 1.5, "b": math.nan, "c": math.inf})
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1.0, "a": 1.5, "b": None, "c": None}


def test_checkpoint_restores_workers_sampler_and_controllers(world, tmp_path):
    t = _trainer(tmp_path, "controller.enabled=true", "trainer.export_hf=every_save")
    t.step(0)
    t.state.save(1, t.roles, final=False, controller=t.controller)
    ckpt = tmp_path / "checkpoints" / "step_1"
    assert (ckpt / "actor" / "config.json").exists() and (ckpt / "critic" / "config.json").exists()
    saved = {n: p.detach().clone() for n, p in t.roles.actor.runner.named_parameters()}
    sampler, kl, ctl = t.state.sampler.state_dict(), t.state.kl_ctrl.state_dict(), t.controller.state_dict()
    t.step(1)  # moves the weights, the sampler, the KL and batch controllers on
    assert t.state.sampler.state_dict() != sampler
    t.controller.micro_batch_tokens += 256
    fresh = _trainer(tmp_path, "controller.enabled=true", "trainer.resume=auto")
    start, ahead = fresh.state.maybe_resume(fresh.roles, controller=fresh.controller)
    assert start == 1 and len(ahead) == 0
    for n, p in fresh.roles.actor.runner.named_parameters():
        torch.testing.assert_close(p.detach(), saved[n], rtol=0, atol=0, msg=n)
    assert fresh.state.sampler.state_dict() == sampler and fresh.state.kl_ctrl.state_dict() == kl
    assert fresh.controller.state_dict() == ctl


def _as_megatron(state: dict, cfg, head: str) -> dict:
    """A native runner's state (one rank holding the whole model) in a megatron rank's checkpoint format: megatron
    names and layouts (models/megatron_map.py), each fp32 master with its Adam state as one distributed-optimizer
    shard covering the whole flat parameter (dp = 1)."""
    from models.megatron_map import hf_to_megatron

    names, optim = state["optim_names"], state["optim"]["state"]
    hf = {"param": state["params"], **{k: {n: optim[i][k] for i, n in enumerate(names)} for k in ("exp_avg",
                                                                                                 "exp_avg_sq")}}
    mc = {k: hf_to_megatron(v, cfg, tp=1, pp=1, pp_rank=0, head=head) for k, v in hf.items()}
    shards = {n: {"param": t.reshape(-1).clone(), "range": [0, t.numel()], "step": optim[0]["step"].clone(),
                  **{k: mc[k][n].reshape(-1).clone() for k in ("exp_avg", "exp_avg_sq")}}
              for n, t in mc["param"].items()}
    return {"params": mc["param"], "dist_optim": [shards],
            "layout": dict(tp=1, tp_rank=0, pp=1, pp_rank=0, dp=1, dp_rank=0, ep=1, head=head)}


def test_a_megatron_checkpoint_resumes_with_the_native_backend(world, tmp_path, caplog):
    """The same layout, actor and critic backend megatron -> native: maybe_resume takes the relayout path (every
    rank's state) and converts both roles' states (parallel/megatron_checkpoint.py): weights, Adam moments and step
    as saved. (The checkpoint is a native run's, written in megatron's format: megatron trains on CUDA only.)"""
    t = _trainer(tmp_path)
    t.step(0)
    want = {}
    for name, head in (("actor", "lm"), ("critic", "value")):
        worker = getattr(t.roles, name)
        native_state = worker.runner.checkpoint_state(worker.optimizer)
        worker.runner.checkpoint_state = (lambda st, h, cfg: lambda opt: _as_megatron(st, cfg, h))(
            native_state, head, worker.runner.model_config)
        worker.runner.backend = "megatron"
        want[name] = {n: (p.detach().clone(), worker.optimizer.state[p]["exp_avg_sq"].clone())
                      for n, p in worker.runner.named_parameters()}
        want[name + "_step"] = float(native_state["optim"]["state"][0]["step"])
    t.state.save(1, t.roles, final=False)
    fresh = _trainer(tmp_path, "trainer.resume=auto")
    with caplog.at_level("INFO", logger="hybridrl"):
        start, _ = fresh.state.maybe_resume(fresh.roles)
    assert start == 1 and "the actor's megatron state converted for the native backend, the critic's" in caplog.text
    for name in ("actor", "critic"):
        worker = getattr(fresh.roles, name)
        for n, p in worker.runner.named_parameters():
            weight, exp_avg_sq = want[name][n]
            assert torch.equal(p.detach(), weight) and torch.equal(worker.optimizer.state[p]["exp_avg_sq"], exp_avg_sq)
            assert float(worker.optimizer.state[p]["step"]) == want[name + "_step"]
