"""The engine's prefills (rollout/model_runner.py's EngineModelRunner, through PrefillMixin): fresh prompt rows from
position 0, each row's K/V written into the slots of the samples that share it, and continuations (agent turns, partial
rollouts resumed onto kept KV) running only the tokens after the KV their slot holds, replayed as CUDA graphs of their
bucket where they can be (rollout/continuation_graphs.py). Both sample every sequence's next token on the device.

The mixin holds the prefill half of the runner's compute; the runner provides the state it reads: `model`, `cache`,
`config`, `device`, `kv_dtype`, `moe_layers`, `continuations`, `may_capture`, the compiled forwards `_prefill` and
`_continue` (of `_prefill_fn` and `_continue_fn` here), and `_logits`, `_routes`, `_upload`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from models.moe import RouterTrace
from rollout import triton_sampling
from rollout.kv_cache import FP8, ContinuationAttention, PrefillAttention, prefill_sdpa
from rollout.sampler import any_filtered, sample, uniform_from_counter
from rollout.scheduler import PrefillBatch, Sequence


class _PrefillClock:
    """Times parts of one prefill step: CUDA events around each part (read once the step's results are on the
    host: no extra sync), host time on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: dict[str, tuple] = {}

    @contextmanager
    def part(self, kind: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.marks[kind] = (start, end)
        else:
            t0 = time.perf_counter()
            yield
            self.marks[kind] = (time.perf_counter() - t0,)

    def read(self) -> dict[str, float]:
        return {k: m[0].elapsed_time(m[1]) / 1e3 if self.cuda else m[0] for k, m in self.marks.items()}


class PrefillMixin:
    """EngineModelRunner's prefills (module docstring)."""

    @torch.inference_mode()
    def prefill(self, batch: PrefillBatch) -> tuple[list[int], list[float], list[torch.Tensor] | None]:
        """Run the prompts (plus any tokens already generated) of each row; sample the next token of
        every sequence. A continuation row (its sequence's `cached` > 0: the slot already holds the KV of its
        first `cached` tokens) runs only the tokens after them. Returns tokens, logprobs in batch.seqs order,
        and (a mixture of experts) per row the host [new tokens, L_moe, k] experts of the tokens it ran, else
        None."""
        fresh = [r for r, row in enumerate(batch.rows) if not row[0].cached]
        cont = [r for r, row in enumerate(batch.rows) if row[0].cached]
        if self.config.fresh_rows_in_waves and self.kv_dtype != FP8 and not self.moe_layers:
            cont = [r for r in fresh if len(batch.rows[r]) == 1] + cont  # from position 0: cached = 0
            fresh = [r for r in fresh if len(batch.rows[r]) > 1]
        parts, routes = [], [None] * len(batch.rows)
        clock = _PrefillClock(self.device)
        # prefill_{fresh,continue}_{tokens,padded}: the tokens run, and the positions computed with the rows' padding
        work = dict.fromkeys(("prefill_fresh_tokens", "prefill_fresh_padded", "prefill_continue_tokens",
                              "prefill_continue_padded"), 0)
        with prefill_sdpa():  # no per-shape cuDNN plan build (rollout/kv_cache.py: PREFILL_SDPA_BACKENDS)
            if fresh:
                with clock.part("fresh"):
                    logits, fresh_routes, padded = self._prefill_rows([batch.rows[r] for r in fresh])
                work["prefill_fresh_tokens"] = sum(batch.rows[r][0].length for r in fresh)
                work["prefill_fresh_padded"] = padded
                parts.append(logits)
                if fresh_routes is not None:
                    for i, r in enumerate(fresh):
                        row = batch.rows[r][0]
                        routes[r] = fresh_routes[i, : len(row.prompt_ids) + len(row.token_ids)]
            if cont:
                with clock.part("continue"):
                    logits, cont_routes, padded = self._continue_rows([batch.rows[r][0] for r in cont])
                work["prefill_continue_tokens"] = sum(batch.rows[r][0].length - batch.rows[r][0].cached for r in cont)
                work["prefill_continue_padded"] = padded
                parts.append(logits)
                if cont_routes is not None:
                    for i, r in enumerate(cont):
                        routes[r] = cont_routes[i, : batch.rows[r][0].length - batch.rows[r][0].cached]
        seqs = [s for r in fresh + cont for s in batch.rows[r]]
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        f = self._upload(torch.tensor([[float(s.params.temperature), float(s.params.top_p)] for s in seqs]))
        i = self._upload(torch.tensor([[s.key, s.params.top_k, s.length] for s in seqs]))
        filtered = any_filtered(seqs)
        if not filtered and self.device.type == "cuda" and triton_sampling.available(self.device):  # as decode
            tok, lp = triton_sampling.sample_unfiltered(logits, f[:, 0], uniform_from_counter(i[:, 0], i[:, 2]))
        else:
            tok, lp = sample(logits, temperature=f[:, 0], top_p=f[:, 1], keys=i[:, 0], top_k=i[:, 1],
                             positions=i[:, 2], filtered=filtered)
        out = torch.stack([tok.double(), lp.double()]).cpu()
        # after the copy's wait: the device's events are complete
        self.last_prefill = {"prefill_fresh_rows": len(fresh), "prefill_continue_rows": len(cont),
                             "prefill_continue_waves": int(bool(cont)), **work,
                             **{f"prefill_{kind}_s": seconds for kind, seconds in clock.read().items()}}
        by_seq = {id(s): (int(t), lp) for s, t, lp in zip(seqs, out[0], out[1].tolist(), strict=True)}
        ordered = [by_seq[id(s)] for s in batch.seqs]
        has_routes = any(x is not None for x in routes)
        return ([t for t, _ in ordered], [lp for _, lp in ordered],
                [x.cpu() for x in routes] if has_routes else None)

    def _prefill_rows(self, rows_of: list[list[Sequence]]) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Fresh rows (each from position 0): logits [sequences, V] in row order, device routes [rows, T, ...], and
        the positions the forward computed (rows x the longest row)."""
        padded = max(len(row[0].prompt_ids) + len(row[0].token_ids) for row in rows_of)
        ids = torch.zeros(len(rows_of), padded, dtype=torch.int64)
        last = []
        for r, row in enumerate(rows_of):
            toks = row[0].prompt_ids + row[0].token_ids
            ids[r, : len(toks)] = torch.tensor(toks)
            last.append(len(toks) - 1)
        n_seqs = sum(map(len, rows_of))
        row_of, slot_of = [r for r, row in enumerate(rows_of) for _ in row], [s.slot for row in rows_of for s in row]
        if self.config.compile:  # no size reaching the compiled prefill may be 1: Dynamo specialises it (a
            # second whole-model compile mid-run, e.g. at an agent's next turn or a resumed partial rollout)
            if len(rows_of) == 1:  # one prompt row: a copy is run beside it, never written nor sampled
                ids, last = ids.repeat(2, 1), last * 2
            if n_seqs == 1:  # one sequence: its row is written into its slot twice (the same K/V)
                row_of, slot_of = row_of * 2, slot_of * 2
        # inputs up through pinned memory without a host sync (a pageable copy waits for the stream)
        rows = self._upload(torch.tensor(row_of))
        slots = self._upload(torch.tensor(slot_of))
        logits, routes = self._prefill(self._upload(ids), slots, rows, self._upload(torch.tensor(last)))
        return logits[:n_seqs], None if routes is None else routes[: len(rows_of)], ids.numel()

    def _continue_rows(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Continuations (one sequence per row): the tokens after each one's `cached` run at their positions,
        attending to the KV its slot holds; logits [rows, V], device routes [rows, T, ...], and the positions the
        forward computed (its graph bucket's rows x tokens, or rows x the longest row)."""
        for s in seqs:  # the parked slot's position 0, overwritten by padding decode rows meanwhile
            if s.kv_start is not None:
                self.restore_slot_start(s.slot, s.kv_start)
                s.kv_start = None
        toks = [(s.prompt_ids + s.token_ids)[s.cached:] for s in seqs]
        width, kv_len = max(map(len, toks)), max(s.length for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.int64)
        for r, t in enumerate(toks):
            ids[r, : len(t)] = torch.tensor(t)
        meta = torch.tensor([[s.slot, s.cached, len(t)] for s, t in zip(seqs, toks)])
        key = self.continuations.bucket_for(len(seqs), width, kv_len) if self.continuations is not None else None
        # a CUDA graph of the wave's bucket (rollout/continuation_graphs.py); beside training only one captured already
        if key is not None and (self.may_capture or key in self.continuations.graphs):
            h = self.continuations.run(key, ids, meta, self._upload)
            if h is not None:
                return self._logits(h), None, key[0] * key[1]
        if self.config.compile:  # no size reaching the compiled graph may be 1 (as in _prefill_rows): one row
            # runs twice (the same K/V written twice), one new token gets a padding column (the spare position)
            if len(seqs) == 1:
                ids, meta = ids.repeat(2, 1), meta.repeat(2, 1)
            if width == 1:
                ids = torch.cat([ids, torch.zeros_like(ids)], dim=1)
        meta = self._upload(meta)
        # the KV length rounded up to 16 positions (masked) where the slot has them
        kv_index = torch.arange(min(-(-kv_len // 16) * 16, self.cache.slot_len), device=self.device)
        logits, routes = self._continue(self._upload(ids), meta[:, 0], meta[:, 1], meta[:, 2], kv_index)
        return logits[: len(seqs)], None if routes is None else routes[: len(seqs)], ids.numel()

    def _continue_fn(self, ids: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                     kv_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [N, V] of the continuation rows' last new tokens and (a mixture of experts) the experts of every
        token they ran; what torch.compile sees."""
        trace = RouterTrace(keep_choice=True) if self.moe_layers else None
        h = self._continue_hidden(ids, slots, starts, lens, kv_index, trace)
        return self._logits(h), self._routes(trace, tuple(ids.shape))

    def _continue_hidden(self, ids: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                         kv_index: torch.Tensor, trace: RouterTrace | None = None) -> torch.Tensor:
        """Continuation rows ids [N, T] (right-padded; row r's first lens[r] tokens at positions starts[r] + t of
        slot slots[r]), attending over kv_index = arange(kv_len) positions -> the final hidden state [N, H] of each
        row's last new token (what a continuation graph captures)."""
        n, t = ids.shape
        pos = starts[:, None] + torch.arange(t, device=ids.device)[None, :]
        attn = ContinuationAttention(self.cache, slots=slots, starts=starts, lens=lens, kv_index=kv_index)
        h = self.model.hidden_states(ids, pos, attn=attn, routing=trace)
        return h[torch.arange(n, device=ids.device), lens - 1]

    def save_slot_start(self, slot: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A copy of the KV (and fp8 scales) at position 0 of `slot`, which padding decode rows write."""
        with torch.inference_mode():
            scales = self.cache.scales[:, :, slot, :, 0].clone() if self.cache.scales.numel() else None
            return self.cache.data[:, :, slot, :, 0].clone(), scales

    def restore_slot_start(self, slot: int, saved: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        with torch.inference_mode():
            self.cache.data[:, :, slot, :, 0] = saved[0]
            if saved[1] is not None:
                self.cache.scales[:, :, slot, :, 0] = saved[1]

    def _prefill_fn(self, ids: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                    last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Right-padded prompt rows ids [Np, T] -> K/V written to `slots` (row rows[i] for slot i), the
        logits [len(slots), V] of each sequence's last prompt token and (a mixture of experts) the rows'
        experts [Np, T, L_moe, k]; what torch.compile sees for prefill."""
        n, t = ids.shape
        pos = torch.arange(t, device=ids.device).expand(n, t)
        attn = PrefillAttention(self.cache, slots=slots, rows=rows)
        trace = RouterTrace(keep_choice=True) if self.moe_layers else None
        if trace is None:
            h = self.model.hidden_states(ids, pos, attn=attn)
        else:
            h = self.model.hidden_states(ids, pos, attn=attn, routing=trace)
        return self._logits(h[torch.arange(n, device=ids.device), last])[rows], self._routes(trace, (n, t))


__all__ = ["PrefillMixin"]
