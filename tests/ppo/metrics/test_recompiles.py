"""ppo.metrics.recompiles: Dynamo's recompile reasons reach the step's metrics (in a child process: the log
artifact it turns on is process-wide)."""

import subprocess
import sys
import textwrap

from ppo.metrics.recompiles import summary

SNIPPET = textwrap.dedent("""
    import torch
    from ppo.metrics.recompiles import recompile_log, summary
    log = recompile_log()
    assert recompile_log() is log  # one per process
    if log is None:
        print("NONE")
        raise SystemExit(0)

    class Runner:
        width = 8

    runner = Runner()

    @torch.compile(backend="eager")
    def decode(x):
        return x * runner.width  # a value read from an object: a guard

    decode(torch.ones(3))
    assert log.take() == []
    runner.width = 4
    decode(torch.ones(3))
    (message,) = log.take()
    print("SUMMARY", summary(message))
""")


def run(env_logs=None):
    import os

    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    if env_logs is not None:
        env["TORCH_LOGS"] = env_logs
    return subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, env=env, timeout=300)


def test_a_recompile_is_kept_with_its_function_and_guard():
    out = run()
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("SUMMARY"))
    assert "Recompiling function decode" in line and "width" in line


def test_torch_logs_without_recompiles_is_left_alone():
    out = run("dynamo")  # the user's own choice of logs: no recompile log
    assert out.returncode == 0 and "NONE" in out.stdout


def test_summary_is_one_line():
    message = ("Recompiling function f in a.py:3\n    triggered by the following guard failure(s):\n"
               "    - 0/0: self.w == 8     # comment\n    - User stack trace:")
    assert summary(message) == "Recompiling function f in a.py:3: 0/0: self.w == 8 # comment"
