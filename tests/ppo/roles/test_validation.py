"""ppo/roles/validation.py: pass@k against enumeration, metrics per data source, reward failures counted
(val/reward/failed); ppo/metrics/samples.py."""

from __future__ import annotations

import itertools
import json
import logging

import pytest

from ppo.batch.experience import Sample
from ppo.data.tokenizer import load_tokenizer
from ppo.metrics.samples import SampleLog, pick_samples
from ppo.roles.validation import pass_at_k, validation_metrics


def naive_pass_at_k(correct: list[bool], k: int) -> float:
    """Fraction of all k-subsets of the samples that hold at least one correct one."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n,c", [(1, 0), (1, 1), (4, 0), (4, 1), (4, 3), (5, 2), (8, 8), (7, 3)])
def test_pass_at_k_equals_enumeration(n, c):
    correct = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        assert pass_at_k(n, c, k) == pytest.approx(naive_pass_at_k(correct, k))
    with pytest.raises(ValueError):
        pass_at_k(n, c, n + 1)


def test_validation_metrics_per_data_source():
    groups = [("gsm8k", [1.0, 0.0, 0.0, 0.0]), ("gsm8k", [0.0, 0.0, 0.0, 0.0]),
              ("math", [1.0, 1.0, 0.5, 1.0])]
    m = validation_metrics(groups, threshold=1.0, extras={"acc": [1.0, 0.0, 1.0, 1.0]})
    assert m["val/reward/mean"] == pytest.approx(4.5 / 12)
    assert m["val/pass@1"] == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)
    assert m["val/pass@4"] == pytest.approx((1 + 0 + 1) / 3)
    assert m["val/gsm8k/reward/mean"] == pytest.approx(1 / 8) and m["val/gsm8k/pass@4"] == pytest.approx(0.5)
    assert m["val/math/reward/mean"] == pytest.approx(3.5 / 4) and m["val/math/pass@1"] == pytest.approx(0.75)
    assert m["val/reward/acc/mean"] == pytest.approx(0.75)
    # a score of 0.5 passes when the threshold says so; greedy (n = 1) reports pass@1 only
    assert validation_metrics([("", [0.5])], threshold=0.5) == {"val/reward/mean": 0.5, "val/pass@1": 1.0,
                                                                "val/unknown/reward/mean": 0.5,
                                                                "val/unknown/pass@1": 1.0}
    with pytest.raises(ValueError, match="needs 2 samples, one has 1"):
        validation_metrics([("a", [1.0, 0.0]), ("a", [1.0])], threshold=1.0)


class _FakeWriter:
    def __init__(self):
        self.texts = []

    def add_text(self, tag, text, step):
        self.texts.append((tag, text, step))


def test_sample_log_writes_jsonl_console_and_tensorboard(tmp_path, caplog):
    tok = load_tokenizer("builtin:char")
    samples = [Sample(uid=i, prompt_index=i // 2, prompt_ids=tok.encode(f"{i}+1="), response_ids=tok.encode(str(i + 1))
                      + [tok.eos_token_id], behaviour_logprobs=[], finish_reason="stop", ground_truth=str(i + 1),
                      info={"data_source": "toy|add"}) for i in range(8)]
    assert pick_samples(8, 3) == [0, 2, 4] and pick_samples(2, 4) == [0, 1] and pick_samples(0, 3) == []
    log = SampleLog(tmp_path, every=5, count=3, tokenizer=tok)
    assert [s for s in range(12) if log.due(s)] == [4, 9]
    writer = _FakeWriter()
    with caplog.at_level("INFO", logger="hybridrl"):
        log.write(4, samples, [1.0, 0.0, 0.5, 0, 1, 0, 0, 0], tensorboard=writer)
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["uid"] for r in rows] == [0, 2, 4]
    assert rows[1] == {"step": 5, "uid": 2, "data_source": "toy|add", "prompt": "2+1=", "response": "3",
                       "score": 0.5, "ground_truth": "3", "response_length": 2, "finish_reason": "stop"}
    assert sum("sample step 5 uid" in r.getMessage() for r in caplog.records) == 3
    tag, text, step = writer.texts[0]
    assert tag == "samples" and step == 5 and "toy\\|add" in text and text.count("\n") == 4


def test_validation_reward_failures_are_counted(tmp_path, caplog):
    """A reward failing on every validation sample was a plain val/reward/mean of reward.default_score; now it is
    counted (val/reward/failed) and said in a WARNING, with the function's own error."""
    from tests.ppo.world import tiny_run, world_of_one

    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": f"{i}+1=", "ground_truth": str(i + 1)}) + "\n" for i in range(4)))
    with world_of_one():
        t = tiny_run(tmp_path, f"data.val_files={val}", "rollout.val_n=1",
                     "reward.function=tests/launcher/fault_rewards.py:exits").trainer(tmp_path)
        with caplog.at_level(logging.WARNING, logger="hybridrl"):
            m = t.validate(0)
        t.roles.reward.close()
    assert m["val/reward/failed"] == 4.0 and m["val/reward/mean"] == 0.0
    assert any("failed on 4 of 4 samples" in r.getMessage() for r in caplog.records)
    assert any("SystemExit: 3" in r.getMessage() for r in caplog.records)  # the function's own error, named
