"""bench/beside_contention.py on CPU (the mechanics, not the timing): every load runs beside the decoding thread,
the rows decode beside each, and each load's rate alone and beside is reported."""

from __future__ import annotations

from bench.beside_contention import main


def test_every_load_runs_beside_the_decoding_and_both_sides_are_measured():
    row = main(["--model", "tiny", "--device", "cpu", "--rows", "8", "--prompt-len", "8", "--max-tokens", "600",
                "--seconds", "0.2", "--loads", "none,python,gemm,gemm_sync,train", "--train-tokens", "32",
                "--gemm-size", "64", "--priorities", "0", "--switch-intervals", "0.0005",
                "--partitions", "none,carveout:8"])
    assert [(c["load"], c["switch_interval_s"], c["partition"]) for c in row["cases"]] == [
        (load, s, p) for s in (0.0005,) for p in ("none", "carveout:8")
        for load in ("none", "python", "gemm", "gemm_sync", "train")]
    for case in row["cases"]:
        assert case["decode_steps"] > 0 and case["rows_per_step"] > 0 and not case["finished_early"]
        assert case["load"] == "none" or case["load_rate"] > 0 and case["load_rate_alone"] > 0
