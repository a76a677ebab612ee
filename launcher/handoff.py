"""The config tree -> the typed pieces `ppo` reads (ppo/settings.py), built once per launch."""

from __future__ import annotations

import torch

from launcher.config import Config, resolved_rollout_correction
from ppo.core_algos import PolicyLossSettings
from ppo.settings import GenerationSettings, PPOSettings, RolesSettings, UpdateSettings, ValueLossSettings
from rollout.base import RolloutConfig


def build_ppo_settings(cfg: Config, *, device: torch.device) -> PPOSettings:
    a, c, r = cfg.actor, cfg.critic, cfg.rollout
    roles = RolesSettings(
        policy_loss=PolicyLossSettings(clip_low=a.clip_low, clip_high=a.clip_high, dual_clip_c=a.dual_clip_c,
                                       agg=a.loss_agg, entropy_coef=a.entropy_coef, use_kl_loss=a.use_kl_loss,
                                       kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type,
                                       kind=a.policy_loss, max_len=r.max_response_length,
                                       rollout_correction=resolved_rollout_correction(cfg),
                                       rollout_is_cap=cfg.algorithm.rollout_is_cap,
                                       rollout_mask_threshold=cfg.algorithm.rollout_mask_threshold),
        actor_update=UpdateSettings(epochs=a.ppo_epochs, mini_batch_size=a.mini_batch_size),
        critic_update=UpdateSettings(epochs=c.ppo_epochs, mini_batch_size=c.mini_batch_size),
        value_loss=ValueLossSettings(clip=c.value_clip, agg=c.loss_agg),
        sft_lr=cfg.trainer.sft_lr, sft_max_tokens=a.max_tokens_per_micro_batch)
    max_len = cfg.data.max_prompt_length + r.max_response_length
    engine = RolloutConfig(gpu_memory_fraction=r.gpu_memory_fraction, max_num_seqs=r.max_num_seqs,
                           max_model_len=max_len, enable_cuda_graph=r.enable_cuda_graph, compile=r.compile,
                           decode_attention=r.decode_attention, free_memory_on_sleep=r.free_memory_on_sleep,
                           # CPU has no memory fraction to size the KV cache from: room for every sequence
                           kv_cache_tokens=None if device.type == "cuda" else max_len * r.max_num_seqs,
                           seed=cfg.trainer.seed)
    vllm = None
    if r.engine == "vllm":  # the settings only vLLM reads
        from rollout.vllm_support import VLLMOptions, logprobs_mode_for

        compiled = r.compile or (device.type == "cuda" and r.enable_cuda_graph)
        vllm = VLLMOptions(logprobs_mode=logprobs_mode_for(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p),
                           enforce_eager=not compiled, bucket_bytes=r.bucket_mb * 2**20)
    generation = GenerationSettings(
        engine_kind=r.engine, engine=engine, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
        max_response_length=r.max_response_length, n=r.n, bucket_bytes=r.bucket_mb * 2**20,
        offload_optimizer=a.offload, dtype=torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32,
        vllm=vllm)
    return PPOSettings(roles=roles, generation=generation)
