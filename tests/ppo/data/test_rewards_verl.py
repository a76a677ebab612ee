"""verl reward functions used as is: the signature is detected (or named), data_source, extra_info and
requested columns arrive from the data row, and dict results keep their extra keys as metrics."""

from __future__ import annotations

import pytest
import torch

from launcher.config.load import load_config
from ppo.batch.experience import Experience, Sample
from ppo.batch.step_batch import reward_extra_metrics
from ppo.data.reward_calls import RewardFunctionError, detect_signature, plan_reward_call
from ppo.data.rewards import RewardManager, RewardSample, load_reward_function
from ppo.data.tokenizer import load_tokenizer
from ppo.roles.build import RuleReward
from ppo.roles.generation import sample_info
from ppo.run.state import check_reward_columns
from ppo.settings import RewardSettings


def verl_score(data_source, solution_str, ground_truth, extra_info):
    """verl's documented custom reward signature (no defaults)."""
    assert data_source == "openai/gsm8k" and extra_info["split"] == "test"
    return {"score": float(solution_str.strip() == ground_truth), "acc": solution_str.strip() == ground_truth,
            "pred": solution_str.strip(), "len": len(solution_str)}


def verl_default_style(data_source, solution_str, ground_truth, extra_info=None, sandbox_url=None, **kwargs):
    """Like verl's default_compute_score: extra keyword parameters and **kwargs."""
    assert "prompt" not in kwargs and sandbox_url is None  # verl passes only its four names
    return 0.5 if extra_info is not None else -1.0


def verl_gsm8k_style(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    """The signature of verl's own verl/utils/reward_score/gsm8k.py compute_score (called by keyword)."""
    return score if solution_str.split("####")[-1].strip() == ground_truth else format_score


def _sample(uid, response, gt="42", **extra):
    return RewardSample(uid, "Q?", response, gt, {"data_source": "openai/gsm8k",
                                                   "extra_info": {"split": "test", "index": uid}, **extra})


def test_verl_signature_detected_and_called_by_keyword():
    assert detect_signature(verl_score) == "verl" and detect_signature(verl_default_style) == "verl"
    assert detect_signature(lambda response, ground_truth: 1.0) == "hybridrl"
    res = RewardManager(verl_score).score([_sample(0, "42"), _sample(1, " 7 ")])
    # before: TypeError on every sample, scored 0 and only warned about
    assert res.num_failed == 0 and res.scores == [1.0, 0.0]
    # the dict's other numeric keys come back ("pred" is text: not a metric)
    assert res.extras == [{"acc": 1.0, "len": 2.0}, {"acc": 0.0, "len": 3.0}]
    res = RewardManager(verl_default_style).score([_sample(0, "x")])
    assert res.scores == [0.5] and res.num_failed == 0
    call = plan_reward_call(verl_gsm8k_style, columns=["data_source", "extra_info", "reward_model"])
    assert call.signature == "verl" and call.columns == ()  # method/format_score/score keep their defaults
    res = RewardManager(verl_gsm8k_style).score([_sample(0, "so #### 42"), _sample(1, "#### 41")])
    assert res.scores == [1.0, 0.0] and res.num_failed == 0


def test_explicit_signature_key():
    def two_args(response, ground_truth):
        return 1.0

    assert plan_reward_call(verl_score, signature="hybridrl").signature == "hybridrl"
    with pytest.raises(RewardFunctionError, match="reward.signature=verl but .*two_args.*has no 'solution_str'"):
        RewardManager(two_args, signature="verl")
    with pytest.raises(RewardFunctionError, match="reward.signature='vrel' is not one of auto, hybridrl, verl"):
        plan_reward_call(two_args, signature="vrel")
    with pytest.raises(RewardFunctionError, match=r"must take \(response, ground_truth, ...\)"):
        plan_reward_call(lambda text: 1.0)
    assert load_config(None, ["reward.signature=verl"]).reward.signature == "verl"


def test_columns_requested_by_parameter_name():
    seen = {}

    def by_difficulty(response, ground_truth, *, difficulty, weight=2.0, data_source=None):
        seen.update(difficulty=difficulty, weight=weight, data_source=data_source)
        return weight * (response == ground_truth)

    call = plan_reward_call(by_difficulty, columns=["difficulty", "data_source", "extra_info"])
    assert call.columns == ("difficulty",)  # `weight` names no column: its default is used
    assert RewardManager(by_difficulty).score([_sample(0, "42", difficulty="hard")]).scores == [2.0]
    assert seen == {"difficulty": "hard", "weight": 2.0, "data_source": "openai/gsm8k"}
    with pytest.raises(RewardFunctionError, match=r"asks for 'difficulty', which names no data column \(columns: "
                                                  r"\['data_source', 'extra_info', 'reward_model'\]\)"):
        plan_reward_call(by_difficulty, columns=["reward_model", "data_source", "extra_info"])

    def verl_with_column(data_source, solution_str, ground_truth, extra_info, ability):
        return float(ability == "math")

    assert RewardManager(verl_with_column).score([_sample(0, "1", ability="math")]).scores == [1.0]


def test_rule_reward_carries_row_columns_and_extras(tmp_path):
    tok = load_tokenizer("builtin:char")
    row = {"data_source": "openai/gsm8k", "extra_info": {"split": "test", "index": 3},
           "columns": {"ability": "math", "reward_model": {"ground_truth": "42"}}}
    samples = [Sample(uid=i, prompt_index=0, prompt_ids=tok.encode("Q?"), response_ids=tok.encode(r) + [2],
                      behaviour_logprobs=[0.0] * (len(r) + 1), finish_reason="stop", ground_truth="42",
                      info=sample_info(row)) for i, r in enumerate(["42", "41"])]
    reward = RuleReward(RewardManager(verl_score), tokenizer=tok, rank_in_group=0, group_size=1)
    out = reward.score(Experience(samples))
    assert {k: {u: float(v) for u, v in d.items()} for k, d in out.items()} == {
        "score": {0: 1.0, 1: 0.0}, "reward_failed": {0: 0.0, 1: 0.0}, "reward/acc": {0: 1.0, 1: 0.0},
        "reward/len": {0: 2.0, 1: 2.0}}
    assert reward_extra_metrics({**out, "old_logp": {0: torch.zeros(2)}}) == {"reward/acc/mean": 0.5,
                                                                               "reward/len/mean": 2.0}


def test_check_reward_columns_before_training(tmp_path):
    (tmp_path / "r.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info, level):\n"
                                   "    return 1.0\n")
    reward = RewardSettings(function=f"{tmp_path / 'r.py'}:compute_score")
    check_reward_columns(reward, ["data_source", "extra_info", "level"])
    with pytest.raises(RewardFunctionError, match="asks for 'level', which names no data column"):
        check_reward_columns(reward, ["data_source", "extra_info", "prompt_level"])
    builtin = RewardSettings(function="builtin:task:add:1")  # the synthetic task's columns
    check_reward_columns(builtin, ["data_source", "extra_info", "ground_truth"])
    assert load_reward_function("builtin:math")("#### 42", "42") == 1.0
