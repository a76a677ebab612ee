"""A few of the step's samples, readable: every `trainer.log_samples_every` steps, rank 0 writes
`trainer.log_samples_count` prompts with their response, reward and ground truth to
`runs/<exp>/samples.jsonl` (one JSON object per sample), the console and TensorBoard text.

    {"step": 10, "uid": 12, "data_source": "gsm8k", "prompt": "...", "response": "...",
     "score": 1.0, "ground_truth": "72", "response_length": 87, "finish_reason": "stop"}
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any


def pick_samples(n_samples: int, count: int) -> list[int]:
    """`count` indices spread evenly over the batch (one per prompt group when samples come in groups)."""
    if n_samples <= 0:
        return []
    stride = max(1, n_samples // count)
    return list(range(0, n_samples, stride))[:count]


def _plain(v: Any) -> Any:
    """JSON-safe: numpy/pyarrow leftovers in ground truths become lists or strings."""
    if isinstance(v, str | int | float | bool) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    return v.tolist() if hasattr(v, "tolist") else str(v)


class SampleLog:
    """Rank 0's sample writer; `due(step)` says whether step (0-based) is one to show."""

    def __init__(self, run_dir: Path, *, every: int, count: int, tokenizer, logger: logging.Logger | None = None):
        self.path = Path(run_dir) / "samples.jsonl"
        self.every, self.count, self.tokenizer = every, count, tokenizer
        self.log = logger or logging.getLogger("hybridrl")

    def due(self, step: int) -> bool:
        return bool(self.every) and (step + 1) % self.every == 0

    def records(self, step: int, samples, scores) -> list[dict[str, Any]]:
        """samples: the step's Sample list; scores: [B] per-sample rewards in the same order."""
        out = []
        for i in pick_samples(len(samples), self.count):
            s = samples[i]
            info = s.info or {}
            out.append({"step": step + 1, "uid": s.uid, "data_source": info.get("data_source", ""),
                        "prompt": self.tokenizer.decode(s.prompt_ids, skip_special_tokens=True),
                        "response": self.tokenizer.decode(s.response_ids, skip_special_tokens=True),
                        "score": float(scores[i]), "ground_truth": _plain(s.ground_truth),
                        "response_length": len(s.response_ids), "finish_reason": s.finish_reason})
            if s.agent is not None:  # a multi-turn trajectory: the response above is the whole conversation
                out[-1].update(turns=s.agent["turns"], tool_calls=s.agent["tool_calls"],
                               tool_errors=s.agent["tool_errors"], reward_text=s.text)
        return out

    def write(self, step: int, samples, scores, *, tensorboard=None) -> list[dict[str, Any]]:
        """Append the step's picks to samples.jsonl, print them, and add them as TensorBoard text."""
        recs = self.records(step, samples, scores)
        with open(self.path, "a") as f:
            for r in recs:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        for r in recs:
            self.log.info("sample step %d uid %d [%s] score %.3g | prompt %r | response %r | ground truth %r",
                          r["step"], r["uid"], r["data_source"], r["score"], _short(r["prompt"]),
                          _short(r["response"]), _short(str(r["ground_truth"])))
        if tensorboard is not None:
            # markdown table: TensorBoard's text plugin renders it
            rows = ["| uid | source | score | prompt | response | ground truth |", "|---|---|---|---|---|---|"]
            rows += [f"| {r['uid']} | {_cell(r['data_source'])} | {r['score']:.3g} | {_cell(r['prompt'])} | "
                     f"{_cell(r['response'])} | {_cell(str(r['ground_truth']))} |" for r in recs]
            tensorboard.add_text("samples", "\n".join(rows), step + 1)
        return recs


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit // 2] + " ... " + text[-limit // 2:]


def _cell(text: str) -> str:
    return _short(text, 500).replace("|", "\\|").replace("\n", "<br>")
