"""Preemption: SIGTERM / SIGINT (Slurm preemption, `scancel`, Ctrl-C) or a stop file end the run
at the next step boundary with a checkpoint, then the process exits with EXIT_PREEMPTED.

    stop = StopRequest(grace_s=100, stop_file=os.environ.get("HYBRIDRL_STOP_FILE")).install()
    ...  # the trainer asks `stop.requested` at each step boundary (all ranks agree), saves, returns

The signal handler only records the request: the current step finishes (its stages hold
collectives; abandoning one on a single rank would hang the others), the trainer saves
`step_N` and returns the reason to launcher/main.py. If that takes longer than `grace_s`,
a timer ends the process with the same exit code: the previous complete checkpoint stays
intact (saves are atomic), so the run is still resumable, from one checkpoint earlier.
A second SIGINT (Ctrl-C twice) exits at once.

Exit codes (launcher/main.py): 0 done, 1 failure, 2 user error, 75 preempted and resumable
(sysexits' EX_TEMPFAIL), 76 a rank stopped answering (launcher.watchdog; resumable too).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

EXIT_PREEMPTED = 75

_log = logging.getLogger("hybridrl")


class StopRequest:
    """A stop request from a signal or a stop file; `requested` is the reason (or None)."""

    def __init__(self, *, grace_s: float, stop_file: str | None = None, exit_fn=os._exit):
        self.grace_s, self.stop_file = grace_s, stop_file
        self.requested: str | None = None
        self.since: float | None = None
        self._exit = exit_fn
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        """Main thread only (Python delivers signals there)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self.poll_file()
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None and signum == signal.SIGINT:
            os.write(2, f"rank {os.environ.get('RANK', 0)}: second SIGINT, exiting without a checkpoint\n".encode())
            self._exit(130)
        self.request(name)

    def poll_file(self) -> None:
        """The Slurm templates' way to preempt (their `--signal=B:USR1@T` trap touches this file),
        since torchrun's agent kills its workers 30 s after forwarding a signal to them."""
        if self.stop_file and self.requested is None and os.path.exists(self.stop_file):
            self.request(f"stop file {self.stop_file}")

    def request(self, reason: str) -> None:
        if self.requested is not None:
            return
        self.requested, self.since = reason, time.monotonic()
        # from a signal handler: not logging (its lock may be held by the interrupted code), not print
        # (a buffered stream interrupted mid-write raises "reentrant call"); one raw write
        os.write(2, f"rank {os.environ.get('RANK', 0)}: {reason}: finishing the step and saving a checkpoint "
                    f"(grace {self.grace_s:g} s)\n".encode())
        if self.grace_s > 0:
            threading.Thread(target=self._deadline, daemon=True, name="preempt-grace").start()

    def _deadline(self) -> None:
        time.sleep(self.grace_s)
        print(f"rank {os.environ.get('RANK', 0)}: preemption grace of {self.grace_s:g} s ran out before the "
              f"checkpoint was complete; exiting {EXIT_PREEMPTED}: resume=auto continues from the newest "
              f"complete checkpoint", file=sys.stderr, flush=True)
        self._exit(EXIT_PREEMPTED)


def stop_file_blocks_start(stop_file: str | None) -> bool:
    """A restarted worker (torchrun --max-restarts) of a job that was asked to stop must not train."""
    return bool(stop_file) and os.path.exists(stop_file)
