"""The config tree -> the typed pieces `ppo` reads (ppo/settings.py), built once per launch."""

from __future__ import annotations

import torch

from launcher.config.schema import Config, resolved_rollout_correction
from ppo.algos.core_algos import PolicyLossSettings
from ppo.settings import (
    AdvantageSettings,
    ControllerSettings,
    GenerationSettings,
    LoopSettings,
    OptimizerSettings,
    PPOSettings,
    RewardSettings,
    RoleBuildSettings,
    RolesSettings,
    UpdateSettings,
    ValueLossSettings,
    WorkerLayout,
)
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
                           decode_attention=r.decode_attention, share_prompt_kv=r.share_prompt_kv,
                           fold_norms=r.fold_norms, free_memory_on_sleep=r.free_memory_on_sleep is not False,
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
        offload_optimizer=a.offload, settle_residency=r.free_memory_on_sleep is None,
        dtype=torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32,
        vllm=vllm)
    return PPOSettings(roles=roles, generation=generation, build=build_role_settings(cfg),
                       loop=build_loop_settings(cfg))


def _reward_settings(cfg: Config) -> RewardSettings:
    w = cfg.reward
    return RewardSettings(is_model=w.type == "model", function=w.function, task=cfg.data.task,
                          signature=w.signature, model_path=w.model_path, default_score=w.default_score,
                          timeout_s=w.timeout_s or None, max_tokens_per_micro_batch=w.max_tokens_per_micro_batch,
                          pass_threshold=w.pass_threshold, stop_failed_fraction=w.stop_failed_fraction)


def _optimizer(o) -> OptimizerSettings:
    return OptimizerSettings(lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), warmup_steps=o.warmup_steps,
                             lr_schedule=o.lr_schedule, min_lr_ratio=o.min_lr_ratio, grad_clip=o.grad_clip)


def build_role_settings(cfg: Config) -> RoleBuildSettings:
    def layout(sec) -> WorkerLayout:
        # unset memory keys that nothing fitted (launcher.planning.fit runs at launch): the plain default
        return WorkerLayout(backend=sec.backend, activation_checkpointing=sec.activation_checkpointing or "none",
                            compile=sec.compile, pp_microbatches=sec.pp_microbatches, pp_schedule=sec.pp_schedule,
                            pp_stages_per_rank=sec.pp_stages_per_rank)

    return RoleBuildSettings(
        seed=cfg.trainer.seed, dtype=cfg.model.dtype, model_path=cfg.model.path, critic_path=cfg.critic.path,
        share_prompts=cfg.trainer.share_prompts,
        layouts={role: layout(getattr(cfg, role)) for role in ("actor", "ref", "critic", "reward")},
        actor_optim=_optimizer(cfg.actor.optim), critic_optim=_optimizer(cfg.critic.optim),
        actor_offload_optimizer=bool(cfg.actor.offload_optimizer),
        critic_offload_optimizer=bool(cfg.critic.offload_optimizer),
        reward=_reward_settings(cfg))


def build_loop_settings(cfg: Config) -> LoopSettings:
    t, a, c, r = cfg.trainer, cfg.algorithm, cfg.controller, cfg.rollout
    advantages = AdvantageSettings(
        name=a.name, gamma=a.gamma, lam=a.lam, norm_adv_by_std=a.norm_adv_by_std, use_kl_penalty=a.use_kl_penalty,
        kl_penalty=a.kl_penalty, rollout_correction=a.rollout_correction, use_kl_loss=cfg.actor.use_kl_loss,
        overlong_buffer=a.overlong_buffer.enable, overlong_buffer_len=a.overlong_buffer.len,
        overlong_penalty_factor=a.overlong_buffer.penalty_factor, overlong_filter=a.overlong_filter,
        filter_groups=a.filter_groups.enable, max_gen_rounds=a.filter_groups.max_num_gen_batches)
    controller = ControllerSettings(enabled=c.enabled, low_util=c.low_util, high_mem=c.high_mem, grow=c.grow,
                                    shrink=c.shrink, hysteresis_steps=c.hysteresis_steps,
                                    max_oom_retries=c.max_oom_retries)
    return LoopSettings(
        seed=t.seed, batch_size=cfg.data.batch_size, n=r.n, max_response_length=r.max_response_length,
        async_rollout=t.async_rollout, share_prompts=t.share_prompts, actor_ppo_epochs=cfg.actor.ppo_epochs,
        actor_mini_batch_size=cfg.actor.mini_batch_size,
        micro_batch_tokens={role: getattr(cfg, role).max_tokens_per_micro_batch for role in ("actor", "ref", "critic")},
        advantages=advantages, controller=controller, reward=_reward_settings(cfg),
        sft_warmup_steps=t.sft_warmup_steps, val_before_train=t.val_before_train, test_freq=t.test_freq,
        val_n=r.val_n, val_temperature=r.val_temperature, save_every=t.save_every, save_final=t.save_final,
        save_every_minutes=t.save_every_minutes, log_samples_every=t.log_samples_every,
        log_samples_count=t.log_samples_count, profile_steps=tuple(t.profile_steps), gc_freeze=t.gc_freeze)
