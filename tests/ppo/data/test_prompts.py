"""ppo/data/prompts.py: JSONL/Parquet prompt datasets, chat templates, filtering, and the resumable sampler."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppo.data.prompts import DataError, PromptDataset, PromptSampler
from ppo.data.tasks import get_task
from ppo.data.tokenizer import load_tokenizer

ROWS = [
    {"prompt": [{"role": "user", "content": "What is 2+3?"}], "data_source": "openai/gsm8k",
     "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"split": "train", "index": 0}},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "7*6?"}],
     "data_source": "openai/gsm8k", "reward_model": {"style": "rule", "ground_truth": "42"},
     "extra_info": {"split": "train", "index": 1}},
    {"prompt": [{"role": "user", "content": "x" * 200}], "data_source": "openai/gsm8k",
     "reward_model": {"style": "rule", "ground_truth": "0"}, "extra_info": {"split": "train", "index": 2}},
]


class _TemplateTok:
    """The char tokenizer plus a trivial chat template, to see that messages go through it."""

    def __init__(self):
        self.inner = load_tokenizer("builtin:char")
        self.chat_template = "<t>"

    def apply_chat_template(self, messages, *, add_generation_prompt=True):
        body = "".join(f"[{m['role']}]{m['content']}" for m in messages)
        return body + ("[assistant]" if add_generation_prompt else "")

    def encode(self, text):
        return self.inner.encode(text)


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_jsonl_and_parquet_agree(tmp_path, caplog):
    tok = load_tokenizer("builtin:char")
    _write_jsonl(tmp_path / "d.jsonl", ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    with caplog.at_level(logging.WARNING):
        a = PromptDataset.from_file(str(tmp_path / "d.jsonl"), tokenizer=tok, max_prompt_length=64)
        b = PromptDataset.from_file(str(tmp_path / "d.parquet"), tokenizer=tok, max_prompt_length=64)
    for ds in (a, b):
        assert len(ds) == 2 and ds.num_dropped == 1
        assert [r.ground_truth for r in ds.records] == ["5", "42"]
        assert ds[1].index == 1 and ds[1].data_source == "openai/gsm8k" and ds[1].extra_info["index"] == 1
        # no chat template in builtin:char: message contents joined
        assert ds[1].prompt_text == "Be brief.\n7*6?"
        assert tok.decode(ds[1].prompt_ids) == ds[1].prompt_text
    assert [r.prompt_ids for r in a.records] == [r.prompt_ids for r in b.records]
    assert "dropped 1 of 3 prompts longer than max_prompt_length=64" in caplog.text
    both = PromptDataset.from_files([str(tmp_path / "d.jsonl"), str(tmp_path / "d.parquet")], tokenizer=tok)
    assert len(both) == 6 and both.num_dropped == 0


def test_chat_template_applied_to_messages_only():
    tok = _TemplateTok()
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}, {"prompt": "plain text", "answer": "2"}]
    ds = PromptDataset.from_rows(rows, tokenizer=tok)
    assert ds[0].prompt_text == "[user]hi[assistant]"
    assert ds[1].prompt_text == "plain text"
    assert [r.ground_truth for r in ds.records] == ["1", "2"]  # the `answer` column


def test_ground_truth_keys():
    tok = load_tokenizer("builtin:char")
    rows = [{"prompt": "a", "ground_truth": "1", "answer": "wrong"}, {"prompt": "b", "meta": {"gold": 7}}]
    assert PromptDataset.from_rows(rows[:1], tokenizer=tok)[0].ground_truth == "1"
    assert PromptDataset.from_rows(rows[1:], tokenizer=tok, answer_key="meta.gold")[0].ground_truth == 7
    # an explicit key that a row lacks is an error naming it and the row's columns (no silent fallback)
    with pytest.raises(DataError, match=r"row 0: data.answer_key='meta.gold' names no column; columns: "
                                        r"\['prompt', 'ground_truth', 'answer'\]"):
        PromptDataset.from_rows(rows[:1], tokenizer=tok, answer_key="meta.gold")
    with pytest.raises(DataError, match=r"'meta.glod' names no column; columns: \['prompt', 'meta', 'meta.gold'\]"):
        PromptDataset.from_rows(rows[1:], tokenizer=tok, answer_key="meta.glod")
    flat = [{"question": "q", "reward_model.ground_truth": "3"}]
    assert PromptDataset.from_rows(flat, tokenizer=tok, prompt_key="question")[0].ground_truth == "3"


def test_clear_errors(tmp_path):
    tok = load_tokenizer("builtin:char")
    with pytest.raises(DataError, match="does not exist"):
        PromptDataset.from_file(str(tmp_path / "missing.parquet"), tokenizer=tok)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported format"):
        PromptDataset.from_file(str(tmp_path / "x.csv"), tokenizer=tok)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        PromptDataset.from_file(str(tmp_path / "bad.jsonl"), tokenizer=tok)
    with pytest.raises(DataError, match=r"row 0: data.prompt_key='question' names no column; columns: \['prompt'"):
        PromptDataset.from_rows([{"prompt": "a", "answer": "1"}], tokenizer=tok, prompt_key="question")
    with pytest.raises(DataError, match=r"row 1: no ground truth at reward_model.ground_truth / ground_truth / answer"):
        PromptDataset.from_rows([{"prompt": "a", "answer": "1"}, {"prompt": "b"}], tokenizer=tok)
    with pytest.raises(DataError, match=r"data.answer_key='gold' names no column; columns: \['prompt'\]"):
        PromptDataset.from_rows([{"prompt": "b"}], tokenizer=tok, answer_key="gold")
    with pytest.raises(DataError, match="raise data.max_prompt_length"):
        PromptDataset.from_rows([{"prompt": "abcdef", "answer": "1"}], tokenizer=tok, max_prompt_length=3)
    with pytest.raises(DataError, match="string or a list"):
        PromptDataset.from_rows([{"prompt": 5, "answer": "1"}], tokenizer=tok)


def test_from_task():
    tok = load_tokenizer("builtin:char")
    ds = PromptDataset.from_task("reverse:3", 20, seed=1, tokenizer=tok)
    rows = get_task("reverse:3").generate(20, seed=1)
    assert len(ds) == 20 and ds[0].data_source == "reverse:3"
    assert [r.prompt_text for r in ds.records] == [r["prompt"] for r in rows]
    assert [r.ground_truth for r in ds.records] == [r["ground_truth"] for r in rows]
    assert ds.row(3) == {"prompt_ids": tok.encode(rows[3]["prompt"]), "ground_truth": rows[3]["ground_truth"],
                         "data_source": "reverse:3", "extra_info": {},
                         "columns": {"ground_truth": rows[3]["ground_truth"]}}


def test_sampler_epochs_cover_dataset():
    s = PromptSampler(10, batch_size=3, seed=5)
    assert s.batches_per_epoch == 3
    e0 = [s.next_batch() for _ in range(3)]
    e1 = [s.next_batch() for _ in range(3)]
    for ep in (e0, e1):
        flat = [i for b in ep for i in b]
        assert len(set(flat)) == 9 and all(len(b) == 3 for b in ep)
    assert e0 != e1 and s.epoch == 1
    other = PromptSampler(10, batch_size=3, seed=6)
    assert [other.next_batch() for _ in range(3)] != e0  # the seed matters
    keep = PromptSampler(7, batch_size=3, seed=0, drop_last=False, shuffle=False)
    assert [keep.next_batch() for _ in range(4)] == [[0, 1, 2], [3, 4, 5], [6], [0, 1, 2]]


def test_sampler_resume_mid_epoch_gives_identical_future():
    a = PromptSampler(23, batch_size=4, seed=11)
    for _ in range(7):  # into the second epoch (5 batches per epoch)
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON round trip (checkpoint files)
    future = [a.next_batch() for _ in range(12)]
    b = PromptSampler(23, batch_size=4, seed=11)
    b.load_state_dict(state)
    assert [b.next_batch() for _ in range(12)] == future
    with pytest.raises(ValueError, match="batch_size=4 but this run has batch_size=5"):
        PromptSampler(23, batch_size=5, seed=11).load_state_dict(state)


def test_sampler_validation():
    with pytest.raises(ValueError, match="cannot fill a batch"):
        PromptSampler(3, batch_size=4, seed=0)
    with pytest.raises(ValueError, match=">= 1"):
        PromptSampler(3, batch_size=0, seed=0)
    assert PromptSampler(3, batch_size=4, seed=0, drop_last=False).next_batch().__len__() == 3


def test_sft_warmup_trains_on_the_data_answers(tmp_path):
    """trainer.sft_warmup_steps with data.train_files: pairs from the data's rows, not the synthetic task."""
    from launcher.config.load import load_config
    from ppo.data.prompts import check_sft_answers, sft_pairs
    from tests.ppo.world import train_state

    tok = load_tokenizer("builtin:char")
    rows = [{"prompt": f"q{i}", "reward_model": {"ground_truth": str(i)}, "extra_info": {"answer": f"so {i}"}}
            for i in range(6)]
    ds = PromptDataset.from_rows(rows, tokenizer=tok)
    pairs = sft_pairs(ds, 8, seed=0, tokenizer=tok)
    texts = {tok.decode(p): tok.decode(a) for p, a in pairs}
    assert len(pairs) == 8 and len(texts) == 6  # every row once before any repeats
    assert all(a == f"{p[1:]}</s>" for p, a in texts.items())
    solution = sft_pairs(ds, 2, seed=0, tokenizer=tok, answer_key="extra_info.answer")
    assert all(tok.decode(a).startswith("so ") for _, a in solution)
    assert pairs == sft_pairs(ds, 8, seed=0, tokenizer=tok) != sft_pairs(ds, 8, seed=1, tokenizer=tok)
    check_sft_answers(ds)
    # ground truths that are not answer text (test cases, a dict) are rejected with the way out
    cases = PromptDataset.from_rows([{"prompt": "p", "ground_truth": {"tests": ["assert f(1) == 2"]}}], tokenizer=tok)
    with pytest.raises(DataError, match=r"row 0 of <rows> has no answer text at the ground truth \(dict "
                                        r".*set data.sft_answer_key .* or trainer.sft_warmup_steps=0"):
        check_sft_answers(cases)
    with pytest.raises(DataError, match=r"data.sft_answer_key='extra_info.answr' names no column"):
        check_sft_answers(ds, answer_key="extra_info.answr")

    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows * 4))
    cfg = load_config(None, [f"data.train_files={path}", "trainer.sft_warmup_steps=3", "data.batch_size=4"])
    batch = train_state(cfg, tmp_path).sft_batch(0)
    assert len(batch) == 4 and all(tok.decode(p).startswith("q") for p, _ in batch)  # not "3+5=" of add:1
    path.write_text(json.dumps({"prompt": "p", "ground_truth": ["a", "b"]}) + "\n")
    with pytest.raises(DataError, match="trainer.sft_warmup_steps trains on the answers of data.train_files"):
        train_state(load_config(None, [f"data.train_files={path}", "trainer.sft_warmup_steps=3", "data.batch_size=1"]),
                    tmp_path)


