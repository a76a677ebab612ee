"""bench.decode_sass: the decode kernel compiled for sm_90 here (no GPU) and its per-tile loop read from the SASS."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


def test_fp8_tiles_convert_to_fp16_once_per_two_values_and_bf16_tiles_need_no_conversion():
    from bench.decode_sass import main

    bf16 = main([])
    fp8 = main(["--fp8"])
    assert bf16["registers"] <= 96 and fp8["registers"] <= 128  # the caps at 256+ rows
    for row in (bf16, fp8):
        assert row["arch"] == "sm_90" and row["stack_bytes"] <= 64
        loop = row["loops"][0]
        assert loop["HMMA"] == 32  # two [16 x 128] x [128 x 64] dots per 64-position tile on tensor cores
    # fp8: e4m3x2 -> f16x2 (F2FP) for 64 x 128 bytes of K and of V over 128 threads, and no further F2F
    # (e4m3 -> bf16 would take f16 -> bf16 per value: 128 more per tile)
    assert fp8["loops"][0]["F2FP"] >= 64 and "F2F" not in fp8["loops"][0]
    assert "F2F" not in bf16["loops"][0] and bf16["loops"][0]["LDSM"] > 0  # bf16 tiles: ldmatrix, as loaded
    # fp8 tiles converted in registers from 32-bit words (16 LDS per tile where the pipeline stages the words),
    # then through shared memory as fp16 (ldmatrix): not read back byte by byte and repacked (Triton's cast of the
    # tile: 97 LDS, 64 PRMT, 656 instructions)
    assert fp8["loops"][0]["LDSM"] > 0 and fp8["loops"][0].get("LDS", 0) <= 24 and "PRMT" not in fp8["loops"][0]
    assert fp8["loops"][0]["instructions"] < 1.5 * bf16["loops"][0]["instructions"]
