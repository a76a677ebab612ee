"""The engine's decode launches (rollout/model_runner.py's EngineModelRunner, through DecodeGraphsMixin): each decode
step replays the CUDA graph of its (row bucket, KV length, filtered sampling, shared-prompt width) key, captured lazily
into one memory pool shared with the continuation graphs; beside training, where nothing may be captured, a shape
without a graph replays the captured graph of more rows (or of a wider shared-prompt table) instead. A step's tokens
and log-probs come back in one async device-to-host copy (DecodeHandle), collected a step later.

The runner provides the state it reads: `graphs`, `graph_pool`, `continuations`, `use_graphs`, `may_capture`,
`graph_error`, `ungraphed_steps`, `kernel_for`, `device`, `config`, `cache`, `moe_layers`, the decode buffers (`out`,
`routes_out`, `_host_out`, `_host_routes`, `_flip`, `meta_i`), `_capture_stream`, `_prefix_width`, and
`_decode_step`, `_pick_kernel`, `_write_members`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rollout.triton_attention import SHORT_KV

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DecodeHandle:
    buf: torch.Tensor  # host [2 * slots] float64: tokens [:num_rows], then logprobs
    num_rows: int
    event: object | None  # torch.cuda.Event on CUDA
    routes: torch.Tensor | None = None  # host [num_rows, L_moe, k]: a mixture of experts' step experts


class DecodeGraphsMixin:
    """EngineModelRunner's decode launches and their CUDA graphs (module docstring)."""

    def _graph_kv_len(self, b: int, kv_len: int) -> int:
        """The KV length a decode step over rows [0, b) runs (and its graph is keyed) with. The Triton kernel
        bounds each row by its position and picks its tile by kv_len only up to SHORT_KV positions, so where it is the
        kernel whatever kv_len is (compiled, or set), every longer step runs at the slot length: one graph per row
        bucket instead of one per (rows, KV bucket) pair, which turns of staggered lengths (agents) kept
        capturing mid-run. SDPA and bmm read exactly kv_len positions and keep the bucket."""
        fixed = self.config.compile or self.config.decode_attention != "auto"
        if fixed and kv_len > SHORT_KV and self._pick_kernel(b, kv_len) == "triton":
            return self.cache.slot_len
        return kv_len

    @torch.inference_mode()
    def launch_decode(self, num_rows: int, kv_len: int, filtered: bool) -> DecodeHandle:
        """Enqueue one decode step (graph replay on CUDA) and the async copy of its [2, num_rows] result (beside
        training, where nothing is captured, of the graph of more rows it replays: the handle says how many)."""
        step = (num_rows, self._graph_kv_len(num_rows, kv_len), filtered)
        key = (*step, self._prefix_width)  # the decode kernel's shared-prompt tile is part of the graph
        if self.use_graphs and key not in self.graphs and not self.may_capture:
            key = self._graph_with_more_rows(key) or key
            step, num_rows = (key[0], *step[1:]), key[0]
            if key[3] != self._prefix_width:
                self._write_members(key[3])
        if not self.use_graphs or (key not in self.graphs and not self.may_capture):
            self._decode_step(*step)
            self.ungraphed_steps += self.device.type == "cuda"
        elif key in self.graphs:
            self.graphs[key].replay()
        else:
            try:
                try:
                    self._capture(key, step)
                except RuntimeError:
                    if self.kernel_for.get(key[:2], "sdpa") == "sdpa":
                        raise
                    # a forced SDPA backend / bmm that runs but does not capture: plain SDPA instead
                    log.warning("decode kernel %s did not capture; using sdpa", self.kernel_for[key[:2]])
                    self.kernel_for[key[:2]] = "sdpa"
                    torch.cuda.synchronize(self.device)
                    self._capture(key, step)
            except RuntimeError as e:  # keep generating: eager decode is slower but correct
                self.graph_error = f"{type(e).__name__}: {e}"[:500]
                log.warning("CUDA graph capture failed, decoding eagerly from now on: %s", self.graph_error)
                self.use_graphs = False
                self._drop_graphs()
                torch.cuda.synchronize(self.device)
                self._decode_step(*step)
        buf = self._host_out[self._flip]
        routes = None
        if self.moe_layers:  # the step's experts per row, beside its tokens (same async copy discipline)
            routes = self._host_routes[self._flip][:num_rows]
            routes.copy_(self.routes_out[:num_rows], non_blocking=True)
        self._flip ^= 1
        buf[: 2 * num_rows].copy_(self.out[: 2 * num_rows], non_blocking=True)  # contiguous: truly async
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return DecodeHandle(buf, num_rows, event, routes)

    def collect(self, handle: DecodeHandle) -> tuple[list[int], list[float], torch.Tensor | None]:
        """Wait for a launched step; tokens and logprobs of rows [0, num_rows) (padding rows included) and (a
        mixture of experts) each row's experts [num_rows, L_moe, k] for the token it ran, else None."""
        if handle.event is not None:
            handle.event.synchronize()
        b = handle.num_rows
        routes = None if handle.routes is None else handle.routes.clone()  # the buffer is reused two steps on
        return [int(t) for t in handle.buf[:b].tolist()], handle.buf[b: 2 * b].tolist(), routes

    def _graph_with_more_rows(self, key: tuple) -> tuple | None:
        """The key of the captured graph of the fewest rows at or above key's, at its KV length and sampling, and at
        its shared-prompt width or (rows sharing prompts) a wider one (None if there is none): beside training,
        where nothing may be captured, a step replays it rather than launching every kernel from the host. The
        rows past key's are the engine's padding rows (finished or free slots: token 0 at position 0 of their slot,
        which the engine saves for slots parked with their KV); a wider graph reads the groups' wider member table
        (_write_members)."""
        rows, kv_len, filtered, width = key
        fits = [k for k in self.graphs if k[1:3] == (kv_len, filtered) and k[0] >= rows
                and (k[3] == width or 0 < width < k[3])]
        return min(fits, key=lambda k: (k[0], k[3])) if fits else None

    def _capture(self, key: tuple, step: tuple[int, int, bool]) -> None:
        """Warm up eagerly (then undo its row advance), capture, and replay once: the step runs exactly once.

        capture_begin/end directly rather than `torch.cuda.graph`, whose gc.collect + empty_cache per
        capture would cost ~100 ms per graph; sleep() drops the graphs, so they are recaptured often."""
        saved = self.meta_i.clone()
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._decode_step(*step)  # warm-up: compiles / loads every kernel outside the capture
            self.meta_i.copy_(saved)
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self._graph_pool())
            try:
                self._decode_step(*step)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graphs[key] = graph
        graph.replay()

    def _drop_graphs(self) -> None:
        """Forget every captured graph and their memory pool. The next capture starts a new pool: one into the old
        pool once all its graphs are gone trips the caching allocator (the pool's use count is 0 while blocks it
        holds still wait to be freed), and a capture that fails there leaves the CUDA generator broken."""
        self.graphs.clear()
        if self.continuations is not None:
            self.continuations.clear()
        self.graph_pool = None

    def _graph_pool(self):
        """The memory pool every captured graph shares (decode and continuation graphs replay on one stream)."""
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        return self.graph_pool


__all__ = ["DecodeGraphsMixin", "DecodeHandle"]