def test_total_epochs_sets_the_step_count(tmp_path):
    from launcher.config.load import load_config
    from tests.ppo.world import train_state

    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": "1"}) for i in range(50)))
    cfg = load_config(None, [f"data.train_files={path}", "data.batch_size=8", "trainer.total_epochs=3"])
    assert train_state(cfg, tmp_path).total_steps == 3 * (50 // 8)
    cfg = load_config(None, [f"data.train_files={path}", "data.batch_size=8", "trainer.total_steps=7"])
    assert train_state(cfg, tmp_path).total_steps == 7


def test_non_utf8_file_and_non_text_prompt_name_file_line_and_row(tmp_path):
    tok = load_tokenizer("builtin:char")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9 at column 16\)"):
        PromptDataset.from_files([str(latin1)], tokenizer=tok, prompt_key="prompt", answer_key="answer")
    ints = tmp_path / "ints.jsonl"
    ints.write_text('{"prompt": "ok", "answer": "1"}\n{"prompt": 7, "answer": "1"}\n')
    with pytest.raises(DataError, match=r"ints.jsonl row 1, column 'prompt': prompt must be a string .* got int \(7\)"):
        PromptDataset.from_files([str(ints)], tokenizer=tok, prompt_key="prompt", answer_key="answer")


def test_bad_files_and_empty_prompts_are_data_errors_naming_file_and_row(tmp_path):
    """Raw exceptions before (pyarrow's ArrowInvalid; an empty prompt reaching generation): now DataError (exit 2)
    naming the file, and the row and column for an empty prompt."""
    tok = load_tokenizer("builtin:char")
    (tmp_path / "csv.parquet").write_text("prompt,ground_truth\n1+1=,2\n")
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "ground_truth": "2"}] * 20), tmp_path / "good.parquet")
    whole = (tmp_path / "good.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(whole[: len(whole) // 2])
    for name in ("csv.parquet", "cut.parquet"):
        with pytest.raises(DataError, match=f"{name}' is not a readable Parquet file"):
            PromptDataset.from_file(str(tmp_path / name), tokenizer=tok)
    (tmp_path / "e.jsonl").write_text('{"prompt": "1+1=", "ground_truth": "2"}\n{"prompt": "", "ground_truth": "1"}\n')
    with pytest.raises(DataError, match=r"e.jsonl row 1, column 'prompt': the prompt is empty"):
        PromptDataset.from_file(str(tmp_path / "e.jsonl"), tokenizer=tok)


def test_null_ground_truths_are_counted_in_a_warning(tmp_path, caplog):
    tok = load_tokenizer("builtin:char")
    rows = [{"prompt": f"{i}+1=", "reward_model": {"ground_truth": None if i % 2 else str(i + 1)}} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "n.parquet")
    with caplog.at_level(logging.WARNING):
        PromptDataset.from_file(str(tmp_path / "n.parquet"), tokenizer=tok)
    assert any("3 of 6 rows have a null ground truth (rows [1, 3, 5])" in m for m in caplog.messages), caplog.messages
