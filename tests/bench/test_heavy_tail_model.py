"""bench.heavy_tail_model: the step model's ceiling for partial rollouts on the heavy-tailed workload."""

from __future__ import annotations

import pytest

from bench.heavy_tail_model import StepModel, main


def test_without_a_tail_partial_rollouts_gain_nothing_and_with_one_the_bound_buys_more():
    flat = StepModel(sigma=0.0)  # every response the same length: no tail to hide
    assert flat.partial(20, in_flight=32, staleness=1)[0] == pytest.approx(flat.sync(20), rel=1e-9)
    tail = StepModel()
    sync = tail.sync(60)
    assert sync == pytest.approx(5.70, rel=0.05)  # calibrated on the H200's synchronous run
    k1, paced1 = tail.partial(60, in_flight=64, staleness=1, seed=1)
    k2, paced2 = tail.partial(60, in_flight=64, staleness=2, seed=1)
    assert sync / k1 > 1.1 and k2 < k1 and paced2 < paced1  # a looser bound paces less
    with pytest.raises(ValueError, match="batches_in_flight"):
        tail.partial(1, in_flight=96, staleness=2)


def test_main_prints_the_ceiling(capsys):
    row = main(["--steps", "20"])
    assert row["ceiling_speedup"] == pytest.approx(row["sync_step_s"] / row["partial_step_s"], rel=1e-2)
    assert '"bench": "heavy_tail_model"' in capsys.readouterr().out


def test_decoding_beside_the_update_raises_the_ceiling_only_as_far_as_sharing_the_gpu_allows():
    tail = StepModel()
    sync = tail.sync(60)
    alone = tail.partial(60, in_flight=64, staleness=1, seed=1)[0]
    free = tail.partial(60, in_flight=64, staleness=1, seed=1, overlap=(1.0, 1.0))[0]  # asserts the bound itself
    shared = tail.partial(60, in_flight=64, staleness=1, seed=1, overlap=(2.0, 1.1))[0]
    costly = tail.partial(60, in_flight=64, staleness=1, seed=1, overlap=(3.0, 1.3))[0]
    assert free < shared < alone < costly  # a 30% slower update loses more than the tail decoded beside it
    assert sync / free > 1.5


def test_main_takes_the_overlap(capsys):
    row = main(["--steps", "20", "--overlap", "2:1.1"])
    assert row["overlap"] == (2.0, 1.1) and row["ceiling_speedup"] > 1.0


def test_pacing_on_the_due_groups_alone_loses_what_the_full_batch_decodes_meanwhile():
    """The due tail runs at the small batch's step time, but the paused groups' tokens must be decoded later: at the
    latency floor that costs more than it saves (why the trainer's pacing steps every running row)."""
    tail = StepModel()
    every = tail.partial(60, in_flight=64, staleness=1, seed=1)[0]
    due = tail.partial(60, in_flight=64, staleness=1, seed=1, due_only=True)[0]  # asserts the bound itself
    assert every < due < tail.sync(60)


def test_decode_rows_for_every_sample_change_nothing_and_fewer_rows_queue_the_groups():
    tail = StepModel()
    assert tail.sync(20, slots=32 * 8) == pytest.approx(tail.sync(20), rel=1e-9)
    assert tail.partial(20, in_flight=64, staleness=1, seed=1, slots=64 * 8) == tail.partial(
        20, in_flight=64, staleness=1, seed=1)
    assert tail.sync(20, slots=8) > 2 * tail.sync(20)  # one group at a time: its caps in series
    few = tail.partial(20, in_flight=64, staleness=1, seed=1, slots=64, overlap=(4.0, 1.12))  # asserts the bound
    assert few[0] > tail.partial(20, in_flight=64, staleness=1, seed=1, overlap=(4.0, 1.12))[0]


def test_the_grid_scales_training_with_the_mean_length_and_names_the_best(capsys):
    out = main(["--steps", "10", "--grid", "64,256:1"])
    short, default = out["rows"]
    assert default["train_s"] == pytest.approx(2.2) and short["mean_tokens"] < default["mean_tokens"]
    assert short["train_s"] == pytest.approx(2.2 * short["mean_tokens"] / default["mean_tokens"], rel=1e-3)
    assert out["best"] == max(out["rows"], key=lambda r: r["ceiling_speedup"])
    assert all(r["ceiling_speedup"] == pytest.approx(r["sync_step_s"] / r["partial_step_s"], rel=1e-2)
               for r in out["rows"])
