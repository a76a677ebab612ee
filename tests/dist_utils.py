"""Run a function in a real multi-process gloo world from a test.

    from tests.dist_utils import run_world
    results = run_world(_body, world_size=4, args=(x,))   # _body(rank, world_size, *args)

`_body` must be a module-level function (it is pickled to the ranks). Each process gets
MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK set and a gloo process group already
initialised; its return value comes back in rank order. A hang fails after `timeout`
seconds instead of blocking CI; an exception in any rank fails the test with that
rank's traceback.

gloo ranks are forked from a fork server that imported torch once (multiprocessing's "forkserver", started by
the first world and living as long as the test process): a spawned rank spends ~3.5 s of CPU importing torch
and torch._dynamo (which meta-device model builds import), 28 s for a world of 8 on a 2-core CI machine, and
~2.5 s more importing megatron.core (preloaded where installed: an ImportError is skipped). Each
rank takes the caller's current environment as a spawned one would, and writes its stdout/stderr to a file that
run_world copies to the caller's stderr (the server's own streams are those of the first test that started it).
NCCL worlds are spawned (a fresh interpreter per GPU rank).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import traceback

import torch
import torch.multiprocessing as mp


def repo_pythonpath() -> str:
    """PYTHONPATH for a child process: the repo first, then what the caller had (the GPU machine's carried
    wheels live on PYTHONPATH)."""
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what the fork server imports once for every rank it forks
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "pytest", "megatron.core"]


def _context(backend: str):
    # on a GPU machine every world is spawned: a fork server that imported megatron.core has touched CUDA there,
    # and a rank forked from it could not use the GPU ("Cannot re-initialize CUDA in forked subprocess")
    if backend == "nccl" or torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _entry(rank, world_size, port, fn, args, queue, backend="gloo", env=None, log=None):
    if env is not None:  # forked from the server: the caller's environment now, not the server's at its start
        os.environ.clear()
        os.environ.update(env)
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=120))
        out = fn(rank, world_size, *args)
        # plain pickle copies tensors by value: torch's shared-memory handles die with this process
        queue.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn, world_size: int, args: tuple = (), *, timeout: float = 240.0, backend: str = "gloo") -> list:
    """backend "nccl": one GPU per rank (cuda:rank set before the group starts). A world whose store could not
    bind its port (taken between free_port() and the bind, e.g. by a process of another test worker) has run
    nothing yet: it is started again on a fresh port, twice at most."""
    for _ in range(2):
        try:
            return _run_world_once(fn, world_size, args, timeout=timeout, backend=backend)
        except AssertionError as e:
            if "EADDRINUSE" not in str(e):
                raise
    return _run_world_once(fn, world_size, args, timeout=timeout, backend=backend)


def _run_world_once(fn, world_size: int, args: tuple, *, timeout: float, backend: str) -> list:
    ctx = _context(backend)
    forked = ctx.get_start_method() == "forkserver"
    queue = ctx.Queue()
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="run_world_", suffix=".log", delete=False) if forked else None
    extra = (dict(os.environ), log.name) if forked else ()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, backend, *extra), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    import queue as _q
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"gloo world of {world_size} did not finish within {timeout}s "
                                   f"(finished: {sorted(results)})")
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except _q.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and not errors:
                    raise RuntimeError(f"a rank died with exit code {dead[0].exitcode} before reporting") from None
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break  # the other ranks are likely stuck in a collective now
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
        if log is not None:  # the ranks' output, where a spawned rank's would have gone
            with open(log.name, errors="replace") as f:
                sys.stderr.write(f.read())
            log.close()
            os.unlink(log.name)
    if errors:
        raise AssertionError("a rank failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
