"""Score heads on the Llama trunk: the PPO critic (`LlamaForValue`) and the reward model
(`LlamaForSequenceClassification`), both with Hugging Face names `model.*` + `score.weight`.

Both save as `<Family>ForSequenceClassification` (a critic is a 1-label sequence classifier to
transformers), so a critic checkpoint can be reloaded as a reward model and vice versa:

    critic = load_pretrained(actor_dir, model_cls=LlamaForValue)      # score head starts at zero
    critic = load_pretrained(rm_dir, model_cls=LlamaForValue)         # reuses the RM's score.weight
    rm = load_pretrained(rm_dir, model_cls=LlamaForSequenceClassification)
    rewards = rm.sequence_scores(input_ids, pad_token_id=tok.pad_token_id)   # [B]

The head runs in fp32 (a [H] -> [L] product, negligible cost) so bf16 trunks give fp32 values.
Pipeline stages without the head set `score` to None and return hidden states, like lm_head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig, ModelConfigError
from models.llama import AttentionBackend, LlamaModel


def last_token_index(
    input_ids: torch.Tensor, *, pad_token_id: int | None = None, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, T] ids -> [B] index of the token whose score is the sequence's score.

    lengths: right padding, index lengths - 1. pad_token_id: the rightmost non-pad token, exactly as
    transformers' *ForSequenceClassification (left or right padding; an all-pad row gives 0).
    Neither: the last position, which transformers allows only for batch size 1.
    """
    b, t = input_ids.shape
    if lengths is not None:
        if pad_token_id is not None:
            raise ValueError("pass pad_token_id or lengths, not both")
        return lengths.to(input_ids.device).long() - 1
    if pad_token_id is None:
        if b != 1:
            raise ValueError(f"batch of {b} rows needs pad_token_id or lengths to find each sequence's last token")
        return torch.full((b,), t - 1, dtype=torch.long, device=input_ids.device)
    non_pad = (input_ids != pad_token_id).long()
    return (torch.arange(t, device=input_ids.device) * non_pad).argmax(-1)


class _ScoredTrunk(nn.Module):
    """Llama trunk + bias-free `score` Linear(hidden, width), evaluated in fp32."""

    hf_architecture = "ForSequenceClassification"

    def __init__(self, cfg: ModelConfig, width: int):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.score: nn.Linear | None = nn.Linear(cfg.hidden_size, width, bias=False)

    def hidden_states(self, input_ids, position_ids=None, *, attn: AttentionBackend | None = None,
                      routing=None) -> torch.Tensor:
        """routing: a mixture-of-experts trunk's models.moe.RouterTrace (its load-balancing statistics)."""
        if routing is None:
            return self.model(input_ids, position_ids, attn=attn)
        return self.model(input_ids, position_ids, attn=attn, routing=routing)

    def _scores(self, input_ids, position_ids, attn) -> torch.Tensor:
        """[B, T] ids (or [B, T, H] hidden on later pipeline stages) -> [B, T, width] fp32."""
        h = self.model(input_ids, position_ids, attn=attn)
        if self.score is None:
            return h
        return F.linear(h.float(), self.score.weight.float())


class LlamaForValue(_ScoredTrunk):
    """PPO critic: `forward(input_ids, position_ids=None, *, attn=None) -> values [B, T]` fp32.

    From an actor checkpoint the score head is initialised to ZERO: every value starts at exactly 0,
    a neutral baseline, instead of the ~N(0, 0.02^2 * H) noise a normal init gives (1.3 for H=4096,
    larger than typical rewards); the head still gets a gradient on the first step (h * dL/dv), and
    the trunk from the second step on. From a reward-model checkpoint its `score.weight` is reused.
    """

    checkpoint_ignore = ("lm_head.weight",)  # loading from a causal-LM checkpoint drops its head
    checkpoint_init_if_missing = ("score.weight",)

    def __init__(self, cfg: ModelConfig):
        # a critic is a 1-label classifier whatever id2label an actor's config.json happens to carry
        super().__init__(dataclasses.replace(cfg, num_labels=1) if cfg.num_labels != 1 else cfg, 1)

    def init_missing(self, names: Sequence[str]) -> None:
        """Called by the loader for a checkpoint without `score.weight` (an actor checkpoint)."""
        if set(names) - {"score.weight"}:
            raise ModelConfigError(f"LlamaForValue cannot initialise {sorted(set(names) - {'score.weight'})}")
        with torch.no_grad():
            self.score.weight.zero_()

    def forward(self, input_ids, position_ids=None, *, attn: AttentionBackend | None = None) -> torch.Tensor:
        out = self._scores(input_ids, position_ids, attn)
        return out.squeeze(-1) if self.score is not None else out


class LlamaForSequenceClassification(_ScoredTrunk):
    """Reward model with transformers' layout: `score.weight` [num_labels, hidden].

    `forward(input_ids, position_ids=None, *, attn=None) -> per-token scores [B, T, num_labels]` fp32;
    `sequence_scores(...)` pools them at each sequence's last token.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, cfg.num_labels)

    def forward(self, input_ids, position_ids=None, *, attn: AttentionBackend | None = None) -> torch.Tensor:
        return self._scores(input_ids, position_ids, attn)

    def sequence_scores(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        pad_token_id: int | None = None,
        lengths: torch.Tensor | None = None,
        attn: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """[B, T] ids -> [B] fp32 scores ([B, num_labels] when num_labels > 1) at each row's last token
        (see `last_token_index`; pad_token_id defaults to config.pad_token_id when lengths is None)."""
        if lengths is None and pad_token_id is None:
            pad_token_id = self.config.pad_token_id
        idx = last_token_index(input_ids, pad_token_id=pad_token_id, lengths=lengths)
        scores = self.forward(input_ids, position_ids, attn=attn)
        pooled = scores[torch.arange(scores.shape[0], device=scores.device), idx]
        return pooled.squeeze(-1) if pooled.shape[-1] == 1 else pooled
