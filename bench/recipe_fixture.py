"""A recipe fixture with no download: a random-initialised model of a real shape, a tokenizer of the same
vocabulary and synthetic GSM8K-style Parquet files in verl's format (issue 39).

    python -m bench.recipe_fixture --preset qwen3-0.6b --out DIR [--prompts 512] [--val-prompts 64] \
        [--seed 0] [--dtype bfloat16]

writes
    DIR/model/            config.json + *.safetensors (the preset's shape, the project's init, in --dtype),
                          tokenizer.json + tokenizer_config.json (exactly the model's vocab_size ids)
    DIR/data/train.parquet  --prompts rows      (verl's GSM8K columns: data_source "openai/gsm8k",
    DIR/data/test.parquet   --val-prompts rows   prompt as chat messages, ability, reward_model, extra_info)
and prints one JSON line (paths, vocab, parameters, mean prompt tokens, seconds). Then run the recipe on it:

    torchrun --nproc_per_node 1 launcher/main.py conf/grpo_gsm8k_qwen3.yaml model.path=DIR/model \
        data.train_files=DIR/data/train.parquet data.val_files=DIR/data/test.parquet trainer.total_steps=4

The tokenizer is a byte-level BPE trained at build time on the fixture's own problems (deterministic per
--seed), with a merge budget that puts the chat-formatted prompts at ~77 tokens, as real Qwen3 tokenizes
GSM8K; any text round-trips. Qwen's special tokens (<|endoftext|>, <|im_start|>, <|im_end|>, <tool_call>,
<think>, ...) sit at Qwen's ids when the vocabulary is Qwen's (151,936: <|endoftext|> 151643, <|im_end|>
151645), otherwise right after the BPE's tokens; the rest of the vocabulary is filler tokens that no text
encodes to. The model config's bos/eos/pad ids are set to the tokenizer's (for the qwen3 presets these are
the preset's own).
The answers are integers, graded by verl's gsm8k.compute_score or `reward.function=builtin:math`; a
random model earns no reward -- the fixture measures throughput and memory, not learning.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from models import PRESETS, build_model, preset_config, save_pretrained
from models.llama import init_weights

QWEN_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)
QWEN_VOCAB, QWEN_ENDOFTEXT = 151936, 151643
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# verl's examples/data_preprocess/gsm8k.py appends this to each question
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


# ---------------------------------------------------------------- tokenizer
# the byte-level BPE's own vocabulary (256 bytes + merges): GSM8K-style prompts come out at ~77 tokens, as real
# Qwen3 tokenizes GSM8K (the synthetic questions are shorter than real ones, so fewer merges make up for it)
BPE_VOCAB = 420
CORPUS_ROWS = 2000


def _corpus(seed: int) -> list[str]:
    """The fixture's own prompts (chat-formatted) and worked solutions: what the BPE is trained on."""
    texts = []
    for r in gsm8k_rows(CORPUS_ROWS, "corpus", seed):
        texts.append(f"<|im_start|>user\n{r['prompt'][0]['content']}<|im_end|>\n<|im_start|>assistant\n")
        texts.append(r["extra_info"]["answer"])
    return texts


def trained_bpe(seed: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a byte-level BPE of BPE_VOCAB tokens trained on the fixture's corpus (deterministic)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(_corpus(seed), trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return model["vocab"], merges


def vocab_layout(vocab_size: int, bpe: dict[str, int]) -> dict[str, int]:
    """token -> id for the whole vocabulary: the BPE's tokens from 0, Qwen's specials, filler tokens."""
    if vocab_size < len(bpe) + len(QWEN_SPECIALS):
        raise ValueError(f"vocab_size {vocab_size} is too small for the fixture's tokenizer "
                         f"({len(bpe) + len(QWEN_SPECIALS)} ids needed)")
    # Qwen's ids when the vocabulary is Qwen's size; else right after the BPE's tokens
    base = max(vocab_size - (QWEN_VOCAB - QWEN_ENDOFTEXT), len(bpe))
    vocab = dict(bpe)
    for i, tok in enumerate(QWEN_SPECIALS):
        vocab[tok] = base + i
    used = set(vocab.values())
    free = (i for i in range(vocab_size) if i not in used)
    for k, i in enumerate(free):
        vocab[f"<|filler_{k}|>"] = i
    assert len(vocab) == vocab_size and max(vocab.values()) == vocab_size - 1
    return vocab


def build_tokenizer(vocab_size: int, *, seed: int = 0):
    """A `tokenizers.Tokenizer`: byte-level BPE (any text round-trips), specials recognised in text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    bpe, merges = trained_bpe(seed)
    tok = Tokenizer(models.BPE(vocab=vocab_layout(vocab_size, bpe), merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise AssertionError(f"tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids, not {vocab_size}")
    return tok


def write_tokenizer(path: Path, vocab_size: int, *, seed: int = 0) -> dict[str, int]:
    """tokenizer.json + tokenizer_config.json in `path`; returns the special tokens' ids."""
    tok = build_tokenizer(vocab_size, seed=seed)
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}


