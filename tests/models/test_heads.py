"""Reward model scores equal transformers' *ForSequenceClassification; critic shapes and loading."""

import json

import pytest
import torch

from models import (
    LlamaForSequenceClassification,
    LlamaForValue,
    ModelConfigError,
    build_model,
    last_token_index,
    load_pretrained,
    save_pretrained,
)
from tests.models.hf_fixtures import SMALL, randomize_

transformers = pytest.importorskip("transformers")
PAD = 0


@pytest.fixture(scope="module")
def hf_rm(tmp_path_factory):
    cfg = transformers.LlamaConfig(num_labels=1, pad_token_id=PAD, **SMALL)
    model = transformers.LlamaForSequenceClassification(cfg).float().eval()
    randomize_(model, seed=7)
    path = tmp_path_factory.mktemp("rm")
    model.save_pretrained(str(path))
    return model, path


def _right_padded(lengths, t, *, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (len(lengths), t), generator=gen)  # 1..127: never the pad id inside
    for row, n in enumerate(lengths):
        ids[row, n:] = PAD
    return ids


def test_reward_scores_equal_transformers(hf_rm):
    hf, path = hf_rm
    rm = load_pretrained(path, model_cls=LlamaForSequenceClassification)
    assert rm.config.pad_token_id == PAD and rm.score.weight.shape == (1, 64)
    lengths = [9, 4, 12]
    ids = _right_padded(lengths, 12, seed=1)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=(ids != PAD).long()).logits.squeeze(-1)  # [B]
        got = rm.sequence_scores(ids)  # pad id from config.json
        got_len = rm.sequence_scores(ids, lengths=torch.tensor(lengths))
        per_token = rm(ids)
    assert got.shape == (3,) and got.dtype == torch.float32 and per_token.shape == (3, 12, 1)
    assert (got - ref).abs().max() <= 1e-4
    torch.testing.assert_close(got_len, got, rtol=0, atol=0)
    assert ref.std() > 1e-3  # distinct rows: the pooling index matters


def test_last_token_index_matches_transformers_rule():
    ids = torch.tensor([[5, 6, 7, 0, 0], [0, 0, 3, 4, 9], [0, 0, 0, 0, 0], [1, 2, 3, 4, 5]])
    assert last_token_index(ids, pad_token_id=0).tolist() == [2, 4, 0, 4]  # right, left, all-pad, no pad
    assert last_token_index(ids, lengths=torch.tensor([3, 5, 1, 5])).tolist() == [2, 4, 0, 4]
    assert last_token_index(ids[:1]).tolist() == [4]
    with pytest.raises(ValueError, match="needs pad_token_id or lengths"):
        last_token_index(ids)


def test_critic_from_reward_model_reuses_score(hf_rm):
    hf, path = hf_rm
    critic = load_pretrained(path, model_cls=LlamaForValue)
    assert torch.equal(critic.score.weight, hf.score.weight)
    ids = _right_padded([6, 6], 6, seed=2)
    with torch.no_grad():
        values = critic(ids)
        ref = hf(input_ids=ids).logits.squeeze(-1)
    assert values.shape == (2, 6) and values.dtype == torch.float32
    assert (values[:, -1] - ref).abs().max() <= 1e-4


def test_critic_from_actor_starts_at_zero_and_learns(tmp_path):
    actor = build_model("tiny", seed=8)
    save_pretrained(actor, tmp_path / "actor")
    critic = load_pretrained(tmp_path / "actor", model_cls=LlamaForValue)
    assert not hasattr(critic, "lm_head") and torch.equal(critic.score.weight, torch.zeros(1, 64))
    assert torch.equal(critic.model.layers["2"].mlp.up_proj.weight, actor.model.layers["2"].mlp.up_proj.weight)
    ids = torch.randint(0, 512, (2, 7))
    values = critic(ids)
    assert values.shape == (2, 7) and values.dtype == torch.float32 and torch.equal(values, torch.zeros(2, 7))
    ((values - 1.0) ** 2).mean().backward()
    assert critic.score.weight.grad.abs().sum() > 0  # zero init still learns on the first step
    bf16 = load_pretrained(tmp_path / "actor", model_cls=LlamaForValue, dtype=torch.bfloat16)
    assert bf16(ids).dtype == torch.float32


def test_critic_save_is_a_transformers_sequence_classifier(tmp_path):
    actor = build_model("tiny", seed=9)
    save_pretrained(actor, tmp_path / "actor")
    critic = load_pretrained(tmp_path / "actor", model_cls=LlamaForValue)
    with torch.no_grad():
        critic.score.weight.normal_(0, 0.1)
    save_pretrained(critic, tmp_path / "critic")
    with open(tmp_path / "critic" / "config.json") as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForSequenceClassification"] and cfg["num_labels"] == 1
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "critic"),
                                                                        dtype=torch.float32).eval()
    ids = torch.randint(1, 512, (1, 5))
    with torch.no_grad():
        assert (hf(input_ids=ids).logits.squeeze() - critic(ids)[0, -1]).abs() <= 1e-4
    again = load_pretrained(tmp_path / "critic", model_cls=LlamaForValue)
    assert torch.equal(again.score.weight, critic.score.weight)


def test_reward_model_needs_a_trained_head(tmp_path):
    save_pretrained(build_model("tiny"), tmp_path / "actor")
    with pytest.raises(ModelConfigError, match=r"missing \['score.weight'\].*unexpected \['lm_head.weight'\]"):
        load_pretrained(tmp_path / "actor", model_cls=LlamaForSequenceClassification)
