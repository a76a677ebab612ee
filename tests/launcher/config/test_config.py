import textwrap
from pathlib import Path

import pytest

from launcher.config.load import load_config
from launcher.config.schema import Config
from launcher.errors import UserError


def test_defaults_and_overrides():
    cfg = load_config("conf/ppo_tiny.yaml", ["actor.tp=2", "actor.optim.lr=3e-4", "data.train_files=[a.jsonl]"])
    assert isinstance(cfg, Config)
    assert cfg.actor.tp == 2 and cfg.actor.optim.lr == pytest.approx(3e-4)
    assert cfg.data.train_files == ["a.jsonl"]
    assert cfg.model.preset == "tiny"


def test_unknown_key_names_path_and_closest():
    with pytest.raises(UserError) as e:
        load_config("conf/ppo_tiny.yaml", ["actor.tpp=2"])
    msg = str(e.value)
    assert "actor.tpp" in msg and "'actor.tp'" in msg and "command line" in msg


def test_unknown_key_in_file_names_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("trainer:\n  total_stepz: 3\n")
    with pytest.raises(UserError) as e:
        load_config(p)
    assert str(p) in str(e.value) and "trainer.total_stepz" in str(e.value) and "total_steps" in str(e.value)


def test_wrong_type_names_key_and_type(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("actor:\n  tp: two\n")
    with pytest.raises(UserError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg and "actor.tp" in msg and "int" in msg


def test_extends_chain_and_cycle(tmp_path):
    (tmp_path / "base.yaml").write_text("trainer:\n  total_steps: 7\nactor:\n  tp: 2\n")
    (tmp_path / "mid.yaml").write_text("extends: base.yaml\nactor:\n  pp: 2\n")
    (tmp_path / "top.yaml").write_text("extends: [mid.yaml]\nactor:\n  tp: 1\n")
    cfg = load_config(tmp_path / "top.yaml")
    assert (cfg.trainer.total_steps, cfg.actor.tp, cfg.actor.pp) == (7, 1, 2)
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(UserError, match="cycle"):
        load_config(tmp_path / "a.yaml")


@pytest.mark.parametrize("override,needle", [
    ("placement.mode=splt", "did you mean 'split'"),
    ("rollout.decode_attention=trition", "did you mean 'triton'"),
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("algorithm.name=grpo", "rollout.n >= 2"),
    ("trainer.resume=/nonexistent/ckpt", "trainer.resume"),
    ("model.path=/nonexistent", "model.path"),
    ("actor", "key=value"),
    ("placement.pools=[{roles:[actor],size:1}]", "space after ':'"),
])
def test_value_errors(override, needle):
    with pytest.raises(UserError, match=None) as e:
        load_config("conf/ppo_tiny.yaml", [override])
    assert needle in str(e.value)


def test_decode_attention_choices_are_the_engines():
    from launcher.config.schema import CHOICES
    from rollout.base import DECODE_ATTENTION

    assert CHOICES["rollout.decode_attention"] == DECODE_ATTENTION


def test_all_shipped_configs_load():
    for name in ("ppo_tiny", "grpo_tiny", "ppo_7b", "ppo_7b_colocated"):
        cfg = load_config(f"conf/{name}.yaml")
        assert cfg.trainer.experiment_name == name


def test_bench_grpo_1b_trains_its_batch_in_one_micro_batch():
    """Workload (a)'s speed rests on one micro-batch per pass (bench/results/grpo_a_round13_h200.json): its
    full-length batch, each prompt packed once with its responses, fits the actor's budget, and the reference
    plans alike, so the two passes share one plan and one set of packs (PolicyWorker.plan / _pack)."""
    from ppo.batch.micro_batches import plan_micro_batches

    cfg = load_config("conf/bench_grpo_1b.yaml")
    assert cfg.trainer.share_prompts and cfg.actor.mini_batch_size == 0
    group = cfg.data.max_prompt_length + cfg.rollout.n * cfg.rollout.max_response_length
    lengths = [group] * cfg.data.batch_size
    for budget in (cfg.actor.max_tokens_per_micro_batch, cfg.ref.max_tokens_per_micro_batch):
        assert plan_micro_batches(lengths, dp=1, rank=0, max_tokens=budget) == [[list(range(len(lengths)))]]
    assert cfg.actor.max_tokens_per_micro_batch == cfg.ref.max_tokens_per_micro_batch


def test_missing_file():
    with pytest.raises(UserError, match="not found"):
        load_config("conf/nope.yaml")


def test_yaml_syntax_error(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text(textwrap.dedent("""\
        trainer:
          total_steps: [1, 2
        """))
    with pytest.raises(UserError, match="YAML"):
        load_config(p)


@pytest.mark.parametrize("override,needle", [
    # a reward model neither calls the rule function nor fails: the function's keys beside it are refused
    ("reward.model.tp=1 reward.function=builtin:math", "reward.function='builtin:math' configures the rule "
                                                       "function, and reward.model is set"),
    ("reward.model.tp=1 reward.timeout_s=5", "reward.timeout_s=5.0 configures the rule function"),
    ("reward.model.tp=1 reward.stop_failed_fraction=0.5", "reward.stop_failed_fraction=0.5 configures"),
    ("rollout.gpu_memory_fraction=1.5", "rollout.gpu_memory_fraction=1.5 must be in (0, 1]"),
])
def test_keys_that_would_be_ignored_are_rejected(override, needle):
    with pytest.raises(UserError) as e:
        load_config("conf/ppo_tiny.yaml", override.split())
    assert needle in str(e.value)


@pytest.mark.parametrize("override,needle", [
    # keys that no longer exist: the error says what to write instead, not only the closest name
    ("actor.offload=true", "unknown config key 'actor.offload': renamed actor.offload_optimizer_while_generating"),
    ("critic.offload=true", "unknown config key 'critic.offload': only the actor offloads"),
    ("ref.offload=true", "unknown config key 'ref.offload': the reference has no optimizer"),
    ("reward.offload=true", "unknown config key 'reward.offload'"),
    ("ref.activation_checkpointing=full", "unknown config key 'ref.activation_checkpointing': the reference runs "
                                          "forwards only"),
    ("reward.activation_checkpointing=full", "unknown config key 'reward.activation_checkpointing'"),
    ("rollout.engine=hf", "rollout.engine='hf' is not one of native, vllm"),
])
def test_keys_only_a_refusal_read_are_gone(override, needle):
    with pytest.raises(UserError) as e:
        load_config("conf/ppo_tiny.yaml", [override])
    assert needle in str(e.value)


def test_a_retired_key_in_a_yaml_file_names_the_file(tmp_path):
    p = tmp_path / "old.yaml"
    p.write_text("extends: " + str(Path("conf/ppo_tiny.yaml").resolve()) + "\nactor:\n  offload: true\n")
    with pytest.raises(UserError, match=f"{p}: unknown config key 'actor.offload': renamed"):
        load_config(p)


def test_the_engine_choices_are_the_engines_built():
    from launcher.config.schema import CHOICES
    from rollout.factory import ENGINES

    assert CHOICES["rollout.engine"] == ENGINES


@pytest.mark.parametrize("override,needle", [
    ("reward.tp=2", "reward.model.tp (a rule function has none)"),
    ("reward.compile=true", "reward.model.compile"),
    ("reward.model_path=/m", "moved to reward.model.path"),
    ("reward.type=model", "reward.model.path=DIR"),
])
def test_a_rule_reward_has_no_model_keys(override, needle):
    """The model keys live in the optional reward.model section; the old flat names say where they went."""
    with pytest.raises(UserError) as e:
        load_config("conf/ppo_tiny.yaml", [override])
    assert f"unknown config key '{override.split('=')[0]}'" in str(e.value) and needle in str(e.value)
    assert load_config("conf/ppo_tiny.yaml").reward.model is None


def test_each_reward_kind_takes_its_own_keys():
    cfg = load_config("conf/ppo_tiny.yaml", ["reward.model.tp=2", "reward.model.path=/m",
                                             "reward.model.max_tokens_per_micro_batch=100"])
    m = cfg.reward.model
    assert (m.tp, m.path, m.max_tokens_per_micro_batch) == (2, "/m", 100)
    assert load_config("conf/ppo_tiny.yaml", ["reward.model={}"]).reward.model.tp == 1  # a random-initialised one
    cfg = load_config("conf/ppo_tiny.yaml", ["reward.function=builtin:math", "reward.timeout_s=5",
                                             "reward.default_score=-1", "reward.stop_failed_fraction=0.5"])
    assert (cfg.reward.function, cfg.reward.timeout_s, cfg.reward.stop_failed_fraction) == ("builtin:math", 5, 0.5)


@pytest.mark.parametrize("override,needle", [
    ("trainer.dist_timeout_s=0", "trainer.dist_timeout_s(0) must be > 0"),
    ("actor.mini_batch_size=-3", "actor.mini_batch_size(-3) must be >= 0"),
    ("critic.mini_batch_size=-1", "critic.mini_batch_size(-1) must be >= 0"),
    ("reward.stop_failed_fraction=0", "reward.stop_failed_fraction(0.0) must be in (0, 1]"),
    ("reward.timeout_s=-1", "reward.timeout_s(-1.0) must be >= 0"),
    ("trainer.watchdog_timeout_s=-5", "trainer.watchdog_timeout_s(-5.0) must be >= 0"),
    ("trainer.on_damaged_checkpoint=skip", "trainer.on_damaged_checkpoint='skip' is not one of stop, fallback"),
    ("trainer.max_nonfinite_steps=0", "trainer.max_nonfinite_steps(0) must be >= 1"),
    ("actor.optim.lr=nan", "actor.optim.lr=nan is not a finite number"),
    ("algorithm.gamma=inf", "algorithm.gamma=inf is not a finite number"),
    ("actor.max_tokens_per_micro_batch=0", "actor.max_tokens_per_micro_batch(0) must be >= 1 tokens"),
    ("ref.max_tokens_per_micro_batch=-1", "ref.max_tokens_per_micro_batch(-1) must be >= 1 tokens"),
])
def test_reliability_keys_are_validated(override, needle):
    with pytest.raises(UserError) as e:
        load_config("conf/ppo_tiny.yaml", [override])
    assert needle in str(e.value)


@pytest.mark.parametrize("text,needle", [
    ("", "the config file is empty"),
    ("# only a comment\n", "the config file is empty"),
    ("- trainer\n- actor\n", "must be a mapping of sections"),
])
def test_empty_or_list_config_file(tmp_path, text, needle):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(UserError) as e:
        load_config(p)
    assert str(p) in str(e.value) and needle in str(e.value)


def test_user_error_is_printed_by_rank_0_while_peers_wait(monkeypatch, capsys):
    """torchrun ends every worker once one exits: a peer must not exit before rank 0 has printed, and speaks
    itself when rank 0 has not (an error of its own)."""
    from launcher import main as entry

    waits = []
    monkeypatch.setattr(entry.time, "sleep", waits.append)
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert entry.main(["conf/ppo_tiny.yaml", "actor.tpp=2"]) == 2
        err = capsys.readouterr().err
        assert "did you mean" in err and err.startswith("error:" if rank == 0 else "rank 1: error:")
    assert waits == [entry.PEER_EXIT_GRACE_S]  # only the peer waited (under torchrun it is ended meanwhile)


def test_float16_is_refused_before_launch():
    with pytest.raises(UserError, match="model.dtype=float16: fp16 training needs a loss scaler"):
        load_config(None, ["model.dtype=float16"])


def test_fp8_kv_cache_is_the_native_engines_and_sizes_the_cost_models_cache(monkeypatch):
    import rollout.vllm_support
    from launcher.planning.costmodel import ModelShape
    from models.config import preset_config

    cfg = load_config("conf/ppo_tiny.yaml", ["rollout.kv_cache_dtype=fp8"])
    assert cfg.rollout.kv_cache_dtype == "fp8"
    monkeypatch.setattr(rollout.vllm_support, "vllm_install_problem", lambda version: None)  # as if installed
    with pytest.raises(UserError, match="rollout.kv_cache_dtype=fp8 is the native engine's"):
        load_config("conf/ppo_tiny.yaml", ["rollout.kv_cache_dtype=fp8", "rollout.engine=vllm"])
    with pytest.raises(UserError, match="rollout.kv_cache_dtype='fp16' is not one of auto, fp8"):
        load_config("conf/ppo_tiny.yaml", ["rollout.kv_cache_dtype=fp16"])
    m = preset_config("qwen3-0.6b")
    full, fp8 = ModelShape.of(m).kv_bytes_per_token, ModelShape.of(m, fp8_kv=True).kv_bytes_per_token
    assert full == 114688 and fp8 == 2 * 28 * 8 * (128 + 4)  # the 114,688 B per token; fp8 + scales
