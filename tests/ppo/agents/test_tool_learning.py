"""Learning with a tool, asserted: conf/agent_tool_tiny.yaml at its defaults (data.task lookup:3: a key's value in a
hashed table, which conf/tools/table.py's `get` reads). The warm-up's teacher calls the tool on about 1 key in 6
and declines the others with "?", so the warmed-up tiny char-level policy calls, and scores, on few prompts (the
first step's mean reward is below 0.2); GRPO makes it call on nearly all of them (the last steps' mean is above
0.6). The no-tool control, the same config with agent.default=single_turn (its warm-up trains on the bare answers,
GRPO on plain generations), stays below 0.2: a value cannot be computed from its key.

One process, as tests/ppo/test_learning.py. The learning test runs in `make test` (CI), the slowest test of the
suite: the warm-up that teaches the copies (1500 steps) takes minutes on one CPU core (idle machine: 143 s; 250 s
beside the other xdist worker). The control (44 s idle, 89 s in the suite) is `extended` (`make test-extended`),
for the CI budget. Measured curves: docs/agents.md, "The CPU demo".
"""

from __future__ import annotations

import statistics

import pytest

from launcher.config.load import load_config
from tests.ppo.test_trainer import ROOT, _ok, launch, metrics

CONFIG = "conf/agent_tool_tiny.yaml"
WINDOW = 5  # the last steps averaged
LOW, HIGH = 0.2, 0.6  # the warmed-up policy scores below LOW, GRPO's last window above HIGH; the control below LOW


def _as_configured() -> list[str]:
    """The config's own values of the keys tests/ppo/test_trainer.py's launch shrinks, and its tools file: the demo
    as it runs."""
    cfg = load_config(str(ROOT / CONFIG), [])
    return [f"data.batch_size={cfg.data.batch_size}", f"data.task_size={cfg.data.task_size}",
            f"rollout.max_response_length={cfg.rollout.max_response_length}",
            f"trainer.sft_warmup_steps={cfg.trainer.sft_warmup_steps}",
            f"actor.mini_batch_size={cfg.actor.mini_batch_size}", f"actor.ppo_epochs={cfg.actor.ppo_epochs}",
            f"agent.tools_file={ROOT / cfg.agent.tools_file}"]  # launch runs in tmp_path


def _rewards(tmp_path, *overrides: str) -> list[float]:
    res = launch(tmp_path, 1, CONFIG, "trainer.save_every=0", "trainer.save_final=false", *_as_configured(),
                 *overrides, timeout=1800)
    _ok(res)
    return [r["reward/mean"] for r in metrics(tmp_path / "agent_tool_tiny")]


@pytest.mark.distributed
@pytest.mark.slow(seconds=200)
def test_grpo_with_the_lookup_tool_learns(tmp_path):
    rewards = _rewards(tmp_path)
    last = statistics.mean(rewards[-WINDOW:])
    assert rewards[0] < LOW < HIGH < last, f"reward {rewards[0]:.3f} -> {last:.3f}: not from < {LOW} to > {HIGH}"


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.slow(seconds=70)
def test_without_the_tool_the_reward_stays_low(tmp_path):
    rewards = _rewards(tmp_path, "agent.default=single_turn")
    assert max(rewards) < LOW, f"a step's reward reached {max(rewards):.3f} without the tool"
