"""ppo.metrics.host_gc: the collector's pauses as the trainer reports them, and the freeze of the survivors."""

from __future__ import annotations

import gc

from ppo.metrics.host_gc import GcPauses, freeze_survivors


def _cycle() -> None:
    a: list = []
    a.append(a)  # garbage only the cyclic collector frees


def test_pauses_count_full_collections_and_reset_on_take():
    pauses = GcPauses()
    try:
        pauses.take()
        _cycle()
        gc.collect(0)
        gc.collect()
        first = pauses.take()
        assert first["gc_full"] >= 1 and first["gc_s"] > 0
        assert pauses.take() == {"gc_s": 0.0, "gc_full": 0}
    finally:
        pauses.close()
    assert pauses._hook not in gc.callbacks
    gc.collect()
    assert pauses.take()["gc_full"] == 0  # closed: no longer counting


def test_freeze_moves_the_survivors_out_of_every_collection():
    before = [object() for _ in range(3)]  # untracked: only containers are tracked
    kept = [before]
    try:
        frozen, seconds = freeze_survivors()
        assert frozen == gc.get_freeze_count() > 0 and seconds >= 0
        tracked = {id(o) for o in gc.get_objects()}
        assert id(kept) not in tracked  # frozen: no collection scans it
        later = [kept]
        assert id(later) in {id(o) for o in gc.get_objects()}
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0 and id(kept) in {id(o) for o in gc.get_objects()}
