"""launcher/config/auto.py: unset speed settings resolved from the device and the roles, each with its reason;
an explicit setting always wins."""

from __future__ import annotations

from pathlib import Path

from launcher.config.load import load_config

TINY = str(Path(__file__).resolve().parents[3] / "conf" / "ppo_tiny.yaml")


def _load(*overrides: str):
    choices: list[str] = []
    return load_config(TINY, list(overrides), auto_choices=choices), choices


def test_cpu_picks_cpu_safe_choices():
    cfg, choices = _load("trainer.device=cpu")
    assert (cfg.actor.compile, cfg.critic.compile, cfg.ref.compile, cfg.rollout.compile) == (False,) * 4
    assert "actor.compile=false (auto: no CUDA device" in choices[0]
    assert cfg.reward.compile is False and not any(c.startswith("reward.") for c in choices)  # a rule reward


def test_cuda_compiles_training_and_decode_and_says_why():
    cfg, choices = _load("trainer.device=cuda")
    assert (cfg.actor.compile, cfg.critic.compile, cfg.ref.compile, cfg.rollout.compile) == (True,) * 4
    assert {c.split("=")[0] for c in choices} == {"actor.compile", "critic.compile", "ref.compile", "rollout.compile"}
    assert all("(auto: CUDA" in c for c in choices)


def test_an_explicit_setting_wins():
    cfg, choices = _load("trainer.device=cuda", "actor.compile=false", "rollout.compile=false")
    assert cfg.actor.compile is False and cfg.rollout.compile is False and cfg.ref.compile is True
    assert not any(c.startswith(("actor.", "rollout.")) for c in choices)
    cfg, choices = _load("trainer.device=cpu", "ref.compile=true")
    assert cfg.ref.compile is True and not any(c.startswith("ref.") for c in choices)

