"""ppo/data/rewards.py rule rewards, user-function loading, RewardManager; ppo/data/tasks.py task rewards."""

from __future__ import annotations

import logging

import pytest

from ppo.data.rewards import (
    RewardFunctionError,
    RewardManager,
    RewardSample,
    extract_answer,
    format_reward,
    last_boxed,
    length_penalty,
    load_reward_function,
    math_answer_reward,
    normalize_answer,
)
from ppo.data.tasks import DEFAULT_TASK, get_task, sft_examples, table_value, task_reward_fn
from ppo.data.tokenizer import load_tokenizer


@pytest.mark.parametrize("text,strict,flexible", [
    ("Natalia sold 48 clips... so 48+24 = 72\n#### 72", "72", "72"),
    ("#### 1,234.", "1,234", "1,234"),
    ("first #### 3 then corrected #### -5", "-5", "-5"),
    (r"the answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}", r"\frac{1}{2}"),
    (r"\boxed{a_{i}^{2}} and later \boxed{ {x} + {y} }", "{x} + {y}", "{x} + {y}"),
    (r"\boxed{7} but finally #### 8", "8", "8"),
    (r"#### 8 but finally \boxed{9}", "9", "9"),
    ("I think it is 17 apples, not 3.5 pears", None, "3.5"),
    (r"\boxed{unclosed {", None, None),
    ("nothing here", None, None),
])
def test_extract_answer(text, strict, flexible):
    assert extract_answer(text, method="strict") == strict
    assert extract_answer(text, method="flexible") == flexible


def test_extract_answer_bad_method():
    with pytest.raises(ValueError, match="strict"):
        extract_answer("x", method="lenient")


def test_last_boxed_nested():
    assert last_boxed(r"\fbox{{a}{b{c}}}") == "{a}{b{c}}"
    assert last_boxed("no box") is None


@pytest.mark.parametrize("a,b", [("1,000", "1000"), ("3.0", "3"), ("$42", "42"), ("0.5", r"\frac{1}{2}"),
                                 ("46.", "46"), (" 12 ", "12"), (r"\text{5}", "5"), ("+3", "3"), ("50%", "50"),
                                 ("1,000.50", "1000.5"), (r"\dfrac{6}{4}", "1.5")])
def test_normalize_answer_equal(a, b):
    assert normalize_answer(a) == normalize_answer(b)


@pytest.mark.parametrize("a,b", [("1000", "100"), ("3.01", "3"), ("x+1", "x+2"), ("-5", "5")])
def test_normalize_answer_different(a, b):
    assert normalize_answer(a) != normalize_answer(b)


def test_math_answer_reward():
    assert math_answer_reward("... #### 1,000", "1000") == 1.0
    assert math_answer_reward(r"so \boxed{0.50}", "1/2") == 1.0
    assert math_answer_reward("... #### 999", "1000") == 0.0
    assert math_answer_reward("the answer is 72", "72") == 0.0  # strict needs #### or \boxed
    assert math_answer_reward("the answer is 72", "72", method="flexible") == 1.0
    # a full GSM8K solution as ground truth
    assert math_answer_reward("#### 72", "48/2 = 24\n48+24 = 72\n#### 72") == 1.0
    assert math_answer_reward("#### 5", 5, correct=2.0) == 2.0
    assert math_answer_reward("nothing", "5", incorrect=-1.0) == -1.0


def test_format_reward():
    pat = r"<think>.*</think>\s*<answer>.*</answer>"
    assert format_reward("<think>a\nb</think>\n<answer>4</answer>", pattern=pat) == 1.0
    assert format_reward("<answer>4</answer>", pattern=pat) == 0.0
    assert format_reward("x <answer>4</answer> y", pattern=r"<answer>\d+</answer>", match="search", score=0.5) == 0.5
    with pytest.raises(ValueError, match="fullmatch"):
        format_reward("x", pattern="x", match="prefix")


