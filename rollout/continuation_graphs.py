"""CUDA graphs of kept-KV continuation prefills (an agent's returning turns, a resumed partial rollout).

A wave of returning rows runs the whole model over a few new tokens each, attending to the KV its slots already
hold. Launched from Python that is ~550 kernels and ~20 ms of host time for 2.5-4 ms of device work on a 28-layer
model (measured on an H200: docs/results.md, multi-turn agents), and every wave stalls every decoding row. So a
wave replays a CUDA graph of its bucket instead: rows rounded up to a power of two, new tokens to a multiple of
TOKENS, KV positions to a multiple of KV. Padding rows point at the cache's spare slot (which no live row reads)
and padding columns at the spare last position; extra KV positions are masked. The graph ends at each row's last
hidden state: the LM head and sampling run outside it, so no graph holds a vocabulary-wide output.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

TOKENS = 16  # new tokens per row rounded up to a multiple of this
KV = 256  # KV positions rounded up to a multiple of this (at most the slot length)
MAX_TOKENS = 16384  # rows x new tokens of the largest graphed bucket (bigger waves run un-graphed)
MAX_KV_ROWS = 262144  # rows x KV positions of the largest graphed bucket: the attention's gathered K/V is
# transient memory that the graph pool keeps (1 GiB per layer's K and V at 8 KV heads of 128 in bf16)
MAX_GRAPHS = 64  # buckets captured at most (the rest run un-graphed)

Bucket = tuple[int, int, int]  # (rows, new tokens, KV positions)


def bucket(rows: int, tokens: int, kv_len: int, *, slot_len: int) -> Bucket | None:
    """The graph bucket of a wave of `rows` rows of at most `tokens` new tokens over kv_len positions, or None
    when it is too large to graph."""
    r = max(2, 1 << (rows - 1).bit_length())
    t = -(-max(tokens, 2) // TOKENS) * TOKENS
    kv = min(-(-kv_len // KV) * KV, slot_len)
    if r * t > MAX_TOKENS or r * kv > MAX_KV_ROWS:
        return None
    return r, t, kv


class ContinuationGraphs:
    """One captured graph per bucket over static buffers: ids [R, T], meta [R, 3] (slot, start, new tokens),
    kv_index arange(KV) and the output hidden states [R, H]. `forward(ids, slots, starts, lens, kv_index) -> h`
    is the runner's continuation trunk; `pool()` its graph memory pool (shared with the decode graphs: every
    replay is ordered on one stream)."""

    def __init__(self, forward: Callable[..., torch.Tensor], *, device: torch.device, spare_slot: int,
                 slot_len: int, stream: torch.cuda.Stream | None, pool: Callable[[], object]):
        self.forward, self.device = forward, device
        self.spare_slot, self.slot_len = spare_slot, slot_len
        self.stream, self.pool = stream, pool
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self.static: dict[Bucket, tuple[torch.Tensor, ...]] = {}
        self.error: str | None = None  # a failed capture: continuations run un-graphed from then on
        self.replays = self.captures = 0  # waves replayed from a graph (captures included), graphs captured

    def clear(self) -> None:
        """Forget the graphs (new weight storage, or the runtime freed); buffers go with them."""
        self.graphs.clear()
        self.static.clear()

    def bucket_for(self, rows: int, tokens: int, kv_len: int) -> Bucket | None:
        if self.error is not None:
            return None
        key = bucket(rows, tokens, kv_len, slot_len=self.slot_len)
        if key is None or (key not in self.graphs and len(self.graphs) >= MAX_GRAPHS):
            return None
        return key

    def run(self, key: Bucket, ids: torch.Tensor, meta: torch.Tensor, upload) -> torch.Tensor | None:
        """Hidden states [len(ids), H] of the rows' last new tokens: host ids [N, t] (right-padded) and meta
        [N, 3] padded into the bucket's static buffers (upload(host, into=buffer)), then the graph replayed.
        None when the capture failed (the caller runs the wave un-graphed; so does every later wave)."""
        rows, tokens, kv = key
        n, t = ids.shape
        padded_ids = torch.zeros(rows, tokens, dtype=torch.int64)
        padded_ids[:n, :t] = ids
        padded_meta = torch.tensor([[self.spare_slot, 0, 1]], dtype=torch.int64).repeat(rows, 1)
        padded_meta[:n] = meta
        if key not in self.static:
            self.static[key] = (torch.zeros(rows, tokens, dtype=torch.int64, device=self.device),
                                torch.zeros(rows, 3, dtype=torch.int64, device=self.device),
                                torch.arange(kv, device=self.device), None)
        static_ids, static_meta = self.static[key][:2]
        upload(padded_ids, into=static_ids)
        upload(padded_meta, into=static_meta)
        try:
            self.replay(key)
        except Exception as e:  # noqa: BLE001 - keep generating: un-graphed continuations are slower but correct
            self.error = f"{type(e).__name__}: {e}"[:500]
            log.warning("CUDA graph capture of a continuation prefill failed; running them un-graphed: %s",
                        self.error)
            torch.cuda.synchronize(self.device)
            self.clear()
            return None
        return self.static[key][3][:n]

    def _forward(self, key: Bucket) -> torch.Tensor:
        ids, meta, kv_index, _ = self.static[key]
        return self.forward(ids, meta[:, 0], meta[:, 1], meta[:, 2], kv_index)

    def replay(self, key: Bucket) -> None:
        """Replay the bucket's graph, capturing it first: a warm-up run outside the capture loads every kernel
        (it writes the same K/V that the replay writes again), capture_begin/end directly as the decode graphs
        do (no gc.collect + empty_cache per capture), then one replay."""
        self.replays += 1
        if key in self.graphs:
            self.graphs[key].replay()
            return
        self.captures += 1
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            self._forward(key)
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool())
            try:
                out = self._forward(key)
            finally:
                graph.capture_end()
        main.wait_stream(self.stream)
        self.static[key] = (*self.static[key][:3], out)
        self.graphs[key] = graph
        graph.replay()
