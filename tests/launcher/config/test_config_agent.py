"""The agent section: files that fail to import, unknown loops, tool keys without tools and vLLM are refused
before launch (UserError: exit code 2), with the file and the fix."""

import pytest

from launcher.config.load import load_config
from launcher.errors import UserError


def refused(*overrides):
    with pytest.raises(UserError) as e:
        load_config(None, list(overrides))
    return str(e.value)


def test_agent_files_and_keys_are_checked_before_launch(tmp_path):
    broken = tmp_path / "tools.py"
    broken.write_text("raise RuntimeError('no network here')\n")
    assert "agent.tools_file" in (msg := refused(f"agent.tools_file={broken}")) and "no network here" in msg
    assert "no file" in refused(f"agent.loop_file={tmp_path / 'missing.py'}")
    assert "agent.default='tool' is not a loop" in refused("agent.default=tool")
    assert "acts only with agent.tools_file" in refused("agent.max_turns=3")
    tools = tmp_path / "ok.py"
    tools.write_text("def add(a: int, b: int) -> int:\n    return a + b\nTOOLS = [add]\n")
    cfg = load_config(None, [f"agent.tools_file={tools}", "agent.default=tool", "agent.max_turns=3"])
    assert cfg.agent.max_turns == 3
    assert "agent.max_turns(0) must be >= 1" in refused(f"agent.tools_file={tools}", "agent.max_turns=0")
    assert "define SFT_TURNS" in refused(f"agent.tools_file={tools}", "agent.default=tool",
                                         "trainer.sft_warmup_steps=5")


def test_multi_turn_loops_run_on_both_engines_but_not_across_weight_swaps(tmp_path, monkeypatch):
    import launcher.config.validation as validation

    monkeypatch.setattr(validation, "_validate_vllm", lambda cfg: None)  # vLLM itself is not installed here
    tools = tmp_path / "ok.py"
    tools.write_text("def add(a: int, b: int) -> int:\n    return a + b\nTOOLS = [add]\n")
    # vLLM runs the loops through its step API (its prefix cache serves the earlier turns)
    assert load_config(None, ["rollout.engine=vllm", f"agent.tools_file={tools}"]).agent.tools_file == str(tools)
    assert "set rollout.batches_in_flight=1" in refused("rollout.batches_in_flight=2", "trainer.max_staleness=1",
                                                       f"agent.tools_file={tools}")
    # agent.keep_kv=false turns off the native engine's kept KV between turns: without multi-turn loops, or on
    # another engine, there is none to turn off
    assert "acts only on multi-turn loops" in refused("agent.keep_kv=false")
    assert "agent.keep_kv=false acts only with rollout.engine=native" in refused(
        "rollout.engine=vllm", "agent.keep_kv=false", f"agent.tools_file={tools}")
    assert load_config(None, ["agent.keep_kv=false", f"agent.tools_file={tools}"]).agent.keep_kv is False


def test_park_slots_are_refused_where_nothing_parks(tmp_path):
    tools = tmp_path / "ok.py"
    tools.write_text("def add(a: int, b: int) -> int:\n    return a + b\nTOOLS = [add]\n")
    assert "max_parked_seqs=8 acts only where the native engine keeps KV" in refused("rollout.max_parked_seqs=8")
    assert "acts only where" in refused(f"agent.tools_file={tools}", "agent.keep_kv=false", "rollout.max_parked_seqs=8")
    assert "must be >= 0" in refused(f"agent.tools_file={tools}", "rollout.max_parked_seqs=-1")
    assert load_config(None, [f"agent.tools_file={tools}", "rollout.max_parked_seqs=8"]).rollout.max_parked_seqs == 8
