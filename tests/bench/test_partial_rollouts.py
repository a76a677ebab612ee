"""bench/partial_rollouts.py on CPU (the mechanics, not the speed): both modes deliver the same number of samples,
the partial mode keeps the staleness bound it is given, and the length caps are heavy-tailed and clipped."""

from __future__ import annotations

from bench.partial_rollouts import length_caps, main


def test_length_caps_are_log_normal_and_clipped():
    caps = length_caps(2000, median=64, sigma=1.0, max_tokens=512, seed=0)
    assert min(caps) >= 16 and max(caps) == 512  # the tail reaches the cap
    assert 50 <= sorted(caps)[1000] <= 80  # the median


def test_the_benchmark_runs_both_modes_within_the_bound():
    row = main(["--model", "tiny", "--device", "cpu", "--prompts", "4", "--n", "2", "--prompt-len", "8",
                "--max-tokens", "40", "--median-tokens", "10", "--steps", "3", "--warmup", "1"])
    assert row["sync"]["samples"] == row["partial"]["samples"] == 3 * 4 * 2
    assert row["partial"]["staleness_max"] <= 1 and row["partial"]["recomputed_tokens"] > 0
    assert row["speedup"] > 0
