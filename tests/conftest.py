import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _slow_seconds(item) -> float:
    """A `slow` test's expected seconds on a 2-core CI machine (`@pytest.mark.slow(seconds=...)`, else 30); 0 for
    the others."""
    mark = item.get_closest_marker("slow")
    return 0.0 if mark is None else float(mark.kwargs.get("seconds", 30))


def pytest_collection_modifyitems(config, items):
    import torch

    # slow tests first, the longest first: pytest-xdist's worksteal hands each worker a contiguous share of the
    # collection and steals from its back, so a long test collected late runs alone at the end of `make test`
    items.sort(key=lambda item: -_slow_seconds(item))

    if "chaos" not in (config.getoption("markexpr") or ""):  # minutes: only when asked for (make test-chaos)
        skip_chaos = pytest.mark.skip(reason="the chaos run: make test-chaos (pytest -m chaos)")
        for item in items:
            if "chaos" in item.keywords:
                item.add_marker(skip_chaos)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (make test-gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