# ---------------------------------------------------------------- model
def write_model(preset: str, path: Path, *, dtype: torch.dtype, seed: int, special_ids: dict[str, int],
                extra_files: list[Path] = ()) -> int:
    """Random-initialised `preset` saved in `dtype`, built on the meta device and materialised in
    `dtype` (host memory: the model in `dtype` plus one float32 tensor). Returns the parameter count."""
    cfg = preset_config(preset, bos_token_id=special_ids["<|endoftext|>"], eos_token_id=special_ids["<|im_end|>"],
                        pad_token_id=special_ids["<|endoftext|>"])
    model = build_model(cfg, dtype=dtype, device="meta", init=False)
    model.to_empty(device="cpu")
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # to_empty made two parameters of the shared one
    init_weights(model, seed=seed)
    n_params = sum(p.numel() for p in model.parameters())  # parameters() lists a tied weight once
    save_pretrained(model, path, dtype=dtype, extra_files=extra_files)
    return n_params


# ---------------------------------------------------------------- data
NAMES = ("Natalia", "Tom", "Aisha", "Carlos", "Mei", "Ravi", "Olga", "James", "Fatima", "Lena")
ITEMS = ("apples", "marbles", "stickers", "books", "cookies", "pencils", "shells", "cards")


def _problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, worked solution ending '#### n', n): a grade-school word problem with random numbers."""
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b, c = rng.randint(10, 90), rng.randint(5, 60), rng.randint(1, 9)
        ans = a + b - c
        q = (f"{name} has {a} {item}. {name} buys {b} more {item} at the store and then gives {c} {item} to "
             f"{other}. How many {item} does {name} have now?")
        sol = f"{name} has {a} + {b} = {a + b} {item} after the store.\n{a + b} - {c} = {ans}\n#### {ans}"
    elif kind == 1:
        a, b = rng.randint(2, 12), rng.randint(3, 25)
        ans = a * b
        q = (f"{name} packs {item} into {a} boxes. Each box holds {b} {item}. How many {item} does {name} "
             f"pack in all?")
        sol = f"{a} boxes x {b} {item} = {ans} {item}.\n#### {ans}"
    elif kind == 2:
        per, n, extra = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 20)
        ans = per * n + extra
        q = (f"{name} earns {per} dollars for every hour of work. {name} works {n} hours this week and also "
             f"gets a tip of {extra} dollars from {other}. How many dollars does {name} earn this week?")
        sol = f"{per} x {n} = {per * n} dollars for the hours.\n{per * n} + {extra} = {ans}\n#### {ans}"
    else:
        groups, size, left = rng.randint(2, 9), rng.randint(2, 15), rng.randint(0, 5)
        total = groups * size + left
        ans = size
        q = (f"{name} shares {total - left} {item} equally among {groups} friends and keeps the other {left} "
             f"{item}. {name} started with {total} {item}. How many {item} does each friend get?")
        sol = f"{total} - {left} = {total - left} {item} are shared.\n{total - left} / {groups} = {ans}\n#### {ans}"
    return q, sol, ans


def gsm8k_rows(n: int, split: str, seed: int) -> list[dict[str, Any]]:
    """`n` rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    rng = random.Random(f"{seed}:{split}")
    rows = []
    for i in range(n):
        question, solution, answer = _problem(rng)
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": i, "answer": solution, "question": question},
        })
    return rows


def write_data(path: Path, *, n_train: int, n_val: int, seed: int) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = {}
    for split, n in (("train", n_train), ("test", n_val)):
        out[split] = path / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(gsm8k_rows(n, split, seed)), out[split])
    return out


# ---------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.recipe_fixture", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-0.6b", choices=sorted(PRESETS))
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--prompts", type=int, default=512, help="train.parquet rows")
    p.add_argument("--val-prompts", type=int, default=64, help="test.parquet rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    model_dir, data_dir = args.out / "model", args.out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = PRESETS[args.preset]["vocab_size"]
    # save_pretrained writes the model directory whole (replacing one that was there), tokenizer files included
    with tempfile.TemporaryDirectory(dir=args.out) as staging:
        special_ids = write_tokenizer(Path(staging), vocab_size, seed=args.seed)
        n_params = write_model(args.preset, model_dir, dtype=DTYPES[args.dtype], seed=args.seed,
                               special_ids=special_ids,
                               extra_files=[Path(staging) / "tokenizer.json", Path(staging) / "tokenizer_config.json"])
    files = write_data(data_dir, n_train=args.prompts, n_val=args.val_prompts, seed=args.seed)

    from ppo.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    if tok.vocab_size != vocab_size:
        raise AssertionError(f"tokenizer vocab {tok.vocab_size} != model vocab {vocab_size}")
    rows = gsm8k_rows(args.prompts, "train", args.seed)
    lengths = [len(tok.encode(tok.apply_chat_template(r["prompt"], add_generation_prompt=True))) for r in rows]
    result = {
        "preset": args.preset,
        "model": str(model_dir),
        "train": str(files["train"]),
        "val": str(files["test"]),
        "vocab": vocab_size,
        "params": n_params,
        "dtype": args.dtype,
        "train_rows": args.prompts,
        "val_rows": args.val_prompts,
        "mean_prompt_tokens": round(sum(lengths) / max(len(lengths), 1), 1),
        "max_prompt_tokens": max(lengths, default=0),
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
