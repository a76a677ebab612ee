"""Run test snippets under Triton's CPU interpreter (TRITON_INTERPRET=1) in a child process.

The variable must be set before triton is imported and must not leak into other tests, so the snippets run in
a child. Starting one (importing torch, triton and the engine) costs ~5 s of a 2-core CI machine, more than
many snippets take, so a module's snippets share one child: each is exec'd there in fresh globals, its stdout
captured, and an exception comes back as the test's failure with the traceback. A child serves one test module
(the next module's first snippet replaces it); one that dies or exceeds the timeout is killed and the next
snippet starts a fresh one.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import textwrap

from tests.dist_utils import repo_pythonpath

_LOOP = r"""
import contextlib, io, json, os, sys, traceback
proto = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # stray writes to fd 1 (C code, children) go to stderr, not into the protocol
for line in sys.stdin:
    code = json.loads(line)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<snippet>", "exec"), {"__name__": "__main__"})
        reply = {"ok": True, "out": out.getvalue()}
    except BaseException:
        reply = {"ok": False, "out": out.getvalue() + traceback.format_exc()}
    sys.stderr.flush()
    proto.write(json.dumps(reply) + "\n")
    proto.flush()
"""


class _Child:
    def __init__(self, owner: str):
        self.owner = owner
        self.log = tempfile.TemporaryFile(mode="w+")
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": repo_pythonpath(), "CUDA_VISIBLE_DEVICES": ""}
        self.proc = subprocess.Popen([sys.executable, "-u", "-c", _LOOP], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)

    def run(self, code: str, timeout: float) -> tuple[bool, str]:
        start = self.log.seek(0, os.SEEK_END)
        self.proc.stdin.write(json.dumps(code) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if line:
            reply = json.loads(line)
            if reply["ok"]:
                return True, reply["out"]
            return False, reply["out"] + self._stderr(start)
        why = f"timed out after {timeout} s" if not ready else f"exited {self.proc.poll()}"
        self.close()
        return False, f"interpreter child {why}\n" + self._stderr(start)

    def _stderr(self, start: int) -> str:
        self.log.seek(start)
        return "\nSTDERR\n" + self.log.read()[-6000:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_child: _Child | None = None


def run_interpreted(code: str, *, owner: str | None = None, timeout: float = 600) -> str:
    """Exec `code` (dedented) with TRITON_INTERPRET=1 in the child serving `owner` (default: the calling test's
    module); fails the test with its traceback if it raises. Returns what it printed."""
    global _child
    owner = owner or os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0]
    if _child is not None and (_child.owner != owner or not _child.alive()):
        _child.close()
        _child = None
    if _child is None:
        _child = _Child(owner)
    ok, out = _child.run(textwrap.dedent(code), timeout)
    assert ok, out
    return out
