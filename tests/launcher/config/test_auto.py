"""launcher/config/auto.py: unset speed settings resolved from the device and the roles, each with its reason;
an explicit setting always wins."""

from __future__ import annotations

from pathlib import Path

from launcher.config.auto import resolve_auto
from launcher.config.load import load_config

TINY = str(Path(__file__).resolve().parents[3] / "conf" / "ppo_tiny.yaml")


def _load(*overrides: str):
    choices: list[str] = []
    return load_config(TINY, list(overrides), auto_choices=choices), choices


def test_cpu_picks_cpu_safe_choices():
    cfg, choices = _load("trainer.device=cpu")
    assert (cfg.actor.compile, cfg.critic.compile, cfg.ref.compile, cfg.rollout.compile) == (False,) * 4
    assert "actor.compile=false (auto: no CUDA device" in choices[0]
    assert cfg.reward.model is None and not any(c.startswith("reward.") for c in choices)  # a rule reward: no model


def test_cuda_compiles_training_and_decode_and_says_why():
    cfg, choices = _load("trainer.device=cuda")
    assert (cfg.actor.compile, cfg.critic.compile, cfg.ref.compile, cfg.rollout.compile) == (True,) * 4
    compiled = [c for c in choices if ".compile=" in c]
    assert {c.split("=")[0] for c in compiled} == {"actor.compile", "critic.compile", "ref.compile", "rollout.compile"}
    assert all("(auto: CUDA" in c for c in compiled)


def test_engine_sized_for_the_step_and_residency_left_to_the_first_step_on_cuda():
    cfg, choices = _load("trainer.device=cuda", "data.batch_size=24", "rollout.n=5")
    assert cfg.rollout.max_num_seqs == 120 and cfg.rollout.gpu_memory_fraction == 0.9
    assert cfg.rollout.free_memory_on_sleep is None  # settled by ppo.roles.generation.settle_residency
    assert any(c.startswith("rollout.max_num_seqs=120 (auto: the step's rows") for c in choices)
    assert any(c.startswith("rollout.free_memory_on_sleep=auto (decided after the first step") for c in choices)
    # an explicit resident engine leaves training half the memory; explicit sizes win
    cfg, choices = _load("trainer.device=cuda", "rollout.free_memory_on_sleep=false", "rollout.max_num_seqs=32")
    assert cfg.rollout.gpu_memory_fraction == 0.5 and cfg.rollout.max_num_seqs == 32
    assert not any(c.startswith(("rollout.max_num_seqs", "rollout.free_memory")) for c in choices)


def test_cpu_and_vllm_free_the_engine_on_sleep():
    cfg, choices = _load("trainer.device=cpu")
    assert cfg.rollout.free_memory_on_sleep is True and cfg.rollout.gpu_memory_fraction == 0.9
    assert "rollout.free_memory_on_sleep=true (auto: no CUDA device)" in choices
    cfg, _ = _load("trainer.device=cuda", "rollout.free_memory_on_sleep=null")
    cfg.rollout.engine, cfg.rollout.free_memory_on_sleep = "vllm", None  # validation would want vLLM installed
    assert "rollout.free_memory_on_sleep=true (auto: rollout.engine=vllm sleeps with its own levels)" in \
        resolve_auto(cfg)


def test_an_explicit_setting_wins():
    cfg, choices = _load("trainer.device=cuda", "actor.compile=false", "rollout.compile=false")
    assert cfg.actor.compile is False and cfg.rollout.compile is False and cfg.ref.compile is True
    assert not any(c.startswith(("actor.", "rollout.compile")) for c in choices)
    cfg, choices = _load("trainer.device=cpu", "ref.compile=true")
    assert cfg.ref.compile is True and not any(c.startswith("ref.compile") for c in choices)



def test_shared_prompts_on_for_groups_of_responses_where_packing_allows_it():
    cfg, choices = _load("rollout.n=4")
    assert cfg.trainer.share_prompts is True
    assert any(c.startswith("trainer.share_prompts=true (auto: rollout.n=4") for c in choices)
    cfg, choices = _load()  # ppo_tiny: n = 1, nothing to share and nothing said
    assert cfg.trainer.share_prompts is False and not any(c.startswith("trainer.") for c in choices)
    cfg, choices = _load("rollout.n=4", "actor.pp=2", "model.preset=tiny")
    assert cfg.trainer.share_prompts is False
    assert any(c.startswith("trainer.share_prompts=false (auto: pipeline") for c in choices)
    cfg, _ = _load("rollout.n=4", "trainer.share_prompts=false")
    assert cfg.trainer.share_prompts is False


def test_park_slots_for_multi_turn_trajectories_beyond_the_decode_slots(tmp_path):
    # kept KV between agent turns: the trajectories beyond rollout.max_num_seqs get park slots (their KV waits there
    # while their tools run instead of being evicted for queued ones); none without sessions or when all decode at once
    tools = tmp_path / "tools.py"
    tools.write_text("def add(a: int, b: int) -> int:\n    return a + b\nTOOLS = [add]\n")
    agent = (f"agent.tools_file={tools}", "data.batch_size=24", "rollout.n=5")
    cfg, choices = _load(*agent, "rollout.max_num_seqs=32")
    assert cfg.rollout.max_parked_seqs == 88
    assert any(c.startswith("rollout.max_parked_seqs=88 (auto: 120 rows in flight") for c in choices)
    for overrides in ((*agent,), (*agent, "rollout.max_num_seqs=32", "agent.keep_kv=false"),
                      ("data.batch_size=24", "rollout.n=5", "rollout.max_num_seqs=32")):
        cfg, choices = _load(*overrides)
        assert cfg.rollout.max_parked_seqs == 0 and not any("max_parked_seqs" in c for c in choices), overrides
    assert _load(*agent, "rollout.max_num_seqs=32", "rollout.max_parked_seqs=8")[0].rollout.max_parked_seqs == 8
