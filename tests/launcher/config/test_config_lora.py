"""`actor.lora.*`: the keys act only with a rank > 0; a LoRA actor runs on the native backend, draws dropout masks
only at tp = 1, keeps its reference (its own base) in its layout and on its ranks, and continues only from an
adapter of its own shape. Each refusal exits 2 before launch with the fix in its message."""

import pytest

from launcher.config.load import load_config
from launcher.errors import UserError
from models.lora import LoRASpec, save_peft_adapter


def test_lora_keys_load():
    cfg = load_config("conf/grpo_tiny.yaml", ["actor.lora.rank=16", "actor.lora.alpha=32",
                                              "actor.lora.target_modules=[q_proj,v_proj]"])
    lo = cfg.actor.lora
    assert (lo.rank, lo.alpha, list(lo.target_modules)) == (16, 32, ["q_proj", "v_proj"])


@pytest.mark.parametrize("overrides,needle", [
    (["actor.lora.alpha=8"], "acts only with LoRA on; set actor.lora.rank>0"),
    (["actor.lora.rank=-1"], "must be >= 0"),
    (["actor.lora.rank=8", "actor.lora.target_modules=[embed_tokens]"], "are not linear layers of this model"),
    (["actor.lora.rank=8", "actor.lora.target_modules=[all-linear,lm_head]", "actor.lora.dropout=0.1"],
     "set actor.lora.dropout=0 or leave lm_head out"),
    (["actor.lora.sync=adapters"], "acts only with LoRA on"),
    (["actor.lora.rank=8", "actor.lora.sync=fast"], "actor.lora.sync"),
    (["actor.lora.rank=1024", "actor.lora.sync=adapters", "rollout.engine=vllm"],
     "vLLM serves adapters of rank <= 512"),
    (["actor.lora.rank=8", "actor.lora.dropout=0.1", "actor.tp=2"], "set actor.lora.dropout=0 or actor.tp=1"),
    (["actor.lora.rank=8", "ref.tp=2"], "ref.tp=2 vs actor.tp=1"),
    (["actor.lora.rank=8", "placement.mode=split"], "use placement.mode=colocated"),
    (["actor.lora.rank=8", "actor.lora.init_from=/nonexistent"], "is not a PEFT adapter directory"),
])
def test_lora_refusals(overrides, needle):
    with pytest.raises(UserError, match=needle.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]")):
        load_config("conf/grpo_tiny.yaml", overrides)


def test_lora_refused_on_megatron():
    # refused for its LoRA before the megatron checks (which import megatron-core and need CUDA)
    with pytest.raises(UserError, match="the megatron backend has no LoRA adapters"):
        load_config("conf/grpo_tiny.yaml", ["actor.lora.rank=8", "actor.backend=megatron", "ref.backend=megatron",
                                            "trainer.share_prompts=false"])


def test_init_from_must_match(tmp_path):
    save_peft_adapter({}, LoRASpec(rank=4, alpha=8.0, target_modules=("q_proj",)), tmp_path / "a")
    keys = ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.lora.target_modules=[q_proj]"]
    cfg = load_config("conf/grpo_tiny.yaml", [*keys, f"actor.lora.init_from={tmp_path / 'a'}"])
    assert cfg.actor.lora.init_from == str(tmp_path / "a")
    with pytest.raises(UserError, match="holds r=4, alpha=8.0"):
        load_config("conf/grpo_tiny.yaml", ["actor.lora.rank=8", f"actor.lora.init_from={tmp_path / 'a'}"])


def test_an_adapted_head_needs_an_untied_head():
    from launcher.planning.plan import compute_plan
    from models.config import preset_config

    cfg = load_config("conf/grpo_tiny.yaml", ["actor.lora.rank=8", "actor.lora.target_modules=[all-linear,lm_head]"])
    compute_plan(cfg, world_size=1, model=preset_config("tiny"))
    with pytest.raises(UserError, match="ties its head to its embeddings"):
        compute_plan(cfg, world_size=1, model=preset_config("tiny-qwen3"))
