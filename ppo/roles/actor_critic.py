"""The two model-scoring role workers over ShardedWorker's plumbing (ppo/roles/workers.py): PolicyWorker, the actor
(trainable: PPO updates) or the reference (frozen), giving the log-probs of responses; CriticWorker, the values of
responses and the clipped value-loss updates. score_heads is the value / reward head both critics and reward
models read."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.logprobs import compute_token_logprobs
from parallel.runner import ModelRunner
from parallel.vocab_parallel import vocab_parallel_token_logprobs
from ppo.batch.experience import Experience
from ppo.batch.packing import gather_response_logprobs, unpack_responses
from ppo.batch.step_batch import DeviceRows, StepBatch
from ppo.roles.workers import PendingResults, ShardedWorker, WorkerSpec, build_optimizer, to_host
from ppo.settings import OptimizerSettings


class PolicyWorker(ShardedWorker):
    """Actor (trainable) or reference (frozen) policy: log-probs of responses, PPO updates."""

    def __init__(self, model: nn.Module | None, spec: WorkerSpec, *, temperature: float, pad_id: int,
                 trainable: bool, optim: OptimizerSettings | None = None, total_steps: int = 1,
                 runner: ModelRunner | None = None):
        super().__init__(model, spec, runner=runner)
        self.temperature = temperature if temperature > 0 else 1.0
        self.pad_id = pad_id
        self.trainable = trainable
        if trainable:
            self.grad_clip = optim.grad_clip
            self.optimizer, self.scheduler = build_optimizer(self.runner, optim, total_steps=total_steps)
        else:
            for p in self.parameters():
                p.requires_grad_(False)

    def _token_logprobs(self, hidden: torch.Tensor, labels: torch.Tensor, *, with_entropy: bool):
        """hidden [N, H], labels [N] -> (log-probs [N], entropies [N] | None), chunked and vocab-parallel."""
        w, vocab_start = self.runner.head("lm_head")
        if self.tp > 1:
            return vocab_parallel_token_logprobs(hidden, w, labels, tp_group=self.tp_group, vocab_start=vocab_start,
                                                 temperature=self.temperature, with_entropy=with_entropy)
        return compute_token_logprobs(hidden, w.to(hidden.dtype), labels, temperature=self.temperature,
                                      with_entropy=with_entropy)

    def _response_logprobs(self, packed, hidden: torch.Tensor, *, with_entropy: bool):
        """[B, R] log-probs (and entropies) of one packed micro-batch from its hidden [1, T, H]; the LM
        head runs on the response tokens' predicting positions only (never on prompt tokens)."""
        return gather_response_logprobs(hidden[0], packed, lambda h, labels: self._token_logprobs(
            h, labels, with_entropy=with_entropy))

    @torch.no_grad()
    def compute_logprobs(self, exp: Experience, plan: list[list[list[int]]], *,
                         with_entropy: bool = False) -> dict[str, dict[int, torch.Tensor]]:
        """{"logp": {uid: [R_i]}, "entropy": {uid: [R_i]}} for this rank's shard (owners only report).
        Uses the same mini-batch -> micro-batch partition as `update`, so the ratio is 1 on-policy."""
        return self.launch_logprobs(exp, plan, with_entropy=with_entropy).result()

    @torch.no_grad()
    def launch_logprobs(self, exp: Experience, plan: list[list[list[int]]], *,
                        with_entropy: bool = False) -> PendingResults:
        """compute_logprobs with the wait left to the caller: the forwards are enqueued, and result() makes
        the one device -> host copy (the host can do other work while the kernels run)."""
        computed = self._enqueue_forwards(exp, plan, self.pad_id, lambda packed, h: self._response_logprobs(
            packed, h, with_entropy=with_entropy))
        outputs = self.reported(computed)

        def finish() -> dict[str, dict[int, torch.Tensor]]:
            out: dict[str, dict[int, torch.Tensor]] = {"logp": {}, "entropy": {}}
            if not outputs:
                return out
            # one device -> host copy for the whole batch (not a sync per micro-batch), then split on the host
            logps = to_host([logp for _, (logp, _) in outputs])
            ents = to_host([ent for _, (_, ent) in outputs]) if outputs[0][1][1] is not None else [None] * len(outputs)
            for (mb, _), logp, ent in zip(outputs, logps, ents):
                for j, i in enumerate(mb):
                    s = exp.samples[i]
                    n = len(s.response_ids)
                    out["logp"][s.uid] = logp[j, :n]
                    if ent is not None:
                        out["entropy"][s.uid] = ent[j, :n]
            return out

        rows = DeviceRows(exp, [(mb, logp) for mb, (logp, _) in computed]) if computed else None
        return PendingResults(finish, logp_rows=rows)

    def update(self, exp: Experience, plan: list[list[list[int]]], batch: StepBatch, *,
               epochs: int, loss_fn, with_entropy: bool, step_scheduler: bool = True,
               agg: str = "token-mean") -> dict[str, float]:
        """PPO epochs over this rank's mini-batches.

        batch: what the loss reads of the step's batch, response-aligned [B, R] rows on the host (old_logp,
        advantages, mask, + ref_logp for a KL loss) or left on the device (DeviceRows: the reference's log-probs
        computed on these ranks). loss_fn(logp, entropy, mb_batch, denom) -> (loss, metrics), mb_batch the
        micro-batch's rows [B_k, R_k] on the device, entropy [B, R] when with_entropy else None; denom is the
        global count `agg` normalises by. Returns the metrics
        averaged over micro-batches (keys ending in _max / _min: their max / min), grad_norm and lr
        (meaningful on owner ranks)."""
        def mb_loss(packed, hidden, t, denom):
            logp, ent = self._response_logprobs(packed, hidden, with_entropy=with_entropy)
            return loss_fn(logp, ent, t.narrow(logp.shape[1], self.device), denom)

        out = self._train(exp, plan, batch, epochs=epochs, pad_id=self.pad_id, mb_loss=mb_loss, agg=agg)
        if step_scheduler:
            self.scheduler.step()
        out["lr"] = self.optimizer.param_groups[0]["lr"]
        return out


