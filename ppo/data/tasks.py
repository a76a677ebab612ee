"""Built-in synthetic tasks with verifiable answers, for the CPU demo and tests.

    task = get_task("add")                              # or "copy:4", "reverse:3", "add:2"
    rows = task.generate(256, seed=0)                   # [{"prompt": "17+25=", "ground_truth": "42"}, ...]
    task.reward("42", "42") == 1.0                      # exact match after stripping whitespace
    pairs = sft_examples(task, 512, seed=1, tokenizer=tok)   # (prompt ids, answer ids + eos) for a warm-up

Prompts are short ASCII strings for the built-in char tokenizer; answers must be produced exactly
(several characters), so a briefly warmed-up tiny model starts with a low reward that PPO/GRPO
then raises (see DEFAULT_TASK).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TASK_KINDS = ("add", "mul", "copy", "reverse", "random", "lookup")


@dataclass(slots=True, frozen=True)
class Task:
    """kind: add (two numbers of `digits` digits -> their sum), mul (two numbers of exactly `digits` digits ->
    their product: beyond a tiny model alone, a task for a calculator tool, conf/tools/calculator.py),
    copy / reverse (a digit string of length `digits` -> itself / reversed), random (a random letter string of
    exactly `digits` characters, answer its first character: fixed-length prompts for throughput benchmarks),
    lookup (a key of `digits` lowercase letters -> its 2-digit value in a hashed table no model has seen,
    `table_value`: only a policy that calls a lookup tool can answer; the agent demo's task,
    conf/agent_tool_tiny.yaml with conf/tools/table.py)."""

    kind: str
    digits: int

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.digits}"

    def _sample(self, rng: random.Random) -> dict[str, str]:
        if self.kind == "add":
            a, b = rng.randrange(10 ** self.digits), rng.randrange(10 ** self.digits)
            return {"prompt": f"{a}+{b}=", "ground_truth": str(a + b)}
        if self.kind == "mul":  # operands of exactly `digits` digits: every prompt has one shape
            lo = 10 ** (self.digits - 1) if self.digits > 1 else 0
            a, b = rng.randrange(lo, 10 ** self.digits), rng.randrange(lo, 10 ** self.digits)
            return {"prompt": f"{a}*{b}=", "ground_truth": str(a * b)}
        if self.kind == "lookup":
            key = "".join(rng.choice(_LETTERS) for _ in range(self.digits))
            return {"prompt": f"{key}=", "ground_truth": table_value(key)}
        if self.kind == "random":
            s = "".join(rng.choice(_LETTERS) for _ in range(self.digits - 1))
            return {"prompt": s + "=", "ground_truth": s[0]}
        s = "".join(rng.choice("0123456789") for _ in range(self.digits))
        if self.kind == "copy":
            return {"prompt": f"c{s}=", "ground_truth": s}
        return {"prompt": f"r{s}=", "ground_truth": s[::-1]}

    def generate(self, n: int, *, seed: int) -> list[dict[str, str]]:
        """n rows {"prompt", "ground_truth"}; the same (n, seed) always gives the same rows."""
        rng = random.Random(f"{self.name}/{seed}")
        return [self._sample(rng) for _ in range(n)]

    def reward(self, response: str, ground_truth: str, **extra: Any) -> float:
        """1.0 for the exact answer (surrounding whitespace and a trailing '</s>' ignored), else 0."""
        return 1.0 if _clean(response) == ground_truth.strip() else 0.0

    def partial_reward(self, response: str, ground_truth: str, **extra: Any) -> float:
        """Fraction of answer positions right (a length mismatch counts the missing/extra ones wrong)."""
        got, want = _clean(response), ground_truth.strip()
        hits = sum(a == b for a, b in zip(got, want))
        return hits / max(len(got), len(want), 1)


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def table_value(key: str) -> str:
    """The lookup task's table: a key's 2-digit value ("00".."99"), from a hash of the key (no pattern a model
    could learn from the key's letters; the lookup tool, conf/tools/table.py, reads it)."""
    return f"{int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], 'big') % 100:02d}"


def _clean(response: str) -> str:
    response = response.strip()
    return response[: -len("</s>")].strip() if response.endswith("</s>") else response


# The CPU demo (measured on 2 CPU cores, tiny preset, builtin:char). Plain-PyTorch check, 3 model
# seeds: warm-up SFT of 45 steps x 64 examples at lr 3e-3 (AdamW, loss on answer tokens) leaves the
# sampled exact-match reward at 0.03-0.05; GRPO with 32 prompts x 4 samples, lr 3e-4, 2 PPO epochs,
# grad clip 1.0 passes 0.6 after 60-80 steps and reaches ~0.9 by step 120. Through launcher/main.py
# (conf/ppo_tiny.yaml + data.task=reverse:3 trainer.sft_warmup_steps=60 algorithm.name=grpo
# rollout.n=4 actor.optim.lr=3e-4 actor.ppo_epochs=2 rollout.max_response_length=6, SFT batch 32):
# reward 0.15 at step 1, 0.62 at step 60, 0.91 at step 120 (~3 min of RL). Longer warm-ups solve
# the task by SFT alone (reward ~1 after ~100 x 64 examples), so keep it short.
DEFAULT_TASK = "reverse:3"
DEMO_RECIPE = {"task": DEFAULT_TASK, "sft_steps": 45, "sft_batch_size": 64, "sft_lr": 3e-3,
               "prompts_per_step": 32, "samples_per_prompt": 4, "rl_lr": 3e-4, "ppo_epochs": 2,
               "max_new_tokens": 6, "grad_clip": 1.0}
_DEFAULT_DIGITS = {"add": 2, "mul": 3, "copy": 3, "reverse": 3, "random": 128, "lookup": 3}
_MAX_DIGITS = {"random": 65536}


def get_task(name: str) -> Task:
    """"add", "copy", "reverse" with default sizes, or "<kind>:<digits>" (e.g. "reverse:3")."""
    kind, _, digits = name.partition(":")
    if kind not in TASK_KINDS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(TASK_KINDS)} (optionally ':<digits>')")
    try:
        d = int(digits) if digits else _DEFAULT_DIGITS[kind]
    except ValueError:
        raise ValueError(f"task {name!r}: digits must be an integer, e.g. {kind}:3") from None
    hi = _MAX_DIGITS.get(kind, 12)
    if not (2 if kind == "random" else 1) <= d <= hi:
        raise ValueError(f"task {name!r}: size must be in {2 if kind == 'random' else 1}..{hi} (got {d})")
    return Task(kind, d)


