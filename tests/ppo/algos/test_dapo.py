"""ppo/algos/dapo.py against naive loops, and dynamic sampling on a scripted generator."""

from __future__ import annotations

import random

import pytest
import torch

from ppo.algos import core_algos as ca
from ppo.algos.dapo import fill_informative_groups, overlong_filter_mask, overlong_penalty, zero_variance_groups
from ppo.batch.experience import Sample


def test_zero_variance_groups_matches_naive_loop():
    rng = random.Random(0)
    gids = [rng.randrange(6) for _ in range(40)]
    scores = [float(rng.choice([0, 1])) if g % 2 else 1.0 for g in gids]
    got = zero_variance_groups(scores, gids)
    for g in set(gids):
        vals = [s for s, h in zip(scores, gids) if h == g]
        assert got[g] == (len(set(vals)) == 1), g


def test_zero_variance_groups_have_zero_grpo_advantage():
    # why they are dropped: no policy gradient (GRPO and Dr.GRPO advantages are exactly 0)
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    gids = [0, 0, 0, 1, 1, 1, 2, 2]
    flat = zero_variance_groups(scores.tolist(), gids)
    assert flat == {0: True, 1: False, 2: True}
    for norm in (True, False):
        adv, _ = ca.compute_grpo_advantages(scores, gids, torch.ones(8, 3), norm_by_std=norm)
        for i, g in enumerate(gids):
            assert (adv[i] == 0).all() == flat[g]


@pytest.mark.parametrize("max_len,buf,factor", [(20, 5, 1.0), (16, 16, 0.5), (10, 1, 2.0)])
def test_overlong_penalty_matches_paper_formula(max_len, buf, factor):
    lengths = torch.arange(0, max_len + 4)
    got = overlong_penalty(lengths, max_len=max_len, buffer_len=buf, penalty_factor=factor)
    for n, v in zip(lengths.tolist(), got.tolist()):
        if n <= max_len - buf:
            want = 0.0
        elif n <= max_len:
            want = ((max_len - buf) - n) / buf
        else:
            want = -1.0
        assert v == pytest.approx(factor * want), n
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, max_len=8, buffer_len=9)


