"""User reward functions run in a worker process (ppo/data/reward_worker.py): what would end, stall or move the
trainer in-process (sys.exit, os._exit, a crash, a hang, chdir, forked children, huge or non-finite values) is a
counted reward failure naming the function and the sample, and the next samples are scored as by a well-behaved
function. Built-in rules stay in-process."""

from __future__ import annotations

import os
import time

import pytest

from ppo.data.reward_worker import build_reward_manager
from ppo.data.rewards import RewardSample

NASTY = '''
import os, signal, subprocess, sys, time

def score(response, ground_truth, **extra):
    if response == "exit":
        sys.exit(3)
    if response == "os_exit":
        os._exit(0)
    if response == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if response == "chdir":
        os.chdir("/")
    if response == "fork":
        with open(ground_truth, "w") as f:
            f.write(str(subprocess.Popen(["sleep", "300"]).pid))
    if response == "hang":
        time.sleep(60)
    if response == "huge":
        return 1e300
    if response == "nan":
        return float("nan")
    if response == "cwd":
        return float(os.getcwd() == ground_truth)
    return 1.0
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_user_reward_faults_become_counted_failures(tmp_path, caplog):
    (tmp_path / "nasty.py").write_text(NASTY)
    home = os.getcwd()
    mgr = build_reward_manager(f"{tmp_path}/nasty.py:score", default_score=-1.0, timeout_s=2, signature="auto")
    assert mgr.worker is not None
    responses = ["ok", "exit", "ok", "os_exit", "ok", "segv", "chdir", "cwd", "hang", "huge", "nan", "fork", "ok"]
    gts = {"cwd": home, "fork": str(tmp_path / "child.pid")}
    res = mgr.score([RewardSample(i, "p", r, gts.get(r, "g")) for i, r in enumerate(responses)])
    failed = {responses[i]: msg for i, msg in res.failures.items()}
    assert set(failed) == {"exit", "os_exit", "segv", "hang", "huge", "nan"}, failed
    assert failed["exit"] == "SystemExit: 3"
    assert failed["os_exit"].startswith("WorkerDied") and "exit code 0" in failed["os_exit"]
    assert "killed by signal 11" in failed["segv"]
    assert failed["hang"].startswith("RewardTimeout") and "beyond" in failed["huge"]
    # every other sample scored as usual, the chdir undone before the next call, the trainer's cwd untouched
    assert [s for r, s in zip(responses, res.scores) if r not in failed] == [1.0] * 7
    assert [s for r, s in zip(responses, res.scores) if r in failed] == [-1.0] * 6
    assert os.getcwd() == home and mgr.worker.restarts == 3
    assert any("reward function score failed: SystemExit: 3 (at nasty.py:6; first on sample 1," in m
               for m in caplog.messages), caplog.messages
    stray = int((tmp_path / "child.pid").read_text())
    assert _alive(stray)
    mgr.close()  # the worker's process group goes, the function's children with it
    deadline = time.monotonic() + 5
    while _alive(stray) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(stray)


def test_builtin_rules_are_called_in_process():
    mgr = build_reward_manager("builtin:math", default_score=0.0, timeout_s=5, signature="auto")
    assert mgr.worker is None
    assert mgr.score([RewardSample(0, "p", "#### 42", "42")]).scores == [1.0]


def test_a_function_that_fails_to_load_in_the_worker_is_a_reward_function_error(tmp_path):
    from ppo.data.reward_calls import RewardFunctionError
    from ppo.data.reward_worker import RewardWorker

    (tmp_path / "bad.py").write_text("import os\nif os.environ.get('HYBRIDRL_REWARD_WORKER'):\n"
                                     "    raise ImportError('x')\ndef f(response, ground_truth):\n    return 1.0\n")
    w = RewardWorker(f"{tmp_path}/bad.py:f")
    with pytest.raises(RewardFunctionError, match="in its worker process: RewardFunctionError: importing"):
        list(w.score([("r", "g", "p", 0, {})], timeout_s=5, max_timeouts_in_a_row=3))
    w.close()
