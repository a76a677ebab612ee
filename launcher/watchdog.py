"""Heartbeats: a stalled or dead rank makes every rank exit within `timeout_s`, naming it.

    wd = Watchdog(run_dir, rank=r, world_size=w, timeout_s=180).start()
    wd.set_stage("update_actor", step=3)     # the trainer's stage timer calls this
    wd.stop(clean=True)                      # peers do not count an exited rank as stalled

Each rank's thread rewrites `run_dir/heartbeat/rank_<r>.json` (its stage, step, pid, host and a
counter) every `interval_s` and reads the files of the next WATCH_PEERS ranks (ring order: every
rank is watched by that many others, and a 1000-rank job does not read a million files per
interval). A rank whose counter has not changed for `timeout_s` (measured on the reader's own
clock, so clock skew between nodes does not matter) is reported with its last stage and step in
`heartbeat/ALARM`, and this process exits with EXIT_STALLED; every other rank sees ALARM at its
next beat and exits the same way, repeating the message. A thread, not the main loop, beats:
a rank blocked in a collective waiting for a stalled peer still beats, while a rank stopped by
SIGSTOP, killed, or swapped out does not. A stalled peer on this host is also sent SIGKILL shortly
after the reporting rank exits (it cannot exit by itself; torchrun would otherwise wait for it).
Limit: a main thread that holds the GIL for the whole timeout (a C extension that never releases
it) silences the beat too.

The same thread also (1) ends a worker whose torchrun agent died (its parent pid changed), so
no orphan keeps writing into the run directory, (2) polls the preemption stop file and
(3) refreshes the run-directory lock. The files live in the run directory, which checkpoints
already require on a file system every node shares.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

EXIT_STALLED = 76
WATCH_PEERS = 8  # ranks each rank watches (all of them in worlds up to 9)
ALARM = "ALARM"
FAILED_PEER_S = 10.0  # a peer whose main loop failed (its last beat says so) is reported after this
KILL_DELAY_S = 2.0  # a stalled local peer is killed this long after the reporting rank exits

_log = logging.getLogger("hybridrl")


class Watchdog:
    def __init__(self, run_dir: str | os.PathLike, *, rank: int, world_size: int, timeout_s: float,
                 interval_s: float | None = None, watch_parent: bool | None = None,
                 on_tick: Callable[[], None] | None = None, exit_fn: Callable[[int], None] = os._exit):
        self.dir = Path(run_dir) / "heartbeat"
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        # a few beats per timeout; 10 s at most (file-system load), 0.2 s at least (tests)
        self.interval_s = interval_s or min(10.0, max(0.2, timeout_s / 6 if timeout_s > 0 else 10.0))
        if watch_parent is None:  # under torchrun the parent is the elastic agent
            watch_parent = "TORCHELASTIC_RUN_ID" in os.environ
        self.parent = os.getppid() if watch_parent else None
        self.on_tick, self._exit = on_tick, exit_fn
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.stage, self.step, self.beats = "start", 0, 0
        self.watched = [(rank + i) % world_size for i in range(1, min(world_size, WATCH_PEERS + 1))]
        self._seen: dict[int, tuple[object, float]] = {}  # rank -> (last counter, when it changed here)
        self._done = threading.Event()
        self._write_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._beat("running")
        self._thread = threading.Thread(target=self._loop, daemon=True, name="hybridrl-watchdog")
        self._thread.start()
        return self

    def set_stage(self, stage: str, step: int | None = None) -> None:
        """Written at once (a few small writes per step), so a rank that stalls right after
        entering a stage is reported in that stage."""
        self.stage = stage
        if step is not None:
            self.step = step
        if self._thread is not None and not self._done.is_set():
            self._beat("running")

    def stop(self, *, clean: bool = True) -> None:
        """clean=False (this rank failed): peers report it at once instead of after the timeout."""
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._beat("exited" if clean else "failed")

    # ------------------------------------------------------------------ thread
    def _loop(self) -> None:
        while not self._done.wait(self.interval_s):
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - a full disk must not kill the watchdog itself
                _log.warning("watchdog: %s: %s", type(e).__name__, e)

    def tick(self) -> None:
        """One round: beat, check the parent, run on_tick, check every peer."""
        self._beat("running")
        if self.parent is not None and os.getppid() != self.parent:
            self._fail(1, f"rank {self.rank}: the torchrun agent (pid {self.parent}) is gone; this worker stops "
                          f"instead of running on as an orphan")
            return
        if self.on_tick is not None:
            self.on_tick()
        alarm = read_alarm(self.dir.parent)
        if alarm is not None and alarm.get("by") != self.rank:
            self._fail(EXIT_STALLED, f"rank {self.rank} (in stage '{self.stage}' of step {self.step + 1}) stops: "
                                     f"{alarm.get('message')}")
            return
        if self.timeout_s > 0:
            stalled = self.stalled_ranks(time.monotonic())
            if stalled:
                self._report(stalled)

    def _beat(self, state: str) -> None:
        with self._write_lock:  # the thread and set_stage (main thread) both write
            self.beats += 1
            rec = {"rank": self.rank, "pid": self.pid, "host": self.host, "stage": self.stage, "step": self.step,
                   "beat": self.beats, "state": state, "time": time.time()}
            tmp = self.dir / f".rank_{self.rank}.json.tmp"
            tmp.write_text(json.dumps(rec))
            os.replace(tmp, self.dir / f"rank_{self.rank}.json")

    def read(self, rank: int) -> dict | None:
        try:
            return json.loads((self.dir / f"rank_{rank}.json").read_text())
        except (OSError, ValueError):
            return None

    def stalled_ranks(self, now: float) -> list[tuple[int, dict | None, float]]:
        """[(rank, its last record or None, seconds without a beat)] over the timeout."""
        out = []
        for r in self.watched:
            rec = self.read(r)
            if rec is not None and rec.get("state") == "exited":
                continue
            # the counter and pid together: a restarted rank (new pid) counts as a change
            key = (rec.get("pid"), rec.get("beat")) if rec else None
            last = self._seen.get(r)
            if last is None or last[0] != key:
                self._seen[r] = (key, now)
                continue
            # a failed rank is reported sooner, yet not at once: a user error every rank raises together
            # must reach the console from rank 0 before its watchdog ends it
            limit = min(self.timeout_s, FAILED_PEER_S) if rec and rec.get("state") == "failed" else self.timeout_s
            if now - last[1] > limit:
                out.append((r, rec, now - last[1]))
        return out

    def _report(self, stalled: list[tuple[int, dict | None, float]]) -> None:
        parts, local = [], []
        for r, rec, age in stalled:
            if rec and rec.get("state") == "failed":
                parts.append(f"rank {r} failed in stage '{rec['stage']}' of step {rec['step'] + 1} on {rec['host']} "
                             f"(its error is in logs/rank_{r}.log)")
                continue
            where = (f"last seen in stage '{rec['stage']}' of step {rec['step'] + 1} on {rec['host']} "
                     f"(pid {rec['pid']})") if rec else "never wrote a heartbeat"
            parts.append(f"rank {r} {where}, silent for {age:.0f} s")
            if rec and rec.get("host") == self.host and rec.get("pid"):
                local.append(int(rec["pid"]))
        ranks = ", ".join(str(r) for r, _, _ in stalled)
        msg = (f"watchdog: rank(s) {ranks} stopped answering for more than trainer.watchdog_timeout_s="
               f"{self.timeout_s:g} s: {'; '.join(parts)}. Exiting {EXIT_STALLED}; trainer.resume=auto continues from "
               f"the newest complete checkpoint")
        tmp = self.dir / f".{ALARM}.tmp-{self.rank}"
        tmp.write_text(json.dumps({"by": self.rank, "message": f"rank {self.rank} reported: {msg}"}))
        os.replace(tmp, self.dir / ALARM)  # every other rank stops at its next beat
        _kill_later(local, KILL_DELAY_S)
        self._fail(EXIT_STALLED, f"rank {self.rank} (in stage '{self.stage}' of step {self.step + 1}): {msg}")

    def _fail(self, code: int, msg: str) -> None:
        _log.error("%s", msg)
        print(msg, file=sys.stderr, flush=True)
        self._done.set()
        self._exit(code)


def _kill_later(pids: list[int], delay_s: float) -> None:
    """SIGKILL the stalled peers on this host `delay_s` after this process exits (a stopped process
    cannot exit by itself, and torchrun's SIGTERM does not reach it). Later, not now: torchrun reports
    the failure it sees first, and that must be this rank's EXIT_STALLED, not the peer's signal 9."""
    if pids:
        script = f"sleep {delay_s:g}; kill -KILL {' '.join(map(str, pids))} 2>/dev/null"
        subprocess.Popen(["/bin/sh", "-c", script], start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def read_alarm(run_dir: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(run_dir) / "heartbeat" / ALARM).read_text())
    except (OSError, ValueError):
        return None


def clear_alarm(run_dir: str | os.PathLike) -> None:
    """Rank 0, before any rank starts its watchdog: an earlier attempt's alarm must not stop this one."""
    (Path(run_dir) / "heartbeat" / ALARM).unlink(missing_ok=True)