def task_reward_fn(name: str, *, partial: bool = False) -> Callable[..., float]:
    """The reward function `fn(response, ground_truth, **extra) -> float` of a built-in task."""
    task = get_task(name)
    return task.partial_reward if partial else task.reward


def sft_examples(task: Task | str, n: int, *, seed: int, tokenizer: Any,
                 keep: Callable[[dict[str, str]], bool] | None = None) -> list[tuple[list[int], list[int]]]:
    """n supervised pairs (prompt ids, answer ids + eos) for a warm-up before RL.

    keep: optional filter on rows (e.g. only a slice of the answer space) so the warm-up teaches
    the format without solving the task. Train only on the answer ids (the prompt is context).
    """
    task = get_task(task) if isinstance(task, str) else task
    if tokenizer.eos_token_id is None:
        raise ValueError("sft_examples needs a tokenizer with an eos token (the model must learn to stop)")
    out: list[tuple[list[int], list[int]]] = []
    rng_seed = seed
    for _ in range(100):
        if len(out) >= n:
            break
        for row in task.generate(max(n, 64), seed=rng_seed):
            if keep is None or keep(row):
                out.append((tokenizer.encode(row["prompt"]), tokenizer.encode(row["ground_truth"]) +
                            [tokenizer.eos_token_id]))
                if len(out) == n:
                    break
        rng_seed += 1_000_003  # a filter that rejects most rows needs more draws
    if len(out) < n:
        raise ValueError(f"sft_examples: the keep filter accepted only {len(out)} of the {n} rows asked for "
                         f"after 100 draws of task {task.name}; loosen the filter")
    return out
