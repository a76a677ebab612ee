"""bench/agent_turns.py on CPU (the mechanics, not the speed): both modes generate every turn's tokens, kept KV
prefills only each later turn's new tokens (the previous turn's last token and the observation), re-prefill the
whole context."""

from __future__ import annotations

import threading

from bench.agent_turns import main


def test_the_benchmark_measures_kept_kv_against_re_prefill():
    row = main(["--model", "tiny", "--device", "cpu", "--trajectories", "4", "--turn-tokens", "4", "--turns", "3",
                "--tool-delay-ms", "5", "--prompt-len", "8", "--obs-tokens", "3", "--tool-workers", "4"])
    assert row["keep_prefill_tokens_per_later_turn"] == 1 + 3
    assert row["reprefill_prefill_tokens_per_later_turn"] > 8 + 4 + 3
    assert row["keep_kv_reused_tokens"] > 0 and row["reprefill_kv_reused_tokens"] == 0
    assert row["keep_kv_evictions"] == row["keep_kv_misses"] == 0
    assert row["keep_tokens_per_s"] > 0 and row["reprefill_tokens_per_s"] > 0
    # the host-time breakdown: every engine step ran a prefill or a decode step (or a prefill behind one)
    assert row["keep_decode_steps"] <= row["keep_engine_steps"] <= row["keep_prefill_steps"] + row["keep_decode_steps"]
    assert row["single_turn_prefill_steps"] >= 1 and row["keep_driver_host_ms_per_step"] >= 0
    assert row["continuation_wait_steps"] == 16  # the engine's default, reported
    # the prefill forwards by kind: re-prefill runs every turn from position 0, kept KV its later turns as continuations
    assert row["reprefill_prefill_continue_rows"] == 0 and row["reprefill_prefill_fresh_rows"] >= 1
    assert row["keep_prefill_continue_rows"] >= 1 and row["keep_prefill_continue_s"] > 0
    assert row["keep_prefill_fresh_s"] + row["keep_prefill_continue_s"] <= row["keep_prefill_s"]
    # the tokens each kind ran (together the prefill's), and the positions computed with the rows' padding
    for mode in ("keep", "reprefill"):
        assert row[f"{mode}_prefill_fresh_tokens"] + row[f"{mode}_prefill_continue_tokens"] == \
            row[f"{mode}_prefill_tokens"]
        for kind in ("fresh", "continue"):
            assert row[f"{mode}_prefill_{kind}_padded"] >= row[f"{mode}_prefill_{kind}_tokens"]
    assert row["keep_prefill_continue_tokens"] == 4 * 2 * (1 + 3)  # each later turn: its last token, the observation
    # the steps that ran continuations; on a CPU none replays a CUDA graph
    assert 1 <= row["keep_prefill_continue_waves"] <= row["keep_prefill_continue_rows"]
    assert row["keep_continuation_waves_graphed"] == row["keep_continuation_graphs_captured"] == 0


def test_the_profile_names_where_the_device_time_goes():
    row = main(["--model", "tiny", "--device", "cpu", "--trajectories", "2", "--turn-tokens", "2", "--turns", "2",
                "--tool-delay-ms", "1", "--prompt-len", "4", "--obs-tokens", "2", "--tool-workers", "2",
                "--modes", "keep", "--profile"])
    for part in ("profile_single", "profile_keep"):
        prof = row[part]
        assert prof["wall_s"] > 0 and 0 < sum(k["ms"] for k in prof["top"]) <= prof["total_kernel_ms"] + 1e-6
        assert any(k["name"] == "aten::mm" for k in prof["top"])  # on a CPU: operators' self time


def test_the_continuation_wait_reaches_the_engine():
    row = main(["--model", "tiny", "--device", "cpu", "--trajectories", "2", "--turn-tokens", "2", "--turns", "2",
                "--tool-delay-ms", "1", "--prompt-len", "4", "--obs-tokens", "2", "--tool-workers", "2",
                "--modes", "keep", "--continuation-wait-steps", "2"])
    assert row["continuation_wait_steps"] == 2 and row["keep_prefill_tokens_per_later_turn"] == 1 + 2


def test_on_the_step_clock_returning_turns_queue_behind_earlier_trajectories():
    """Tools that return after K engine steps (StepClock) make the schedule independent of this machine's speed.
    Twelve trajectories through four decode slots: kept KV decodes in as few steps as re-prefill (its returning turns
    queue in arrival order behind the trajectories waiting to start, as re-prefilled turns do; ahead of them the last
    trajectories would start late and decode their turns with the rows half empty) and prefills far fewer tokens."""
    row = main(["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--trajectories", "12", "--max-num-seqs",
                "4", "--tool-workers", "12", "--turns", "3", "--turn-tokens", "8", "--prompt-len", "8", "--obs-tokens",
                "2", "--tool-delay-steps", "6"])
    assert row["tool_delay_steps"] == 6 and row["keep_over_single"] is None and row["keep_kv_evictions"] == 0
    assert row["keep_decode_steps"] <= row["reprefill_decode_steps"] + 2
    assert row["keep_prefill_tokens"] < row["reprefill_prefill_tokens"]
    assert row["keep_rows_per_decode_step"] >= row["reprefill_rows_per_decode_step"] * 0.95
    assert not [t for t in threading.enumerate() if t.name == "step-clock"]  # the clock's watcher stopped
