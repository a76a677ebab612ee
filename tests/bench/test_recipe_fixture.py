"""bench.recipe_fixture: a tiny preset's model, tokenizer and verl GSM8K Parquet files, loaded back."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from bench.recipe_fixture import QWEN_SPECIALS, main, trained_bpe, vocab_layout
from models import load_pretrained, read_config
from ppo.data.tokenizer import load_tokenizer


def _layout(vocab_size: int) -> dict[str, int]:
    return vocab_layout(vocab_size, trained_bpe(0)[0])


def test_vocab_layout_puts_qwen_specials_at_qwen_ids():
    vocab = _layout(151936)
    assert len(vocab) == 151936 and sorted(vocab.values()) == list(range(151936))
    assert vocab["<|endoftext|>"] == 151643 and vocab["<|im_start|>"] == 151644 and vocab["<|im_end|>"] == 151645
    assert vocab["<tool_call>"] == 151657 and vocab["<think>"] == 151667 and vocab["</think>"] == 151668
    with pytest.raises(ValueError, match="too small"):
        _layout(64)


def test_fixture_loads_with_the_project_loaders(tmp_path, capsys):
    out = tmp_path / "fx"
    res = main(["--preset", "tiny-qwen3", "--out", str(out), "--prompts", "12", "--val-prompts", "5", "--seed", "3"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line == res and line["vocab"] == 512 and line["mean_prompt_tokens"] > 0

    model_dir = out / "model"
    model = load_pretrained(model_dir)
    cfg = read_config(model_dir)
    tok = load_tokenizer(str(model_dir))
    layout = vocab_layout(512, trained_bpe(3)[0])
    assert model.config.vocab_size == cfg.vocab_size == tok.vocab_size == 512
    assert res["params"] == sum(p.numel() for p in model.parameters())
    assert tok.eos_token_id == layout["<|im_end|>"] == cfg.eos_token_id
    assert tok.pad_token_id == layout["<|endoftext|>"] and tok.bos_token_id is None

    text = "Tom has 12 apples.\n\tHow many? #### 42 ~`{}|"
    ids = tok.encode(text)
    assert len(ids) < len(text) and tok.decode(ids) == text  # BPE merges, and any text round-trips
    assert tok.decode(tok.encode("naïve ünïcode — ok")) == "naïve ünïcode — ok"
    chat = tok.apply_chat_template([{"role": "user", "content": "2+3="}])
    assert chat == "<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(chat)
    assert ids[0] == layout["<|im_start|>"] and tok.decode(ids) == chat
    assert {t: tok.encode(t) for t in QWEN_SPECIALS} == {t: [layout[t]] for t in QWEN_SPECIALS}
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False).endswith(
        "<|im_end|>\n")

    for name, n in (("train", 12), ("test", 5)):
        table = pq.read_table(out / "data" / f"{name}.parquet")
        assert table.num_rows == n
        assert set(table.column_names) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        for row in table.to_pylist():
            assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
            assert row["prompt"][0]["role"] == "user" and "####" in row["prompt"][0]["content"]
            assert row["reward_model"]["style"] == "rule"
            gt = row["reward_model"]["ground_truth"]
            assert int(gt) >= 0 and row["extra_info"]["answer"].endswith(f"#### {gt}")
            assert row["extra_info"]["split"] == name


def test_fixture_reads_with_the_prompt_dataset(tmp_path):
    from ppo.data.prompts import PromptDataset

    out = tmp_path / "fx"
    main(["--preset", "tiny-qwen3", "--out", str(out), "--prompts", "4", "--val-prompts", "2", "--dtype", "float32"])
    tok = load_tokenizer(str(out / "model"))
    ds = PromptDataset.from_file(str(out / "data" / "train.parquet"), tokenizer=tok, max_prompt_length=1024)
    assert len(ds) == 4
    rec = ds.batch([0])[0]
    assert rec.data_source == "openai/gsm8k" and rec.prompt_text.startswith("<|im_start|>user\n")
    assert rec.prompt_text.endswith("<|im_start|>assistant\n") and str(int(rec.ground_truth)) == rec.ground_truth


def test_prompts_are_as_long_as_real_qwen3_gsm8k_prompts():
    """~75 tokens, as Qwen3's tokenizer gives GSM8K prompts: the recipe benchmark's KV reads and trained tokens
    depend on it."""
    from bench.recipe_fixture import build_tokenizer, gsm8k_rows

    tok = build_tokenizer(151936)
    rows = gsm8k_rows(200, "train", 0)
    chat = [f"<|im_start|>user\n{r['prompt'][0]['content']}<|im_end|>\n<|im_start|>assistant\n" for r in rows]
    mean = sum(len(tok.encode(t).ids) for t in chat) / len(chat)
    assert 70 <= mean <= 85, mean
    assert tok.encode("<|im_start|>").ids == [151644] and tok.encode("<|im_end|>").ids == [151645]
    assert build_tokenizer(151936).to_str() == tok.to_str()  # deterministic