def test_length_penalty():
    kw = dict(max_length=100, buffer=20, penalty=1.0)
    assert length_penalty(50, **kw) == 0.0
    assert length_penalty(80, **kw) == 0.0
    assert length_penalty(90, **kw) == pytest.approx(-0.5)
    assert length_penalty(100, **kw) == pytest.approx(-1.0)
    assert length_penalty(150, **kw) == -1.0
    with pytest.raises(ValueError, match="buffer"):
        length_penalty(10, max_length=10, buffer=0)


def test_load_reward_function_from_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("import math\nCONST = 3\n\ndef score(response, ground_truth, **extra):\n"
                 "    return float(response.strip() == ground_truth) + extra.get('bonus', 0.0)\n")
    fn = load_reward_function(f"{f}:score")
    assert fn("42 ", "42") == 1.0 and fn("1", "42", bonus=0.5) == 0.5
    assert load_reward_function("ppo.data.rewards:math_answer_reward") is math_answer_reward


def test_builtin_reward_functions():
    assert load_reward_function("builtin:math")("#### 4", "4") == 1.0
    assert load_reward_function("builtin:math")("it is 4", "4") == 0.0
    assert load_reward_function("builtin:math_flexible")("it is 4", "4") == 1.0
    task_fn = load_reward_function("builtin:task:reverse:3")
    assert task_fn("321", "321") == 1.0 and task_fn("123", "321") == 0.0
    assert load_reward_function("builtin:task:add")("7", "7", prompt="3+4=") == 1.0
    with pytest.raises(RewardFunctionError, match="built-in tasks"):
        load_reward_function("builtin:task:div")
    with pytest.raises(RewardFunctionError, match="builtin:task:<task>"):
        load_reward_function("builtin:gsm8k")


def test_load_reward_function_errors(tmp_path):
    with pytest.raises(RewardFunctionError, match="path/to/file.py:function_name"):
        load_reward_function("no_colon.py")
    with pytest.raises(RewardFunctionError, match="does not exist"):
        load_reward_function(str(tmp_path / "missing.py") + ":fn")
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    with pytest.raises(RewardFunctionError, match="SyntaxError") as e:
        load_reward_function(f"{bad}:f")
    assert str(bad) in str(e.value)
    ok = tmp_path / "ok.py"
    ok.write_text("X = 1\ndef other(r, g):\n    return 0.0\n")
    with pytest.raises(RewardFunctionError, match=r"no function 'score'.*other"):
        load_reward_function(f"{ok}:score")
    with pytest.raises(RewardFunctionError, match="not a function"):
        load_reward_function(f"{ok}:X")
    with pytest.raises(RewardFunctionError, match="no_such_module"):
        load_reward_function("no_such_module:fn")
    assert issubclass(RewardFunctionError, ValueError)


def _flaky(response, ground_truth):
    if response == "boom":
        raise RuntimeError("kaboom")
    if response == "none":
        return None
    if response == "nan":
        return float("nan")
    return 1.0 if response == ground_truth else 0.0


def test_reward_manager_survives_failures(caplog):
    log = logging.getLogger("test_rewards")
    mgr = RewardManager(_flaky, default_score=-1.0, logger=log)
    batch = [RewardSample(0, "p", "42", "42"), ("id-1", "p", "boom", "42"), ("id-2", "p", "none", "1"),
             RewardSample(3, "p", "nan", "1"), RewardSample(4, "p", "7", "42")]
    with caplog.at_level(logging.WARNING, logger="test_rewards"):
        res = mgr.score(batch)
        res2 = mgr.score(batch[1:2])  # the same sample failing again is not logged again
    assert res.scores == [1.0, -1.0, -1.0, -1.0, 0.0]
    assert res.num_failed == 3 and set(res.failures) == {"id-1", "id-2", 3}
    assert "RuntimeError: kaboom" in res.failures["id-1"]
    assert res2.scores == [-1.0] and res2.num_failed == 1
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("id-1" in m for m in msgs) == 1
    assert any("kaboom" in m for m in msgs)
    assert mgr.total_failed == 4 and mgr.total_scored == 6
    assert mgr.score_batch(batch[:2]) == [1.0, -1.0] and mgr.total_failed == 5


