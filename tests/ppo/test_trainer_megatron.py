"""End to end on CPU: a GRPO run whose reference model is megatron-core's GPTModel at TP=2 (forward-only
roles run megatron's model on CPU; its training path needs CUDA: tests/parallel/test_megatron_gpu.py)."""

from __future__ import annotations

import pytest

from tests.ppo.test_trainer import _ok, launch, metrics

pytest.importorskip("megatron.core")


@pytest.mark.distributed
def test_grpo_with_megatron_reference_tp2(tmp_path):
    # after the SFT warm-up the reference is loaded from the exported HF directory (each rank reads its
    # slices of the safetensors into megatron's fused layout): at step 1 it must equal the actor
    res = launch(tmp_path, 2, "conf/grpo_tiny.yaml", "trainer.total_steps=2", "trainer.experiment_name=mref",
                 "ref.backend=megatron", "ref.tp=2", "trainer.device=cpu")
    _ok(res)
    rows = metrics(tmp_path / "mref")
    assert [r["step"] for r in rows] == [1, 2]
    # native reference: 5e-9 on this run; a wrong q/k/v or gate/up layout gives KL of order 1
    assert rows[0]["actor/kl"] < 1e-6, rows[0]["actor/kl"]
    assert rows[1]["actor/kl"] > rows[0]["actor/kl"]  # the actor moved away from the reference


@pytest.mark.gpu
@pytest.mark.distributed
def test_grpo_megatron_actor_on_gpu_ratio_exactly_one(tmp_path):
    """A megatron actor (DDP + distributed optimizer, bf16 params with fp32 masters) trains in the GRPO loop
    with the hybrid engine; the in-reward KL penalty forces a separate old-log-prob pass, whose log-probs
    the update's first (only) mini-batch must reproduce bit for bit: ratio exactly 1, nothing clipped."""
    res = launch(tmp_path, 1, "conf/grpo_tiny.yaml", "trainer.total_steps=3", "trainer.experiment_name=mgpu",
                 "trainer.device=cuda", "model.dtype=bfloat16", "actor.backend=megatron",
                 "algorithm.use_kl_penalty=true", "algorithm.kl_coef=0.001", timeout=600)
    _ok(res)
    rows = metrics(tmp_path / "mgpu")
    for r in rows:
        assert r["actor/ratio_min"] == 1.0 and r["actor/ratio_max"] == 1.0, r
        assert r["actor/clipfrac"] == 0.0
    assert (tmp_path / "mgpu" / "checkpoints" / "step_3" / "actor" / "config.json").exists()  # final HF export


@pytest.mark.gpu
@pytest.mark.distributed
def test_ppo_megatron_actor_and_critic_on_gpu_checkpoint_resume(tmp_path):
    """PPO with a megatron actor and a megatron critic (value head), colocated on one GPU: it trains, saves
    the per-rank megatron state (model shards, optimizer, distributed-optimizer shards) at step 2 and
    resumes from it to step 3 in a new process; the final checkpoint exports both roles as HF directories.
    Metrics after the resume are compared loosely (GPU sampling and attention kernels need not be bitwise
    reproducible across processes)."""
    common = ["algorithm.name=ppo", "trainer.save_every=2", "trainer.device=cuda", "model.dtype=bfloat16",
              "actor.backend=megatron", "critic.backend=megatron"]
    _ok(launch(tmp_path, 1, "conf/ppo_tiny.yaml", "trainer.total_steps=2", "trainer.experiment_name=mppo",
               *common, timeout=600))
    _ok(launch(tmp_path, 1, "conf/ppo_tiny.yaml", "trainer.total_steps=3", "trainer.experiment_name=mppo",
               "trainer.resume=auto", *common, timeout=600))
    rows = metrics(tmp_path / "mppo")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(abs(r["critic/vf_loss"]) < 1e3 and r["actor/grad_norm"] > 0 for r in rows), rows
    final = tmp_path / "mppo" / "checkpoints" / "step_3"
    assert (final / "actor" / "config.json").exists() and (final / "critic" / "config.json").exists()


@pytest.mark.distributed
def test_grpo_moe_with_megatron_reference_replays_the_engine_routing(tmp_path):
    """A Qwen3-MoE policy whose reference is megatron-core's MoE model (forward-only on CPU), routing replay on: the
    reference is loaded from the SFT warm-up's HF export (experts one tensor each on disk, each rank reading its
    slices) and replays the engine's recorded experts; at step 1 it equals the native actor (KL ~ 0)."""
    res = launch(tmp_path, 1, "conf/grpo_tiny.yaml", "model.preset=tiny-qwen3-moe", "trainer.total_steps=2",
                 "trainer.experiment_name=mmoe", "ref.backend=megatron", "actor.router_replay=true",
                 "trainer.device=cpu")
    _ok(res)
    rows = metrics(tmp_path / "mmoe")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["actor/kl"] < 1e-6, rows[0]["actor/kl"]
    assert all(r["actor/aux_loss"] > 0 and 0.0 <= r["actor/router_mismatch"] <= 1.0 for r in rows), rows
