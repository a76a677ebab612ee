"""Learning with a tool, asserted: conf/agent_tool_tiny.yaml (data.task lookup:3, a key's value in a hashed table,
conf/tools/table.py's `get` reads it). After the config's short supervised warm-up on the tool loop's
demonstrations the tiny char-level policy answers few keys right (mean reward below 0.2: the value it copies from
the tool's response is often a digit off); GRPO then raises the reward above 0.6. The no-tool control, the same
config with agent.default=single_turn (warm-up on the bare answers, plain generation), stays below 0.2: a value
cannot be computed from its key.

One process, as tests/ppo/test_learning.py. The full curve is `extended` (minutes on 2 CPU cores); `make test`
runs the start of the rise and the control. Measured curves: docs/agents.md, "The CPU demo".
"""

from __future__ import annotations

import statistics

import pytest

from launcher.config.load import load_config

from tests.ppo.test_trainer import ROOT, _ok, launch, metrics

CONFIG = "conf/agent_tool_tiny.yaml"
WINDOW = 5  # steps averaged at each end of a curve
LOW, HIGH = 0.2, 0.6  # the warm-up's reward is below LOW, GRPO's ends above HIGH; the control stays below LOW
RISE_STEPS, RISE = 20, 0.1  # make test: the first RISE_STEPS steps' last window is RISE above their first


def _as_configured() -> list[str]:
    """The config's own values of the keys tests/ppo/test_trainer.py's launch shrinks: the demo as it runs."""
    cfg = load_config(str(ROOT / CONFIG), [])
    return [f"data.batch_size={cfg.data.batch_size}", f"data.task_size={cfg.data.task_size}",
            f"rollout.max_response_length={cfg.rollout.max_response_length}",
            f"trainer.sft_warmup_steps={cfg.trainer.sft_warmup_steps}",
            f"actor.mini_batch_size={cfg.actor.mini_batch_size}", f"actor.ppo_epochs={cfg.actor.ppo_epochs}"]


def _rewards(tmp_path, *overrides: str) -> list[float]:
    res = launch(tmp_path, 1, CONFIG, "trainer.save_every=0", "trainer.save_final=false", *_as_configured(),
                 *overrides, timeout=1800)
    _ok(res)
    return [r["reward/mean"] for r in metrics(tmp_path / "agent_tool_tiny")]


def _ends(rewards: list[float]) -> tuple[float, float]:
    """Mean reward of the first and of the last WINDOW steps."""
    assert len(rewards) >= 2 * WINDOW, f"{len(rewards)} steps: too few for two windows of {WINDOW}"
    return statistics.mean(rewards[:WINDOW]), statistics.mean(rewards[-WINDOW:])


@pytest.mark.distributed
@pytest.mark.extended
def test_grpo_with_the_lookup_tool_learns(tmp_path):
    """The whole demo at the config's defaults: from below LOW to above HIGH."""
    first, last = _ends(_rewards(tmp_path))
    assert first < LOW < HIGH < last, f"reward {first:.3f} -> {last:.3f}: not from below {LOW} to above {HIGH}"


@pytest.mark.distributed
@pytest.mark.slow
def test_grpo_with_the_lookup_tool_starts_to_rise(tmp_path):
    """make test's share of the demo: its first RISE_STEPS steps start below LOW and rise by RISE."""
    first, last = _ends(_rewards(tmp_path, f"trainer.total_steps={RISE_STEPS}"))
    assert first < LOW and last - first >= RISE, f"reward {first:.3f} -> {last:.3f} in {RISE_STEPS} steps"


@pytest.mark.distributed
@pytest.mark.slow
def test_without_the_tool_the_reward_stays_low(tmp_path):
    """The control: the same config, the tool loop off (agent.default=single_turn: the warm-up trains on the bare
    answers, GRPO on plain generations); a key's value cannot be computed, so no window reaches LOW."""
    first, last = _ends(_rewards(tmp_path, "agent.default=single_turn", f"trainer.total_steps={RISE_STEPS}"))
    assert first < LOW and last < LOW, f"reward {first:.3f} -> {last:.3f} without the tool"