def _slow(response, ground_truth):
    if response == "hang":
        import time

        time.sleep(30)
    return 1.0


def test_reward_manager_timeout():
    mgr = RewardManager(_slow, default_score=0.0, timeout_s=0.2)
    res = mgr.score([("a", "p", "ok", "x"), ("b", "p", "hang", "x"), ("c", "p", "ok", "x")])
    assert res.scores == [1.0, 0.0, 1.0]
    assert "RewardTimeout" in res.failures["b"] and "timeout_s=0.2" in res.failures["b"]


def test_reward_manager_passes_only_accepted_extras():
    seen = {}

    def fn(response, ground_truth, *, data_source=None):
        seen["ds"] = data_source
        return {"score": 2.0, "acc": 1.0}

    res = RewardManager(fn).score([RewardSample("a", "p", "r", "g", {"data_source": "gsm8k", "extra_info": {}})])
    assert res.scores == [2.0] and res.num_failed == 0 and seen["ds"] == "gsm8k"

    def kw(response, ground_truth, **extra):
        seen.update(extra)
        return 1

    RewardManager(kw).score([RewardSample("b", "the prompt", "r", "g", {"extra_info": {"k": 1}})])
    assert seen["prompt"] == "the prompt" and seen["sample_id"] == "b" and seen["extra_info"] == {"k": 1}


def test_tasks_generate_and_reward():
    for name in ("add", "copy", "reverse", "add:3", "reverse:5", "lookup:3", DEFAULT_TASK):
        task = get_task(name)
        rows = task.generate(50, seed=3)
        assert rows == task.generate(50, seed=3) and rows != task.generate(50, seed=4)
        for r in rows:
            assert task.reward(r["ground_truth"], r["ground_truth"]) == 1.0
            assert task.reward(" " + r["ground_truth"] + "</s>", r["ground_truth"]) == 1.0
            assert task.reward(r["ground_truth"] + "0", r["ground_truth"]) == 0.0
    add = get_task("add:2")
    for r in add.generate(20, seed=0):
        a, b = r["prompt"].rstrip("=").split("+")
        assert int(r["ground_truth"]) == int(a) + int(b)
    rev = get_task("reverse:4").generate(5, seed=0)
    assert all(r["ground_truth"] == r["prompt"][1:-1][::-1] for r in rev)
    assert get_task("reverse:3").partial_reward("123", "124") == pytest.approx(2 / 3)
    assert get_task("reverse:3").partial_reward("12", "123") == pytest.approx(2 / 3)
    assert task_reward_fn("copy:3")("555", "555") == 1.0
    keys = get_task("lookup:3").generate(400, seed=0)  # the table: 2-digit values spread over 00..99, fixed per key
    assert all(len(r["prompt"]) == 4 and r["ground_truth"] == table_value(r["prompt"][:3]) for r in keys)
    assert len({r["ground_truth"] for r in keys}) > 90 and table_value("abc") != table_value("abd")
    for bad, msg in (("div", "built-in tasks"), ("add:x", "integer"), ("copy:0", "1..12")):
        with pytest.raises(ValueError, match=msg):
            get_task(bad)


def test_sft_examples_end_with_eos_and_filter():
    tok = load_tokenizer("builtin:char")
    pairs = sft_examples("reverse:3", 40, seed=0, tokenizer=tok)
    assert len(pairs) == 40
    for p, a in pairs:
        assert a[-1] == tok.eos_token_id and len(a) == 4
        assert tok.decode(a[:-1]) == tok.decode(p)[1:-1][::-1]
    low = sft_examples("add:1", 30, seed=0, tokenizer=tok, keep=lambda r: int(r["ground_truth"]) < 5)
    assert len(low) == 30 and all(int(tok.decode(a[:-1])) < 5 for _, a in low)
    with pytest.raises(ValueError, match="loosen the filter"):
        sft_examples("add:1", 5, seed=0, tokenizer=tok, keep=lambda r: False)


