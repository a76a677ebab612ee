"""The config tree -> the typed pieces `ppo` reads (ppo/settings.py), built once per launch: `ppo` never sees
the config tree itself.

    settings = build_ppo_settings(cfg, device=env.device)
"""

from __future__ import annotations

import dataclasses

import torch

from launcher.config.schema import MODEL_ROLES, Config, resolved_rollout_correction, role_section
from ppo.algos.core_algos import PolicyLossSettings
from ppo.settings import (
    AdvantageSettings,
    AgentSettings,
    ControllerSettings,
    DataSettings,
    GenerationSettings,
    KLControlSettings,
    LoopSettings,
    LoRASettings,
    OptimizerSettings,
    PPOSettings,
    RewardSettings,
    RoleBuildSettings,
    RolesSettings,
    RunSettings,
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
        sft_lr=cfg.trainer.sft_lr)
    max_len = cfg.data.max_prompt_length + r.max_response_length
    engine = RolloutConfig(gpu_memory_fraction=r.gpu_memory_fraction, max_num_seqs=r.max_num_seqs,
                           max_parked_seqs=r.max_parked_seqs,
                           max_model_len=max_len, enable_cuda_graph=r.enable_cuda_graph, compile=r.compile,
                           decode_attention=r.decode_attention, share_prompt_kv=r.share_prompt_kv,
                           fold_norms=r.fold_norms, free_memory_on_sleep=r.free_memory_on_sleep is not False,
                           kv_cache_dtype=r.kv_cache_dtype,
                           # CPU has no memory fraction to size the KV cache from: room for every sequence
                           kv_cache_tokens=None if device.type == "cuda" else
                           max_len * (r.max_num_seqs + r.max_parked_seqs),
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
        offload_optimizer_while_generating=a.offload_optimizer_while_generating,
        settle_residency=r.free_memory_on_sleep is None, partial_kv=r.partial_kv, decode_beside=r.decode_beside,
        lora_sync=cfg.actor.lora.sync if cfg.actor.lora.rank > 0 else "merged",
        dtype=torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32,
        vllm=vllm, agent=AgentSettings(**dataclasses.asdict(cfg.agent)))
    return PPOSettings(run=build_run_settings(cfg), data=build_data_settings(cfg), reward=build_reward_settings(cfg),
                       roles=roles, generation=generation, build=build_role_settings(cfg),
                       loop=build_loop_settings(cfg))


def build_run_settings(cfg: Config) -> RunSettings:
    t = cfg.trainer
    return RunSettings(seed=t.seed, total_steps=t.total_steps, total_epochs=t.total_epochs,
                       experiment_name=t.experiment_name, progress_bar=t.progress_bar, tensorboard=t.tensorboard,
                       wandb=t.wandb, wandb_project=t.wandb_project, resume=t.resume,
                       on_damaged_checkpoint=t.on_damaged_checkpoint, keep_last=t.keep_last, export_hf=t.export_hf,
                       config_record=dataclasses.asdict(cfg) if t.wandb else None)


def build_data_settings(cfg: Config) -> DataSettings:
    d = cfg.data
    return DataSettings(tokenizer=cfg.model.tokenizer, train_files=tuple(d.train_files), val_files=tuple(d.val_files),
                        task=d.task, task_size=d.task_size, prompt_key=d.prompt_key, answer_key=d.answer_key,
                        sft_answer_key=d.sft_answer_key, max_prompt_length=d.max_prompt_length,
                        batch_size=d.batch_size, shuffle=d.shuffle)


def build_reward_settings(cfg: Config) -> RewardSettings:
    w, m = cfg.reward, cfg.reward.model
    function = f"builtin:task:{cfg.data.task}" if w.function == "builtin:task" else w.function
    model = {} if m is None else {"model_path": m.path, "max_tokens_per_micro_batch": m.max_tokens_per_micro_batch}
    return RewardSettings(is_model=m is not None, function=function, signature=w.signature,
                          default_score=w.default_score, timeout_s=w.timeout_s or None,
                          pass_threshold=w.pass_threshold, stop_failed_fraction=w.stop_failed_fraction, **model)


