"""tests/dist_utils.run_world: a world whose port was taken before its store could bind it starts again."""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.dist_utils import run_world


def _taken_once(rank, world_size, flag):
    if not os.path.exists(flag):  # the first attempt: as if another process had bound the port meanwhile
        open(flag, "w").close()
        raise RuntimeError("The server socket has failed to listen on any local network address. EADDRINUSE")
    return rank


def _always_fails(rank, world_size):
    raise ValueError("a real failure")


@pytest.mark.distributed
def test_a_world_whose_port_was_taken_starts_again_and_other_failures_do_not():
    with tempfile.TemporaryDirectory() as d:
        assert run_world(_taken_once, 2, (os.path.join(d, "flag"),)) == [0, 1]
    with pytest.raises(AssertionError, match="a real failure"):
        run_world(_always_fails, 1)