def _two_bugs(response, ground_truth):
    if response.startswith("a"):
        raise KeyError(response)
    raise ValueError(f"cannot parse {response!r}")


def test_every_distinct_error_is_logged_once_with_a_sample(caplog):
    mgr = RewardManager(_two_bugs, logger=logging.getLogger("test_rewards"))
    with caplog.at_level(logging.WARNING, logger="test_rewards"):
        mgr.score([("s0", "p", "x1", "1"), ("s1", "p", "x2", "1")])  # step 1: one error, twice
        mgr.score([("s2", "p", "x3", "1"), ("s3", "p", "a4", "1")])  # step 2: a new error appears
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and len(mgr.errors) == 2
    assert "ValueError: cannot parse 'x1'" in msgs[0] and "sample s0" in msgs[0]
    assert "KeyError" in msgs[1] and "sample s3" in msgs[1] and "'a4'" in msgs[1]
    assert mgr.total_failed == 4


def test_a_function_hanging_on_every_sample_costs_three_timeouts_per_batch():
    import time

    mgr = RewardManager(_slow, timeout_s=0.1)
    t0 = time.monotonic()
    res = mgr.score([(i, "p", "hang", "x") for i in range(10)])
    assert time.monotonic() - t0 < 1.0 and res.num_failed == 10
    assert sum("RewardTimeout" in f for f in res.failures.values()) == 3
    assert "timed out on 3 samples in a row" in res.failures[9]
    res = mgr.score([("a", "p", "hang", "x"), ("b", "p", "hang", "x"), ("c", "p", "ok", "x"), ("d", "p", "hang", "x")])
    assert res.scores == [0.0, 0.0, 1.0, 0.0] and res.num_failed == 3  # a success resets the count


def test_the_failure_stop_fires_at_the_fraction_and_names_the_errors():
    from ppo.data.rewards import RewardFailureError, failure_error, should_stop

    assert should_stop(1.0, 1.0) and should_stop(0.5, 0.5) and not should_stop(0.49, 0.5)
    assert not should_stop(0.0, 0.0)  # a step without failures never stops
    err = failure_error(step=2, failed=6, num_samples=8, limit=0.5, function="r.py:score",
                        errors=[f"ValueError: e{i}" for i in range(7)])
    assert isinstance(err, RewardFailureError)
    msg = str(err)
    assert msg.startswith("step 3: the reward function (r.py:score) failed on 6 of 8 samples (75%, ")
    assert "e0 | e1" not in msg and "ValueError: e4" in msg and "ValueError: e5" not in msg and "(+2 more" in msg


@pytest.mark.parametrize("value", [1e300, -1e300, 1e30, 1e20, 1e7, float("inf"), float("-inf"), float("nan"),
                                   "0.5", None, [1.0]])
def test_huge_non_finite_or_non_number_scores_are_failures_never_numbers(value):
    """A score that would overflow the fp32 advantages (1e300), swamp them (1e20-1e30, 1e7 beside 0/1 scores), or
    is NaN / inf / not a number fails the sample (default_score, counted), never reaches the advantages."""
    mgr = RewardManager(lambda response, ground_truth: value if response == "bad" else 1.0, default_score=0.0)
    res = mgr.score([RewardSample("ok", "p", "good", "g"), RewardSample("b", "p", "bad", "g")])
    assert res.scores == [1.0, 0.0] and res.num_failed == 1 and set(res.failures) == {"b"}


def test_largest_accepted_score_is_max_abs_score():
    from ppo.data.reward_calls import MAX_ABS_SCORE

    mgr = RewardManager(lambda response, ground_truth: -MAX_ABS_SCORE)
    assert mgr.score([RewardSample("a", "p", "r", "g")]).scores == [-MAX_ABS_SCORE]
