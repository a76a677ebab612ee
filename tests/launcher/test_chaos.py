"""The chaos run (`make test-chaos`, minutes; marked `chaos`, not in `make test`): the GRPO demo trains STEPS steps
on gloo under `torchrun --max-restarts 20` while a driver kills a random rank with kill -9 at random times (KILLS
kills, some while a checkpoint is being written) and sends one rank a SIGTERM (a preemption: it saves, exits 75,
torchrun restarts it). Every restarted attempt continues by itself (no trainer.resume flag). Compared with an
uninterrupted run of the same command: every step's metrics row appears once and equals the straight run's, the
prompt ledger (prompts.jsonl) holds each step's draw once and the same draws (each prompt once per epoch), and the
final weights are equal. The figures (kills survived, steps, seconds lost per kill) are printed as one JSON line.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.dist_utils import repo_pythonpath
from tests.launcher.test_faults import ROOT, TINY, _same_run, rows

STEPS = 200
KILLS = 9  # kill -9 of a random rank; CHECKPOINT_KILLS of them wait for a checkpoint being written
CHECKPOINT_KILLS = 3
COMMON = [f"trainer.total_steps={STEPS}", "trainer.save_every=10", "trainer.keep_last=2", *TINY]


def _launch(tmp_path: Path, name: str, *, restarts: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo_pythonpath())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--max-restarts={restarts}", "--monitor-interval=0.5", str(ROOT / "launcher" / "main.py"),
           str(ROOT / "conf" / "grpo_tiny.yaml"), f"trainer.runs_dir={tmp_path}", f"trainer.experiment_name={name}",
           *COMMON]
    return subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _ranks(agent: int) -> list[int]:
    """The torchrun agent's worker processes (the ranks; their reward workers are their own children)."""
    kids = []
    for task in Path(f"/proc/{agent}/task").glob("*"):
        try:
            kids += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def _last_step(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return max((json.loads(x)["step"] for x in lines if x.strip()), default=0)
    except (OSError, ValueError, KeyError):
        return 0


class Driver(threading.Thread):
    """Kills a random rank of the live attempt, each time after the run got past the step of the previous event
    (so every attempt trains before it is hit), never in the last 20 steps."""

    def __init__(self, agent: subprocess.Popen, run: Path, *, seed: int = 0):
        super().__init__(daemon=True)
        self.agent, self.run_dir, self.rng = agent, run, random.Random(seed)
        events = ["kill"] * (KILLS - CHECKPOINT_KILLS) + ["checkpoint"] * CHECKPOINT_KILLS + ["sigterm"]
        self.rng.shuffle(events)
        self.events, self.done = events, []  # done: (event, step at the event, staging dir seen at the kill)

    def _alive(self) -> bool:
        return self.agent.poll() is None

    def _attempts(self) -> int:
        try:
            return len((self.run_dir / "attempts.jsonl").read_text().splitlines())
        except OSError:
            return 0

    def run(self) -> None:
        after, attempts = 0, 1
        for event in self.events:
            # the next attempt runs (a preempted one finishes its step before it exits) and trained past `after`
            while self._alive() and (self._attempts() < attempts or _last_step(self.run_dir) <= after
                                     or len(_ranks(self.agent.pid)) < 2):
                time.sleep(0.05)
            if not self._alive() or _last_step(self.run_dir) >= STEPS - 20:
                return
            staging = False
            if event == "checkpoint":  # poll for step_N.tmp-staging (tens of ms on the tiny model)
                deadline = time.monotonic() + 60
                ckpts = self.run_dir / "checkpoints"
                while self._alive() and time.monotonic() < deadline and not staging:
                    staging = any(p.name.endswith(".tmp-staging") for p in ckpts.iterdir())
                    if not staging:
                        time.sleep(0.002)
            else:
                time.sleep(self.rng.uniform(0.0, 2.0))
            ranks = _ranks(self.agent.pid)
            if not ranks:
                continue
            step = _last_step(self.run_dir)
            os.kill(self.rng.choice(ranks), signal.SIGTERM if event == "sigterm" else signal.SIGKILL)
            self.done.append((event, step, staging))
            after, attempts = step, self._attempts() + 1


def _ledger(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "prompts.jsonl").read_text().splitlines()]


@pytest.mark.chaos
def test_chaos_run_loses_nothing_and_doubles_nothing(tmp_path):
    t0 = time.monotonic()
    straight = _launch(tmp_path, "straight", restarts=0)
    out, _ = straight.communicate(timeout=1800)
    straight_s = time.monotonic() - t0
    assert straight.returncode == 0, out[-5000:]

    t0 = time.monotonic()
    chaos = _launch(tmp_path, "chaos", restarts=20)
    driver = Driver(chaos, tmp_path / "chaos")
    driver.start()
    out, _ = chaos.communicate(timeout=3600)
    chaos_s = time.monotonic() - t0
    driver.join(5)
    assert chaos.returncode == 0, out[-8000:]

    kills = [d for d in driver.done if d[0] != "sigterm"]
    assert len(kills) >= 8 and any(d[0] == "sigterm" for d in driver.done), driver.done
    assert any(staging for _, _, staging in kills), f"no kill landed during a checkpoint write: {driver.done}"
    run, ref = tmp_path / "chaos", tmp_path / "straight"
    attempts = (run / "attempts.jsonl").read_text().splitlines()
    assert len(attempts) == len(driver.done) + 1  # each event cost one restart, each restart continued the run
    # every step's row once, equal to the straight run's (all but wall times)
    got = rows(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    _same_run(rows(ref), got)
    # the prompt ledger: each step's draw once, the straight run's draws, each prompt once per epoch
    ledger = _ledger(run)
    assert [r["step"] for r in ledger] == list(range(1, STEPS + 1)) and ledger == _ledger(ref)
    seen = [(r["epoch"], row) for r in ledger for row in r["rows"]]
    assert len(seen) == len(set(seen))
    a = load_file(ref / "checkpoints" / f"step_{STEPS}" / "actor" / "model.safetensors")
    b = load_file(run / "checkpoints" / f"step_{STEPS}" / "actor" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    figures = {"steps": STEPS, "kills_survived": len(kills), "sigterms": 1,
               "kills_during_checkpoint_writes": sum(s for _, _, s in kills), "restarts": len(attempts) - 1,
               "straight_s": round(straight_s, 1), "chaos_s": round(chaos_s, 1),
               "lost_s_per_event": round((chaos_s - straight_s) / len(driver.done), 1)}
    print(json.dumps(figures))
