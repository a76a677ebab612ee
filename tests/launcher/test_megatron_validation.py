"""`<role>.backend: megatron` layouts and settings megatron-core cannot run are refused before launch (exit 2)."""

import pytest

from launcher.config.load import load_config
from launcher.errors import UserError
from launcher.planning.plan import compute_plan
from models.config import preset_config

pytest.importorskip("megatron.core")


def test_training_without_cuda_is_refused_with_the_reason():
    with pytest.raises(UserError, match=r"actor.backend=megatron: megatron-core training .* needs CUDA.*"
                                        r"trainer.device is cpu"):
        load_config("conf/ppo_tiny.yaml", ["actor.backend=megatron", "trainer.device=cpu"])
    # a frozen reference at pp=1 runs megatron-core's model on CPU (forward only)
    cfg = load_config("conf/ppo_tiny.yaml", ["ref.backend=megatron", "trainer.device=cpu"])
    assert cfg.ref.backend == "megatron"
    with pytest.raises(UserError, match="ref.backend=megatron: megatron-core pp > 1"):
        load_config("conf/ppo_tiny.yaml", ["ref.backend=megatron", "ref.pp=2", "trainer.device=cpu"])


@pytest.mark.parametrize("override, key", [
    ("actor.compile=true actor.activation_checkpointing=full", "actor.compile=true with activation_checkpointing=full"),
    ("critic.activation_checkpointing=selective", "critic.activation_checkpointing=selective"),
    ("ref.pp_stages_per_rank=2", "ref.pp_stages_per_rank=2"),
])
def test_unwired_settings_are_refused(override, key):
    role = key.split(".")[0]
    with pytest.raises(UserError, match=f"{role}.backend=megatron: {key} is not supported"):
        load_config("conf/ppo_tiny.yaml", [f"{role}.backend=megatron", "trainer.device=cuda", *override.split()])


def test_a_forward_only_role_has_no_activation_checkpointing():
    with pytest.raises(UserError, match="unknown config key 'ref.activation_checkpointing'"):
        load_config("conf/ppo_tiny.yaml", ["ref.activation_checkpointing=full"])


def test_unknown_backend_names_the_choices():
    with pytest.raises(UserError, match="critic.backend='megatorn' is not one of native, megatron"):
        load_config("conf/ppo_tiny.yaml", ["critic.backend=megatorn"])


@pytest.mark.parametrize("model, msg", [
    (dict(vocab_size=511), r"ref.* tp\(2\) must divide vocab_size\(511\)"),  # (the native check, shared, says it first)
    (dict(num_key_value_heads=1, num_attention_heads=4), r"ref.tp\(2\) must divide num_key_value_heads\(1\)"),
])
def test_layouts_megatron_cannot_shard_are_refused(model, msg):
    cfg = load_config("conf/ppo_tiny.yaml", ["ref.backend=megatron", "trainer.device=cpu", "ref.tp=2"])
    with pytest.raises(UserError, match=msg):
        compute_plan(cfg, world_size=2, model=preset_config("tiny", **model))


def test_uneven_pipeline_split_is_refused():
    from launcher.planning.plan import _validate_megatron_layout

    with pytest.raises(UserError, match=r"ref.backend=megatron: ref.pp\(3\) must divide num_hidden_layers\(4\)"):
        _validate_megatron_layout("ref", tp=1, pp=3, shape=preset_config("tiny"))


def test_qwen3_on_megatron_is_planned_and_its_layout_still_checked():
    """Qwen3's per-head q/k norms map to megatron-core's q/k layernorms (tests/parallel/test_megatron_qwen3.py),
    so a Qwen3 role on megatron is planned; a tp its 2 KV heads cannot split is still refused."""
    cfg = load_config("conf/ppo_tiny.yaml", ["ref.backend=megatron", "trainer.device=cpu", "ref.tp=2"])
    plan = compute_plan(cfg, world_size=2, model=preset_config("tiny-qwen3"))
    assert plan.groups["ref"].tp == 2
    from launcher.planning.plan import _validate_megatron_layout

    with pytest.raises(UserError, match=r"ref.backend=megatron: ref.tp\(4\) must divide num_key_value_heads\(2\)"):
        _validate_megatron_layout("ref", tp=4, pp=1, shape=preset_config("tiny-qwen3"))
