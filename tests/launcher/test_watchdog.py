"""Heartbeat watchdog: a silent peer is named with its stage; a failed peer is reported sooner; an
orphaned worker (its parent, the torchrun agent, died) stops by itself."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from launcher.watchdog import EXIT_STALLED, Watchdog, clear_alarm, read_alarm

ROOT = Path(__file__).resolve().parents[2]


def _peer(run_dir: Path, rank: int, **rec) -> None:
    d = run_dir / "heartbeat"
    d.mkdir(parents=True, exist_ok=True)
    base = {"rank": rank, "pid": 999999, "host": "elsewhere", "stage": "start", "step": 0, "beat": 1,
            "state": "running"}
    (d / f"rank_{rank}.json").write_text(json.dumps({**base, **rec}))


def test_silent_peer_is_named_with_its_stage(tmp_path):
    exits = []
    wd = Watchdog(tmp_path, rank=0, world_size=3, timeout_s=0.3, watch_parent=False, exit_fn=exits.append)
    wd.dir.mkdir(parents=True)
    wd.set_stage("update_actor", step=4)
    _peer(tmp_path, 1, stage="reward", step=4, beat=7)
    _peer(tmp_path, 2, stage="reward", step=4, beat=1)
    wd.tick()  # first sight of both peers
    _peer(tmp_path, 2, stage="adv", step=4, beat=2)  # rank 2 keeps beating
    time.sleep(0.4)
    _peer(tmp_path, 2, stage="adv", step=4, beat=3)
    wd.tick()
    assert exits == [EXIT_STALLED]
    assert [r for r, _, _ in wd.stalled_ranks(time.monotonic())] == [1]


def test_message_names_rank_stage_and_step(tmp_path, capsys):
    exits = []
    wd = Watchdog(tmp_path, rank=0, world_size=2, timeout_s=0.2, watch_parent=False, exit_fn=exits.append)
    wd.dir.mkdir(parents=True)
    wd.set_stage("merge", step=2)
    _peer(tmp_path, 1, stage="reward", step=2, beat=5)
    wd.tick()
    time.sleep(0.3)
    wd.tick()
    err = capsys.readouterr().err
    assert exits == [EXIT_STALLED]
    assert "rank(s) 1 stopped answering" in err and "stage 'reward' of step 3" in err
    assert "rank 0 (in stage 'merge' of step 3)" in err


def test_stopped_local_peer_is_killed_only_after_the_reporting_rank_exits(tmp_path, monkeypatch):
    # torchrun names the failure it sees first: the reporter's exit 76 must come before the peer's signal 9
    monkeypatch.setattr("launcher.watchdog.KILL_DELAY_S", 0.5)
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(peer.pid, signal.SIGSTOP)
        exits = []
        wd = Watchdog(tmp_path, rank=0, world_size=2, timeout_s=0.2, watch_parent=False, exit_fn=exits.append)
        wd.dir.mkdir(parents=True)
        _peer(tmp_path, 1, stage="reward", step=2, beat=5, pid=peer.pid, host=wd.host)
        wd.tick()
        time.sleep(0.3)
        wd.tick()
        assert exits == [EXIT_STALLED] and peer.poll() is None  # reported, not yet killed
        assert peer.wait(timeout=10) == -signal.SIGKILL
    finally:
        peer.kill()


def test_exited_peer_is_not_stalled_and_failed_peer_is_reported(tmp_path):
    exits = []
    wd = Watchdog(tmp_path, rank=0, world_size=3, timeout_s=60, watch_parent=False, exit_fn=exits.append)
    wd.dir.mkdir(parents=True)
    _peer(tmp_path, 1, state="exited")
    _peer(tmp_path, 2, state="failed", stage="ref")
    now = time.monotonic()
    assert wd.stalled_ranks(now) == []
    stalled = wd.stalled_ranks(now + 11)  # a failed peer: FAILED_PEER_S, not the 60 s timeout
    assert [r for r, _, _ in stalled] == [2]


def test_beats_carry_stage_and_stop_marks_exit(tmp_path):
    wd = Watchdog(tmp_path, rank=1, world_size=2, timeout_s=0, interval_s=0.05, watch_parent=False).start()
    wd.set_stage("gen", step=0)
    time.sleep(0.3)
    rec = wd.read(1)
    assert rec["stage"] == "gen" and rec["beat"] >= 3 and rec["pid"] == os.getpid()
    wd.stop(clean=True)
    assert wd.read(1)["state"] == "exited"


_ORPHAN = """
import os, sys, time
sys.path.insert(0, {root!r})
from launcher.watchdog import Watchdog
pid = os.fork()
if pid == 0:  # the worker; its parent plays the torchrun agent
    Watchdog({run!r}, rank=0, world_size=1, timeout_s=0, interval_s=0.1, watch_parent=True).start()
    time.sleep(30)
    os._exit(0)
print(pid, flush=True)
time.sleep(30)
"""


def test_orphaned_worker_stops_by_itself(tmp_path):
    agent = subprocess.Popen([sys.executable, "-c", _ORPHAN.format(root=str(ROOT), run=str(tmp_path))],
                             stdout=subprocess.PIPE, text=True)
    worker = int(agent.stdout.readline())
    time.sleep(0.5)
    agent.send_signal(signal.SIGKILL)  # kill -9 of the agent only
    agent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(worker, signal.SIGKILL)
        raise AssertionError("the orphaned worker kept running")


def test_large_worlds_watch_a_ring_and_an_alarm_stops_every_rank(tmp_path):
    exits = []
    wd = Watchdog(tmp_path, rank=12, world_size=16, timeout_s=0.2, watch_parent=False, exit_fn=exits.append)
    assert wd.watched == [13, 14, 15, 0, 1, 2, 3, 4]  # each rank is watched by 8 others, not by all
    wd.dir.mkdir(parents=True)
    for r in wd.watched:
        _peer(tmp_path, r, stage="ref", step=0)
    wd.tick()
    time.sleep(0.3)
    wd.tick()  # all eight silent: reported, and the alarm is raised for the ranks that do not watch them
    assert exits == [EXIT_STALLED] and read_alarm(tmp_path)["by"] == 12
    other = Watchdog(tmp_path, rank=7, world_size=16, timeout_s=60, watch_parent=False, exit_fn=exits.append)
    other.tick()  # rank 7 watches none of them, and stops at its next beat all the same
    assert exits == [EXIT_STALLED, EXIT_STALLED]
    clear_alarm(tmp_path)  # a restarted attempt starts without it
    assert read_alarm(tmp_path) is None
