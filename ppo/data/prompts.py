"""Prompt datasets (JSONL / Parquet, verl-style columns, or a built-in task) and a resumable sampler.

    tok = load_tokenizer("builtin:char")
    ds = PromptDataset.from_file("data/gsm8k/train.parquet", tokenizer=tok, max_prompt_length=512)
    ds = PromptDataset.from_task("reverse:3", 4096, seed=0, tokenizer=tok)
    sampler = PromptSampler(len(ds), batch_size=32, seed=0)
    records = ds.batch(sampler.next_batch())          # list[PromptRecord]
    ckpt["sampler"] = sampler.state_dict()            # resumes mid-epoch with the same future batches

Row format (verl's): `prompt` is a string or chat messages [{"role", "content"}, ...] (rendered
with the tokenizer's chat template when it has one); the ground truth is found at
`reward_model.ground_truth`, else `ground_truth`, else `answer`, or at the dotted key you name
(`data.answer_key`; a key that names no column is an error listing the columns). `data_source`,
`extra_info` and the row's other columns are carried to the reward function.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

_log = logging.getLogger(__name__)

GROUND_TRUTH_KEYS = ("reward_model.ground_truth", "ground_truth", "answer")
_MISSING = object()


class DataError(ValueError):
    """A dataset file or row that cannot be used; the message names the file, row and fix."""


@dataclass(slots=True)
class PromptRecord:
    index: int  # row number in the source file(s), before filtering
    prompt_ids: list[int]
    prompt_text: str
    ground_truth: Any
    data_source: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other top-level columns (for rewards)


def _get(row: dict[str, Any], dotted: str) -> Any:
    """row["a"]["b"] for "a.b"; a flat column literally named "a.b" also counts. KeyError if absent."""
    if dotted in row:
        return row[dotted]
    cur: Any = row
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(dotted)
        cur = cur[part]
    return cur


def column_names(row: dict[str, Any], prefix: str = "") -> list[str]:
    """Every dotted key of a row, nested ones included: ['data_source', 'reward_model',
    'reward_model.ground_truth', ...] (what a `data.*_key` may name)."""
    out = []
    for k, v in row.items():
        out.append(prefix + str(k))
        if isinstance(v, dict):
            out += column_names(v, prefix + str(k) + ".")
    return out


def _read_rows(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        raise DataError(f"dataset file {path!r} does not exist")
    if path.endswith(".parquet") or os.path.isdir(path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:  # a CSV or JSONL named .parquet, a truncated copy
            raise DataError(f"dataset file {path!r} is not a readable Parquet file ({str(e).splitlines()[0]}); a "
                            f"truncated download, or another format with a .parquet name (use .jsonl for JSON "
                            f"lines)") from None
    if path.endswith((".jsonl", ".json")):
        rows = []
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}:{n}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                    f"JSONL files must be UTF-8: re-encode it, e.g. iconv -f latin1 -t utf-8") from None
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{n}: not valid JSON ({e.msg}); expected one object per line") from e
        return rows
    raise DataError(f"dataset file {path!r}: unsupported format (use .jsonl or .parquet)")


def render_prompt(prompt: Any, tokenizer: Any) -> str:
    """A text prompt as is; chat messages through the tokenizer's chat template (with the
    generation prompt), or their contents joined by newlines when it has none."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and all(isinstance(m, dict) and "content" in m for m in prompt):
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
        return "\n".join(str(m["content"]) for m in prompt)
    raise DataError(f"prompt must be a string or a list of {{'role', 'content'}} messages, got {type(prompt).__name__}")


