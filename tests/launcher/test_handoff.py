"""launcher/handoff.py: the config keys reach the typed settings ppo reads."""

import torch

from launcher.config import load_config
from launcher.handoff import build_ppo_settings


def test_config_keys_reach_the_typed_settings():
    cfg = load_config("conf/grpo_tiny.yaml", [
        "actor.clip_high=0.28", "actor.entropy_coef=0.01", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.05",
        "actor.loss_agg=seq-mean-token-mean", "actor.ppo_epochs=2", "actor.mini_batch_size=8",
        "rollout.n=4", "rollout.top_p=0.9", "rollout.max_num_seqs=16", "rollout.bucket_mb=64",
        "model.dtype=bfloat16", "trainer.sft_lr=0.002"])
    s = build_ppo_settings(cfg, device=torch.device("cpu"))
    loss = s.roles.policy_loss
    assert (loss.clip_high, loss.entropy_coef, loss.kl_loss_coef, loss.agg) == (0.28, 0.01, 0.05, "seq-mean-token-mean")
    assert loss.needs_entropy and loss.needs_ref
    assert (s.roles.actor_update.epochs, s.roles.actor_update.mini_batch_size, s.roles.sft_lr) == (2, 8, 0.002)
    g = s.generation
    assert (g.n, g.top_p, g.bucket_bytes, g.dtype) == (4, 0.9, 64 << 20, torch.bfloat16)
    max_len = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    assert g.engine.max_num_seqs == 16 and g.engine.max_model_len == max_len
    assert g.engine.kv_cache_tokens == max_len * 16  # CPU: room for every sequence, no memory fraction
    assert build_ppo_settings(cfg, device=torch.device("cuda", 0)).generation.engine.kv_cache_tokens is None


def test_vllm_options_only_for_the_vllm_engine(monkeypatch):
    import rollout.vllm_support as support

    assert build_ppo_settings(load_config("conf/ppo_tiny.yaml"), device=torch.device("cpu")).generation.vllm is None
    monkeypatch.setattr(support, "installed_vllm_version", lambda: "0.32.0")
    cfg = load_config("conf/ppo_tiny.yaml", ["rollout.engine=vllm", "rollout.bucket_mb=32"])
    g = build_ppo_settings(cfg, device=torch.device("cpu")).generation
    assert g.engine_kind == "vllm" and g.vllm.bucket_bytes == 32 << 20 and g.vllm.idle_tp == 0
    assert g.vllm.enforce_eager  # CPU, no compile: vLLM runs eagerly
