"""Decoding beside training: the partial rollouts in flight keep decoding on a thread of their own, on a CUDA stream
of their own, while the caller scores and trains on the same GPU.

    beside = DecodeBeside(rollouts)          # after run_until handed over the step's groups; starts at once
    ...                                       # the scoring forwards and the update, on the caller's stream
    report = beside.stop()                    # the decode step in flight ends; -> steps, tokens, seconds
    rollouts.suspend()                        # as after any generation: the engine may take new weights now

The engine keeps the weights it decoded with (its own copy: rollout.hybrid copies the training shards in), so every
token sampled beside the update is the version's named in `rollouts.version`, and a group's staleness is counted as
for any partial rollout. Completed groups stay held; the next run_until hands them over first.

Why it was built: the decode step of a partially filled batch reads the weights and KV at a fraction of the GPU's
compute, and the update is compute-bound, so the two might share the GPU better than they take turns (docs/async.md
gives the step model's ceiling). Both loops are Python, under one interpreter lock, so the switch interval is
shortened while decoding runs beside (SWITCH_INTERVAL_S), or a decode step would wait up to the default 5 ms for the
lock at each torch call (each releases it). What it cannot escape is the GPU: on an H100 the update's kernels hold the
SMs, and a decode step beside them takes 4-14x its time alone (docs/async.md), so it gains little; off by default.

Only the running rows decode beside (NativeEngine.set_beside_training): what waits for a slot is admitted before the
thread starts (PartialRollouts.admit_waiting, the generation's last prefill), and nothing after, since a prefill is
compute-bound like the update and would share nothing with it; no CUDA graph is captured (a capture could meet the
trainer's allocator releasing cached blocks, which no capture may see; a shape without a graph replays the captured
graph of more rows, padding rows included, and runs un-graphed only where there is none).

Only a generation replica of one rank decodes beside (rollout.gen_tp=1): a TP group's decode steps are collectives,
which would interleave with the trainer's in an order no two ranks agree on. The number of steps run beside depends
on how long the update takes, so runs are not bit-reproducible (which continuation draws which seed moves).
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import nullcontext

import torch

from rollout.partial import PartialRollouts

# the interpreter's lock hand-over while decoding runs beside (Python's default: 5 ms). Every torch call of the decode
# thread releases the lock and waits up to this long to take it back from the trainer's thread (the convoy effect:
# on the CPU, bench.beside_contention's decode beside a pure Python loop takes 100 ms a step at 0.5 ms, 30 at 0.1)
SWITCH_INTERVAL_S = 0.0001
# the decode stream's priority: the highest the device has (torch maps a value past the range onto its end), so the
# GPU's block scheduler may start a decode kernel's blocks ahead of the update's waiting ones (a CUDA graph replayed
# into the stream runs at its priority). Measured on an H100 (bench.beside_contention): no gain beside training or
# matmuls, whose kernels hold every SM; none lost either
STREAM_PRIORITY = -100


class DecodeBeside:
    """A thread stepping `rollouts` until stop() (or until no row is left decoding)."""

    def __init__(self, rollouts: PartialRollouts, *, device: torch.device | str = "cpu"):
        self.rollouts = rollouts
        self.device = torch.device(device)
        self.steps, self.error = 0, None
        # what waits for a slot goes in first (on the caller's time, as the generation's last prefill): beside, nothing
        # is admitted, and a step whose quota was met by groups completed earlier would leave its new groups waiting
        # through the whole update (on an H100's heavy tail every third step did, the GPU decoding nothing beside)
        rollouts.admit_waiting()
        rollouts.settle()  # the step in flight from run_until is the generation's: its tokens are not counted here
        self._tokens = rollouts.engine.stats["sampled_tokens"]
        self._ungraphed = rollouts.engine.runner.ungraphed_steps
        self._stop = threading.Event()
        self._stream = None
        if self.device.type == "cuda":  # the engine's pending work (run_until's last step) first
            self._stream = torch.cuda.Stream(self.device, priority=STREAM_PRIORITY)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        rollouts.engine.set_beside_training(True)
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, SWITCH_INTERVAL_S))
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="decode-beside", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
                while not self._stop.is_set() and self.rollouts.engine.is_decoding():
                    self.rollouts.advance()
                    self.steps += 1
        except BaseException as e:  # raised to the caller by stop()
            self.error = e
        self.seconds = time.perf_counter() - self._t0

    def stop(self) -> dict[str, float]:
        """End the decoding (the step in flight finishes first), hand the engine's stream back to the caller's.
        -> async/beside_steps, _ungraphed_steps (of them, run without a CUDA graph: none of their shape or more rows was
        captured before), _tokens (sampled beside), _s (the thread's seconds), _stop_s (the wait)."""
        t = time.perf_counter()
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)
        self.rollouts.engine.set_beside_training(False)
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        if self.error is not None:
            raise RuntimeError(f"decoding beside the update failed: {type(self.error).__name__}: "
                               f"{self.error}") from self.error
        self.rollouts.settle()  # the last step launched beside: its tokens are counted here
        return {"async/beside_steps": float(self.steps),
                "async/beside_ungraphed_steps": float(self.rollouts.engine.runner.ungraphed_steps - self._ungraphed),
                "async/beside_tokens": float(self.rollouts.engine.stats["sampled_tokens"] - self._tokens),
                "async/beside_s": self.seconds, "async/beside_stop_s": time.perf_counter() - t}


__all__ = ["DecodeBeside", "STREAM_PRIORITY", "SWITCH_INTERVAL_S"]