class PromptDataset:
    """Tokenized prompts with their ground truths; prompts longer than max_prompt_length are dropped
    (counted in `num_dropped` and logged)."""

    def __init__(self, records: list[PromptRecord], *, num_dropped: int = 0, source: str = ""):
        self.records = records
        self.num_dropped = num_dropped
        self.source = source

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]

    def batch(self, indices: Sequence[int]) -> list[PromptRecord]:
        return [self.records[i] for i in indices]

    def row(self, i: int) -> dict[str, Any]:
        """Record i as a plain dict (prompt_ids, ground_truth, data_source, extra_info, columns), e.g. to
        broadcast."""
        r = self.records[i]
        return {"prompt_ids": r.prompt_ids, "ground_truth": r.ground_truth, "data_source": r.data_source,
                "extra_info": r.extra_info, "columns": r.columns}

    @property
    def longest_prompt(self) -> int:
        """Tokens of the longest prompt (0 when empty): what the engine's sequences must hold beyond the response."""
        return max((len(r.prompt_ids) for r in self.records), default=0)

    @property
    def columns(self) -> list[str]:
        """Top-level column names of the rows (what a reward function's parameters may name)."""
        return sorted({k for r in self.records for k in r.columns} | {"data_source", "extra_info"})

    @classmethod
    def from_rows(cls, rows: Sequence[dict[str, Any]], *, tokenizer: Any, max_prompt_length: int | None = None,
                  prompt_key: str = "prompt", answer_key: str | None = None,
                  data_source_key: str = "data_source", extra_info_key: str = "extra_info",
                  source: str = "<rows>", logger: logging.Logger | None = None) -> PromptDataset:
        """Rows (dicts) -> dataset. The ground truth is at answer_key (a dotted path) when given,
        else at the first of GROUND_TRUTH_KEYS that the row has."""
        logger = logger or _log
        gt_keys = (answer_key,) if answer_key else GROUND_TRUTH_KEYS
        parsed = []  # (row number, prompt, rendered text, ground truth, row)
        for n, row in enumerate(rows):
            try:
                prompt = _get(row, prompt_key)
            except KeyError:
                raise DataError(f"{source} row {n}: data.prompt_key={prompt_key!r} names no column; columns: "
                                f"{column_names(row)}") from None
            gt = _MISSING
            for k in gt_keys:
                try:
                    gt = _get(row, k)
                    break
                except KeyError:
                    continue
            if gt is _MISSING and answer_key:
                raise DataError(f"{source} row {n}: data.answer_key={answer_key!r} names no column; columns: "
                                f"{column_names(row)}")
            if gt is _MISSING:
                raise DataError(f"{source} row {n}: no ground truth at {' / '.join(gt_keys)} "
                                f"(columns: {column_names(row)}); set data.answer_key to the column that holds it")
            try:
                text = render_prompt(prompt, tokenizer)
            except DataError as e:
                raise DataError(f"{source} row {n}, column {prompt_key!r}: {e} ({prompt!r:.80})") from None
            if not text.strip():
                raise DataError(f"{source} row {n}, column {prompt_key!r}: the prompt is empty ({prompt!r:.80}); "
                                f"remove the row or fill in its prompt")
            parsed.append((n, prompt, text, gt, row))
        texts = [p[2] for p in parsed]
        # HF tokenizers encode a whole list in parallel (Rust threads): 100k prompts in seconds
        batch_encode = getattr(tokenizer, "encode_batch", None)
        all_ids = batch_encode(texts) if batch_encode is not None else [tokenizer.encode(t) for t in texts]
        records, dropped, longest = [], 0, 0
        for (n, prompt, text, gt, row), ids in zip(parsed, all_ids):
            if isinstance(prompt, str) and getattr(tokenizer, "add_bos", False) and ids[:1] != [tokenizer.bos_token_id]:
                ids = [tokenizer.bos_token_id] + ids  # as transformers' tokenizer(text) does for Llama
            # truncating a prompt would cut the question (or its template's generation prompt): drop it
            if max_prompt_length is not None and len(ids) > max_prompt_length:
                dropped += 1
                longest = max(longest, len(ids))
                continue
            ds = row.get(data_source_key)
            extra = row.get(extra_info_key)
            columns = {k: v for k, v in row.items() if k not in (prompt_key, data_source_key, extra_info_key)}
            records.append(PromptRecord(index=n, prompt_ids=ids, prompt_text=text, ground_truth=gt,
                                        data_source="" if ds is None else str(ds),
                                        extra_info=extra if isinstance(extra, dict) else {}, columns=columns))
        if dropped:
            logger.warning("%s: dropped %d of %d prompts longer than max_prompt_length=%d tokens (longest %d)",
                           source, dropped, len(rows), max_prompt_length, longest)
        if nulls := [r.index for r in records if r.ground_truth is None]:
            logger.warning("%s: %d of %d rows have a null ground truth (rows %s%s): a rule reward scores their "
                           "responses against None", source, len(nulls), len(records), nulls[:5],
                           " ..." if len(nulls) > 5 else "")
        if not records:
            raise DataError(f"{source}: no usable prompts ({len(rows)} rows, {dropped} longer than "
                            f"max_prompt_length={max_prompt_length}); raise data.max_prompt_length")
        return cls(records, num_dropped=dropped, source=source)

    @classmethod
    def from_file(cls, path: str | Sequence[str], *, tokenizer: Any, max_prompt_length: int | None = None,
                  **kw: Any) -> PromptDataset:
        """One or more .jsonl / .parquet files (rows concatenated in the order given)."""
        paths = [path] if isinstance(path, str) else list(path)
        rows = [r for p in paths for r in _read_rows(p)]
        return cls.from_rows(rows, tokenizer=tokenizer, max_prompt_length=max_prompt_length,
                             source=",".join(paths), **kw)

    from_files = from_file  # the name the config's `data.train_files` reads naturally with

    @classmethod
    def from_task(cls, task: str, n: int, seed: int = 0, *, tokenizer: Any,
                  max_prompt_length: int | None = None) -> PromptDataset:
        """n rows of a built-in synthetic task (ppo/data/tasks.py), data_source = the task name."""
        from ppo.data.tasks import get_task

        t = get_task(task)
        rows = [{**r, "data_source": t.name} for r in t.generate(n, seed=seed)]
        return cls.from_rows(rows, tokenizer=tokenizer, max_prompt_length=max_prompt_length,
                             source=f"task:{t.name}")