def score_heads(runner: ModelRunner, hidden: torch.Tensor) -> torch.Tensor:
    """Last stage's hidden [..., H] -> fp32 scores [..., L] of the value / reward head (`score`)."""
    w, _ = runner.head("score")
    return F.linear(hidden.float(), w.float())


class CriticWorker(ShardedWorker):
    """Value model: per-token values of responses and clipped value-loss updates."""

    def __init__(self, model: nn.Module, spec: WorkerSpec, *, pad_id: int, optim: OptimizerSettings,
                 total_steps: int):
        super().__init__(model, spec)
        self.moe = False  # the engine recorded the policy's routing, not this trunk's: the critic routes itself
        self.pad_id = pad_id
        self.optimizer, self.scheduler = build_optimizer(self.runner, optim, total_steps=total_steps)
        self.grad_clip = optim.grad_clip

    def _response_values(self, packed, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [1, T, H] -> values [B, R] fp32 at the response tokens' predicting positions."""
        return unpack_responses(score_heads(self.runner, hidden).squeeze(-1), packed)

    @torch.no_grad()
    def compute_values(self, exp: Experience, plan: list[list[list[int]]]) -> dict[str, dict[int, torch.Tensor]]:
        return self.launch_values(exp, plan).result()

    @torch.no_grad()
    def launch_values(self, exp: Experience, plan: list[list[list[int]]]) -> PendingResults:
        """{"values": {uid: [R_i]}} once result() is called (see PolicyWorker.launch_logprobs)."""
        outputs = self.reported(self._enqueue_forwards(exp, plan, self.pad_id, self._response_values))

        def finish() -> dict[str, dict[int, torch.Tensor]]:
            out: dict[int, torch.Tensor] = {}
            for (mb, _), values in zip(outputs, to_host([v for _, v in outputs]) if outputs else []):
                for j, i in enumerate(mb):
                    s = exp.samples[i]
                    out[s.uid] = values[j, : len(s.response_ids)]
            return {"values": out}

        return PendingResults(finish)

    def update(self, exp: Experience, plan: list[list[list[int]]], batch: StepBatch, *,
               epochs: int, loss_fn, agg: str = "token-mean") -> dict[str, float]:
        """batch: the values, returns and mask rows [B, R] on the host. loss_fn(values [B, R], mb_batch, denom) ->
        (loss, metrics), mb_batch the micro-batch's rows on the device; denom as `agg` needs it."""
        def mb_loss(packed, hidden, t, denom):
            values = self._response_values(packed, hidden)
            return loss_fn(values, t.narrow(values.shape[1], self.device), denom)

        out = self._train(exp, plan, batch, epochs=epochs, pad_id=self.pad_id, mb_loss=mb_loss, agg=agg)
        self.scheduler.step()
        return out
