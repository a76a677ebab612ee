"""End-to-end: the algorithm variants (DAPO dynamic sampling and overlong handling, GSPO, Dr. GRPO,
rollout correction) wired through `torchrun launcher/main.py`, one process on gloo."""

from __future__ import annotations

import pytest

from tests.ppo.test_trainer import _ok, launch, metrics


@pytest.mark.distributed
def test_grpo_dynamic_sampling_trains_only_on_informative_groups(tmp_path):
    # GRPO, 4 samples per prompt on a small task: after the warm-up most groups score all-equal
    # (reward ~0.25), which carry no signal. Dynamic sampling must drop every one of them and still finish.
    # (No overlong shaping here: its length penalty would give nearly every group some variance.)
    res = launch(tmp_path, 1, "conf/grpo_tiny.yaml", "trainer.total_steps=2", "trainer.experiment_name=dapo",
                 "trainer.sft_warmup_steps=35", "data.batch_size=4", "rollout.n=4",
                 "actor.ppo_epochs=1", "actor.mini_batch_size=0",  # fused old log-probs: ratio == 1
                 "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=12",
                 "algorithm.overlong_filter=true", "algorithm.norm_adv_by_std=false",
                 "actor.loss_agg=seq-mean-token-sum-norm", "actor.policy_loss=gspo", "actor.clip_low=0.0003",
                 "actor.clip_high=0.0004", "algorithm.rollout_correction=tis+seq_mask")
    _ok(res)
    rows = metrics(tmp_path / "dapo")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward/zero_var_group_frac"] == 0.0, r  # no zero-variance group reached the update
        assert r["dapo/filled_zero_var_groups"] == 0.0
        assert r["reward/failed"] == 0.0  # the rounds' reward results reach the step with the kept samples
        assert 1 <= r["dapo/gen_rounds"] <= 12
        for key in ("rollout_corr/kl", "rollout_corr/ratio_max", "rollout_corr/ratio_min", "rollout_corr/masked_frac",
                    "rollout_corr/tis_clipfrac", "dapo/overlong_filtered_frac",
                    "actor/pg_loss"):
            assert key in r, key
        # fp32 on CPU: the engine and the trainer agree, so nothing is masked or truncated
        assert r["rollout_corr/masked_frac"] == 0.0 and abs(r["rollout_corr/ratio_max"] - 1) < 1e-4
    # the dropped groups existed: without dynamic sampling they would have been trained on
    assert sum(r["dapo/groups_dropped"] for r in rows) > 0