# ---------------------------------------------------------------- supervised warm-up on the data


def _answer_text(record: PromptRecord, answer_key: str | None) -> tuple[Any, str]:
    """(the SFT target of a record, where it came from): the ground truth, or the dotted column key."""
    if not answer_key:
        return record.ground_truth, "the ground truth"
    row = {**record.columns, "data_source": record.data_source, "extra_info": record.extra_info}
    try:
        return _get(row, answer_key), f"data.sft_answer_key={answer_key!r}"
    except KeyError:
        raise DataError(f"row {record.index}: data.sft_answer_key={answer_key!r} names no column; columns: "
                        f"{column_names(row)}") from None


def check_sft_answers(dataset: PromptDataset, *, answer_key: str | None = None) -> None:
    """The SFT warm-up needs answer text in every row: a string or a number, not empty. Raises a
    DataError naming the first row without one and the way out."""
    for r in dataset.records:
        value, where = _answer_text(r, answer_key)
        if isinstance(value, bool) or not isinstance(value, str | int | float) or str(value).strip() == "":
            shown = repr(value) if len(repr(value)) < 80 else repr(value)[:77] + "..."
            raise DataError(f"trainer.sft_warmup_steps trains on the answers of data.train_files, but row {r.index} "
                            f"of {dataset.source} has no answer text at {where} ({type(value).__name__} {shown}); "
                            f"set data.sft_answer_key to a column holding answer text, or trainer.sft_warmup_steps=0")


def sft_pairs(dataset: PromptDataset, n: int, *, seed: int, tokenizer: Any,
              answer_key: str | None = None) -> list[tuple[list[int], list[int]]]:
    """n supervised pairs (prompt ids, answer ids + eos) drawn from the dataset with a seeded generator
    (rows repeat only when n exceeds the dataset). The loss goes on the answer ids only."""
    if tokenizer.eos_token_id is None:
        raise DataError("the SFT warm-up needs a tokenizer with an eos token (the model must learn to stop)")
    g = torch.Generator().manual_seed(seed % 2**63)
    order = torch.randperm(len(dataset), generator=g).tolist()
    picks = [dataset.records[order[i % len(order)]] for i in range(n)]
    return [(list(r.prompt_ids), tokenizer.encode(str(_answer_text(r, answer_key)[0])) + [tokenizer.eos_token_id])
            for r in picks]


class PromptSampler:
    """Seeded, epoch-aware batches of dataset indices that resume exactly.

    Epoch e visits a permutation drawn from (seed, e) alone, so the order never depends on how
    many batches were taken before a restart; state_dict() records (epoch, batch_in_epoch).
    drop_last=False yields a final short batch per epoch.
    """

    def __init__(self, dataset_len: int, *, batch_size: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (got {batch_size})")
        if dataset_len < 1 or (drop_last and batch_size > dataset_len):
            raise ValueError(f"dataset of {dataset_len} prompts cannot fill a batch of {batch_size}; "
                             "lower data.train_batch_size or add data")
        self.dataset_len, self.batch_size, self.seed = dataset_len, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch = 0
        self.batch_in_epoch = 0
        self._order: list[int] | None = None

    @property
    def batches_per_epoch(self) -> int:
        n, b = self.dataset_len, self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_len))
        # a private generator: the global RNG state (model init, sampling) never shifts the data order
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (2**63))
        return torch.randperm(self.dataset_len, generator=g).tolist()

    def next_batch(self) -> list[int]:
        if self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch, self.batch_in_epoch, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = self._epoch_order(self.epoch)
        s = self.batch_in_epoch * self.batch_size
        self.batch_in_epoch += 1
        return self._order[s:s + self.batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "seed": self.seed,
                "dataset_len": self.dataset_len, "batch_size": self.batch_size, "shuffle": self.shuffle,
                "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in ("dataset_len", "batch_size", "seed", "shuffle", "drop_last"):
            if state[k] != getattr(self, k):
                raise ValueError(f"cannot resume the prompt sampler: checkpoint has {k}={state[k]} but this run has "
                                 f"{k}={getattr(self, k)}; use the same data and batch size as the checkpointed run")
        # the permutation is recomputed from (seed, epoch), so the state is two integers
        self.epoch, self.batch_in_epoch, self._order = int(state["epoch"]), int(state["batch_in_epoch"]), None
