"""Config keys of the algorithm variants (DAPO, GSPO, Dr. GRPO, rollout correction): each acts in the
setting given, or the config is refused before launch."""

from __future__ import annotations

import pytest

from launcher.config.load import load_config
from launcher.config.schema import resolved_rollout_correction
from launcher.errors import UserError

GRPO = ["algorithm.name=grpo", "rollout.n=4"]


def test_variants_load():
    cfg = load_config(None, [*GRPO, "algorithm.filter_groups.enable=true",
                             "algorithm.filter_groups.max_num_gen_batches=3",
                             "algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=4",
                             "algorithm.overlong_buffer.penalty_factor=0.5", "algorithm.overlong_filter=true",
                             "algorithm.norm_adv_by_std=false", "actor.loss_agg=seq-mean-token-sum-norm",
                             "actor.policy_loss=gspo", "algorithm.rollout_correction=tis+seq_mask",
                             "algorithm.rollout_is_cap=3", "algorithm.rollout_mask_threshold=1.1"])
    assert cfg.algorithm.filter_groups.max_num_gen_batches == 3 and cfg.algorithm.overlong_buffer.len == 4
    assert resolved_rollout_correction(cfg) == "tis+seq_mask"


def test_auto_rollout_correction_follows_async():
    assert resolved_rollout_correction(load_config(None, [])) == "tis"
    assert resolved_rollout_correction(load_config(None, ["trainer.max_staleness=1"])) == "none"
    # batches generated ahead with a correction: decoupled PPO (the trainer's log-probs as the proximal policy)
    assert resolved_rollout_correction(load_config(None, ["trainer.max_staleness=2",
                                                          "algorithm.rollout_correction=tis"])) == "tis"

@pytest.mark.parametrize("overrides,needle", [
    (["algorithm.rollout_correction=none", "algorithm.rollout_is_cap=3"], "rollout_is_cap"),
    (["algorithm.rollout_correction=tis", "algorithm.rollout_mask_threshold=1.2"], "rollout_mask_threshold"),
    (["algorithm.rollout_is_cap=0.5"], "must be > 1"),
    (["algorithm.rollout_correction=seq_mask", "algorithm.rollout_mask_threshold=1.0"], "must be > 1"),
    (["algorithm.rollout_correction=is"], "rollout_correction"),
    (["actor.policy_loss=gpso"], "did you mean 'gspo'"),
    (["actor.loss_agg=seq-mean-token-sum-nrm"], "seq-mean-token-sum-norm"),
    (["algorithm.filter_groups.enable=true", "rollout.n=1"], "rollout.n >= 2"),
    ([*GRPO, "algorithm.filter_groups.enable=true", "trainer.max_staleness=2"], r"trainer.max_staleness=2 \(batches"),
    (["trainer.max_staleness=-1"], r"trainer.max_staleness\(-1\) must be >= 0"),
    (["trainer.async_rollout=true"], "replaced by trainer.max_staleness"),
    (["rollout.batches_in_flight=2"], "set trainer.max_staleness >= 1"),
    (["rollout.batches_in_flight=0"], r"rollout.batches_in_flight\(0\) must be >= 1"),
    # partial rollouts run on vLLM too (its step API), with their KV recomputed and not beside training
    (["rollout.batches_in_flight=2", "trainer.max_staleness=1", "rollout.engine=vllm", "rollout.partial_kv=keep",
      "rollout.free_memory_on_sleep=false"], "use rollout.engine=native, or remove rollout.partial_kv"),
    (["rollout.decode_beside=true", "rollout.batches_in_flight=2", "trainer.max_staleness=1", "rollout.engine=vllm"],
     "use rollout.engine=native, or remove rollout.decode_beside"),
    (["trainer.stale_policy=drop"], "set rollout.batches_in_flight >= 2"),  # batches ahead: nothing to drop
    (["trainer.stale_policy=drop", "trainer.max_staleness=2"], "set rollout.batches_in_flight >= 2"),
    (["trainer.stale_policy=drop", "rollout.batches_in_flight=2"], "set trainer.max_staleness >= 1"),  # K = 0
    (["trainer.stale_policy=wait"], "must be pace or drop"),
    # pacing keeps the bound only with 2 batches in flight (3 at K=1 trained groups 2 versions old)
    (["rollout.batches_in_flight=3", "trainer.max_staleness=2"], "set rollout.batches_in_flight=2, or"),
    (["rollout.partial_kv=stale"], "choose recompute or keep"),
    (["rollout.partial_kv=keep"], "rollout.batches_in_flight >= 2"),
    (["rollout.partial_kv=keep", "rollout.batches_in_flight=2", "trainer.max_staleness=1"],
     "rollout.free_memory_on_sleep=false"),
    (["rollout.decode_beside=true"], "set rollout.batches_in_flight=2"),
    (["rollout.decode_beside=true", "rollout.batches_in_flight=2", "trainer.max_staleness=1",
      "trainer.stale_policy=drop"], "use trainer.stale_policy=pace"),
    (["rollout.decode_beside=true", "rollout.batches_in_flight=2", "trainer.max_staleness=1",
      "rollout.free_memory_on_sleep=true"], "set it false, or leave it unset"),
    ([*GRPO, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=0"], ">= 1"),
    (["algorithm.filter_groups.max_num_gen_batches=8"], "filter_groups.enable=true"),
    (["algorithm.overlong_buffer.len=4"], "overlong_buffer.enable=true"),
    (["algorithm.overlong_buffer.penalty_factor=2"], "overlong_buffer.enable=true"),
    (["algorithm.overlong_buffer.enable=true", "rollout.max_response_length=8", "algorithm.overlong_buffer.len=9"],
     "max_response_length=8"),
    (["algorithm.overlong_buffer.enable=true"], r"overlong_buffer.len\(0\)"),
    (["algorithm.name=ppo", "algorithm.norm_adv_by_std=false"], "algorithm.name=grpo"),
])
def test_inert_or_bad_variant_keys_are_refused(overrides, needle):
    with pytest.raises(UserError, match=needle):
        load_config(None, overrides)