def _optimizer(sec) -> OptimizerSettings:
    o = sec.optim
    return OptimizerSettings(lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), warmup_steps=o.warmup_steps,
                             lr_schedule=o.lr_schedule, min_lr_ratio=o.min_lr_ratio, grad_clip=o.grad_clip,
                             stream_from_host=bool(sec.offload_optimizer))


def build_role_settings(cfg: Config) -> RoleBuildSettings:
    def layout(sec) -> WorkerLayout:
        # unset memory keys that nothing fitted (launcher.planning.fit runs at launch): the plain default; a
        # forward-only role (reference, reward model) has no backward to recompute for
        ac = getattr(sec, "activation_checkpointing", None) or "none"
        return WorkerLayout(backend=sec.backend, activation_checkpointing=ac,
                            compile=sec.compile, pp_microbatches=sec.pp_microbatches, pp_schedule=sec.pp_schedule,
                            pp_stages_per_rank=sec.pp_stages_per_rank)

    return RoleBuildSettings(
        dtype=cfg.model.dtype, model_path=cfg.model.path, critic_path=cfg.critic.path,
        share_prompts=cfg.trainer.share_prompts,
        # a rule reward has no layout section: the plain layout (it builds no model)
        layouts={role: layout(sec) if (sec := role_section(cfg, role)) else WorkerLayout() for role in MODEL_ROLES},
        actor_optim=_optimizer(cfg.actor), critic_optim=_optimizer(cfg.critic), actor_lora=_lora(cfg.actor.lora),
        router_replay=cfg.actor.router_replay, router_aux_loss_coef=cfg.actor.router_aux_loss_coef)


def _lora(lo) -> LoRASettings | None:
    if lo.rank == 0:
        return None
    return LoRASettings(rank=lo.rank, alpha=float(lo.alpha), dropout=float(lo.dropout),
                        target_modules=tuple(lo.target_modules), init_from=lo.init_from)


def build_loop_settings(cfg: Config) -> LoopSettings:
    t, a, c, r = cfg.trainer, cfg.algorithm, cfg.controller, cfg.rollout
    advantages = AdvantageSettings(
        name=a.name, gamma=a.gamma, lam=a.lam, norm_adv_by_std=a.norm_adv_by_std, use_kl_penalty=a.use_kl_penalty,
        kl_penalty=a.kl_penalty, rollout_correction=a.rollout_correction, use_kl_loss=cfg.actor.use_kl_loss,
        kl_control=KLControlSettings(kind=a.kl_ctrl, coef=a.kl_coef, target=a.target_kl, horizon=a.kl_horizon),
        overlong_buffer=a.overlong_buffer.enable, overlong_buffer_len=a.overlong_buffer.len,
        overlong_penalty_factor=a.overlong_buffer.penalty_factor, overlong_filter=a.overlong_filter,
        filter_groups=a.filter_groups.enable, max_gen_rounds=a.filter_groups.max_num_gen_batches)
    controller = ControllerSettings(enabled=c.enabled, low_util=c.low_util, high_mem=c.high_mem, grow=c.grow,
                                    shrink=c.shrink, hysteresis_steps=c.hysteresis_steps,
                                    max_oom_retries=c.max_oom_retries)
    return LoopSettings(
        max_staleness=t.max_staleness, batches_in_flight=r.batches_in_flight, stale_policy=t.stale_policy,
        micro_batch_tokens={role: getattr(cfg, role).max_tokens_per_micro_batch for role in ("actor", "ref", "critic")},
        advantages=advantages, controller=controller, sft_warmup_steps=t.sft_warmup_steps,
        val_before_train=t.val_before_train, test_freq=t.test_freq, val_n=r.val_n, val_temperature=r.val_temperature,
        save_every=t.save_every, save_final=t.save_final,
        save_every_minutes=t.save_every_minutes, log_samples_every=t.log_samples_every,
        log_samples_count=t.log_samples_count, profile_steps=tuple(t.profile_steps), gc_freeze=t.gc_freeze,
        max_nonfinite_steps=t.max_nonfinite_steps)
