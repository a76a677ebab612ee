"""A user reward function called in a child process, where it cannot take the trainer down or move it.

    manager = build_reward_manager("my_rewards.py:score", default_score=0.0, timeout_s=30, signature="auto")
    worker = RewardWorker("my_rewards.py:score", signature="auto")    # what the manager calls through
    for i, outcome in worker.score(samples, timeout_s=30):   # in sample order, one outcome per sample
        ...  # (value, extras), or a RewardCallFailed naming what happened
    worker.close()                                          # also kills whatever the function forked

What a function can do to the trainer in-process, and what it does here: `sys.exit` / `SystemExit` (caught in
the child: a failed sample), `os._exit` or a crash (segfault, the OOM killer: the child dies, the sample in
flight fails, a new child serves the rest), a hang (the child is killed after `timeout_s`, replaced), a
`chdir` (restored after each call, and the trainer's own directory never moves), children it forks (the child
leads its own process group, killed with it when it is replaced or closed; a child exits when the trainer dies
and takes that group with it). Built-in rule rewards (`builtin:*`) are called in-process: they do none of this
and a round trip per sample would only cost.

The child is a fresh interpreter (`python -m ppo.data.reward_worker`; not forked: the trainer holds threads
and a process group) that imports only this module's light dependencies and the user's file (~0.1 s). Samples
go over one socket as a batch; outcomes come back one per sample, so a death is blamed on the sample in flight.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Iterable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

# the child's environment carries this, so a function (or a test's fault injector) can tell where it runs
WORKER_ENV = "HYBRIDRL_REWARD_WORKER"
START_TIMEOUT_S = 120.0  # spawning the child and importing the user's file


def build_reward_manager(spec: str, *, default_score: float, timeout_s: float | None, signature: str,
                         logger=None):
    """The reward.function's ppo.data.rewards.RewardManager: a user function called through a RewardWorker, a
    built-in rule (`builtin:*`) in this process (cheap, and it does nothing a worker guards against)."""
    from ppo.data.rewards import RewardManager, load_reward_function

    worker = None if spec.startswith("builtin:") else RewardWorker(spec, signature=signature)
    return RewardManager(load_reward_function(spec), default_score=default_score, logger=logger,
                         timeout_s=timeout_s, signature=signature, worker=worker)


class RewardCallFailed(Exception):
    """One sample's call failed in the worker: `kind` is the exception's type name (or "WorkerDied",
    "RewardTimeout"), `where` the file:line that raised (when known)."""

    def __init__(self, kind: str, message: str, where: str = "?"):
        super().__init__(message)
        self.kind, self.where = kind, where


def _serve(conn, spec: str, signature: str) -> None:
    """The child: load the function, then score batches until the pipe closes (the trainer is gone or done)."""
    os.environ[WORKER_ENV] = "1"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the trainer, which closes the pipe
    # multiprocessing terminates a daemonic child with SIGTERM when the trainer exits: take the group along
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    from ppo.data.reward_calls import call_reward, plan_reward_call
    from ppo.data.rewards import load_reward_function

    try:
        fn = load_reward_function(spec)
        call = plan_reward_call(fn, signature=signature)
        conn.send(("ready",))
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, which raises it
        conn.send(("load_error", f"{type(e).__name__}: {e}"))
        return
    home = os.getcwd()
    try:
        while True:
            try:
                batch = conn.recv()
            except EOFError:
                break
            for response, ground_truth, prompt, sample_id, extra in batch:
                try:
                    value, extras = call_reward(call, fn, response, ground_truth, prompt=prompt, sample_id=sample_id,
                                                extra=extra)
                    out = ("ok", value, extras)
                except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are a failed sample too
                    tb = traceback.extract_tb(e.__traceback__)
                    where = f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else "?"
                    out = ("error", type(e).__name__, str(e), where)
                if os.getcwd() != home:
                    os.chdir(home)
                conn.send(out)
    finally:
        os.killpg(0, signal.SIGKILL)  # the function's stray children, and this process last


class RewardWorker:
    """One child process serving one reward function; replaced when it dies or hangs (`restarts` counts)."""

    def __init__(self, spec: str, *, signature: str = "auto"):
        self.spec, self.signature = spec, signature
        self.proc = self.conn = None
        self.restarts = 0

    def _start(self) -> None:
        mine, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])  # the repository: `ppo` importable in the child
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "ppo.data.reward_worker", str(theirs.fileno()),
                                      self.spec, self.signature], pass_fds=(theirs.fileno(),), env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)  # its own group
        theirs.close()
        parent = self.conn = Connection(mine.detach())
        if not parent.poll(START_TIMEOUT_S):
            self._kill()
            raise RuntimeError(f"the reward worker for {self.spec} did not start within {START_TIMEOUT_S:g} s")
        try:
            msg = parent.recv()
        except EOFError:
            code = self._kill()
            raise RuntimeError(f"the reward worker for {self.spec} died while loading it (exit code {code})") from None
        if msg[0] == "load_error":
            self._kill()
            from ppo.data.reward_calls import RewardFunctionError

            raise RewardFunctionError(f"loading reward function {self.spec} in its worker process: {msg[1]}")

    def _kill(self) -> int | None:
        """Kill the child's whole process group (the function's children with it); its exit code."""
        if self.proc is None:
            return None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None
        return code

    def score(self, samples: Iterable[tuple[str, Any, str, Any, dict]], *, timeout_s: float | None,
              max_timeouts_in_a_row: int) -> Iterator[tuple[float, dict[str, float]] | RewardCallFailed]:
        """One outcome per sample (response, ground_truth, prompt, sample_id, extra), in order: (value, extras) or
        the RewardCallFailed of a raise, a death of the child (replaced for the next sample) or a timeout. After
        max_timeouts_in_a_row timeouts the rest are failed without calling."""
        pending = list(samples)
        timeouts = 0
        while pending:
            if timeouts >= max_timeouts_in_a_row:
                for _ in pending:
                    yield RewardCallFailed("NotCalled", f"not called: the reward function timed out on {timeouts} "
                                                        f"samples in a row in this batch")
                return
            if self.proc is None:
                self._start()
            self.conn.send(pending)
            for i in range(len(pending)):
                if not self.conn.poll(timeout_s or None):
                    self._kill()
                    self.restarts += 1
                    timeouts += 1
                    yield RewardCallFailed("RewardTimeout", f"reward function ran longer than reward.timeout_s="
                                                            f"{timeout_s:g} s (its worker process was killed)")
                    pending = pending[i + 1:]
                    break
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    code = self._kill()
                    self.restarts += 1
                    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                    yield RewardCallFailed("WorkerDied", f"the reward function ended its worker process ({how}; "
                                                         f"os._exit, a crash or the OOM killer); a new one serves "
                                                         f"the next samples")
                    pending = pending[i + 1:]
                    break
                timeouts = 0
                yield (msg[1], msg[2]) if msg[0] == "ok" else RewardCallFailed(msg[1], msg[2], msg[3])
            else:
                pending = []

    def close(self) -> None:
        self._kill()


if __name__ == "__main__":  # the child: python -m ppo.data.reward_worker <socket fd> <spec> <signature>
    _serve(Connection(int(sys.argv[1])), sys.argv[2], sys.argv[3])
