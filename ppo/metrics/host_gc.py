"""Python's cyclic garbage collector around the step loop: its pauses measured, and the objects that
outlive the warm-up kept out of its full collections.

torch.compile leaves hundreds of thousands to millions of long-lived Python objects behind (FX graphs,
guards, Inductor's kernel metadata, sympy expressions). Every full (generation 2) collection walks all of
them, so one can stall the host for tenths of a second inside a step while the GPU runs dry. Python
starts one whenever the objects that survived younger collections reach a quarter of the long-lived
ones, at an unpredictable point of some step. `freeze_survivors` collects once and moves everything still
alive into the permanent generation (`gc.freeze`), which no collection scans; the trainer calls it after
the first step and after any step that compiled a graph (trainer.gc_freeze). Objects created later are
collected as before; frozen ones are still freed by reference counting, and only reference cycles among
them outlive the loop's `gc.unfreeze`, which hands them back to the collector.
"""

from __future__ import annotations

import gc
import time


class GcPauses:
    """The collector's pauses in this process: seconds spent and full collections run since the last
    `take()`. Installed as a `gc.callbacks` hook; `close()` removes it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._started: float | None = None
        gc.callbacks.append(self._hook)

    def _hook(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self.full += info["generation"] == 2
            self._started = None

    def take(self) -> dict[str, float]:
        """{"gc_s": seconds paused, "gc_full": full collections} since the last take; resets both."""
        out = {"gc_s": self.seconds, "gc_full": self.full}
        self.seconds, self.full = 0.0, 0
        return out

    def close(self) -> None:
        if self._hook in gc.callbacks:
            gc.callbacks.remove(self._hook)


def freeze_survivors() -> tuple[int, float]:
    """One full collection, then every object that survived it into the permanent generation.
    Returns (objects frozen in all, seconds the collection and the freeze took)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count(), time.perf_counter() - t0