def test_overlong_filter_masks_truncated_rows_only():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    out = overlong_filter_mask(mask, torch.tensor([True, False, False]))
    torch.testing.assert_close(out, torch.tensor([[0, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.float32))


# ---------------------------------------------------------------- dynamic sampling


def _scripted_draw(outcomes, n=4, per_round=3):
    """draw(round) -> `per_round` groups of n samples; outcomes[pid] = the group's n scores."""
    calls = []

    def draw(r):
        calls.append(r)
        pids = range(r * per_round, (r + 1) * per_round)
        samples = [Sample(uid=p * n + k, prompt_index=p, prompt_ids=[1], response_ids=[2, 3],
                          behaviour_logprobs=[0.0, 0.0], finish_reason="stop") for p in pids for k in range(n)]
        return samples, {s.uid: outcomes[s.prompt_index][s.uid % n] for s in samples}

    return draw, calls


def test_dynamic_sampling_keeps_only_informative_groups():
    flat, mixed = [1.0] * 4, [1.0, 0.0, 0.0, 1.0]
    outcomes = {p: (mixed if p in (1, 4, 5, 7) else flat) for p in range(30)}
    draw, calls = _scripted_draw(outcomes)
    out = fill_informative_groups(draw, target_groups=3, max_rounds=5)
    assert calls == [0, 1]  # round 0 gives one informative group, round 1 two more: full
    assert sorted({s.prompt_index for s in out.samples}) == [1, 4, 5]
    assert [s.uid for s in out.samples] == sorted(s.uid for s in out.samples)
    assert out.metrics == {"dapo/gen_rounds": 2.0, "dapo/groups_drawn": 6.0, "dapo/groups_dropped": 3.0,
                           "dapo/filled_zero_var_groups": 0.0, "dapo/kept_group_frac": 0.5}
    assert all(not zero_variance_groups([out.scores[s.uid] for s in out.samples if s.prompt_index == p], [p] * 4)[p]
               for p in (1, 4, 5))


def test_dynamic_sampling_is_bounded_and_tops_up():
    outcomes = {p: ([0.0, 1.0, 1.0, 1.0] if p == 2 else [0.0] * 4) for p in range(30)}
    draw, calls = _scripted_draw(outcomes)
    out = fill_informative_groups(draw, target_groups=3, max_rounds=2)
    assert calls == [0, 1]
    pids = sorted({s.prompt_index for s in out.samples})
    assert 2 in pids and len(pids) == 3 and len(out.samples) == 12
    assert out.metrics["dapo/filled_zero_var_groups"] == 2.0
    assert out.metrics["dapo/groups_dropped"] == 5.0


def test_dynamic_sampling_skips_a_prompt_drawn_twice():
    n = 2

    def draw(r):  # every round draws prompt 0 (mixed) and a fresh one
        pids = [0, r + 1]
        samples = [Sample(uid=p * n + k, prompt_index=p, prompt_ids=[1], response_ids=[2], behaviour_logprobs=[0.0],
                          finish_reason="stop") for p in pids for k in range(n)]
        return samples, {s.uid: float(s.uid % n) for s in samples}

    out = fill_informative_groups(draw, target_groups=3, max_rounds=4)
    uids = [s.uid for s in out.samples]
    assert len(uids) == len(set(uids)) == 6 and out.metrics["dapo/gen_rounds"] == 2.0


def test_trainer_adds_the_overlong_penalty_to_the_scores():
    from launcher.config.load import load_config
    from ppo.batch.experience import Experience

    cfg = load_config(None, ["algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=2",
                             "algorithm.overlong_buffer.penalty_factor=0.5", "rollout.max_response_length=4"])
    exp = Experience([Sample(uid=i, prompt_index=0, prompt_ids=[1], response_ids=[2] * n, behaviour_logprobs=[0.0] * n,
                             finish_reason="stop") for i, n in enumerate([1, 2, 3, 4])])
    out = _settings_only(cfg).shape_scores(exp, {i: torch.tensor(1.0) for i in range(4)})
    assert [round(float(out[i]), 6) for i in range(4)] == [1.0, 1.0, 0.75, 0.5]
    trainer = _settings_only(load_config(None, []))
    same = {i: torch.tensor(1.0) for i in range(4)}
    assert trainer.shape_scores(exp, same) is same


def _settings_only(cfg):
    """A PPOTrainer with only the launcher's settings for `cfg`: no process group, no roles."""
    from launcher.handoff import build_ppo_settings
    from ppo.trainer import PPOTrainer

    trainer = PPOTrainer.__new__(PPOTrainer)
    trainer.settings = build_ppo_settings(cfg, device=torch.device("cpu"))
    trainer.loop = trainer.settings.loop
    return trainer


def _trainer(*overrides):
    from launcher.config.load import load_config

    return _settings_only(load_config(None, ["algorithm.name=grpo", "rollout.n=2", "algorithm.use_kl_penalty=false",
                                             "rollout.max_response_length=3", *overrides]))


def _exp(lengths, reasons, logprobs=True):
    from ppo.batch.experience import Experience

    return Experience([Sample(uid=i, prompt_index=i // 2, prompt_ids=[1], response_ids=[2] * n,
                              behaviour_logprobs=[-0.5] * n if logprobs else [], finish_reason=r)
                       for i, (n, r) in enumerate(zip(lengths, reasons))])


def test_step_batch_carries_the_filter_mask_and_the_engine_logprobs():
    exp = _exp([3, 1, 2, 3], ["length", "stop", "stop", "length"])
    scores = {"score": {i: torch.tensor(v) for i, v in enumerate([1.0, 0.0, 1.0, 1.0])}}
    b, m = _trainer("algorithm.overlong_filter=true").compute_advantages(exp, scores, old_logp="fused")
    torch.testing.assert_close(b.rollout_logp, -0.5 * b.mask.float())
    torch.testing.assert_close(b.actor_mask.float(), torch.tensor([[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 0, 0]],
                                                                  dtype=torch.float32))
    assert (b.advantages[0] != 0).all()  # the truncated sample keeps its advantage (group baseline)
    assert m["dapo/overlong_filtered_frac"] == 0.5 and m["reward/zero_var_group_frac"] == 0.5
    b, m = _trainer().compute_advantages(exp, scores, old_logp="fused")
    assert b.actor_mask is None and "dapo/overlong_filtered_frac" not in m


def test_an_engine_without_logprobs_stops_a_rollout_correction():
    exp = _exp([2, 2], ["stop", "stop"], logprobs=False)
    scores = {"score": {0: torch.tensor(1.0), 1: torch.tensor(0.0)}}
    with pytest.raises(RuntimeError, match="algorithm.rollout_correction=none"):
        _trainer().compute_advantages(exp, scores, old_logp="fused")
    b, _ = _trainer("algorithm.rollout_correction=none").compute_advantages(exp, scores, old_logp="fused")
    assert b.rollout_logp is None  # metrics only, and nothing to measure them on
