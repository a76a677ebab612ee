"""launcher/handoff.py: the config keys reach the typed settings ppo reads."""

import torch

from launcher.config.load import load_config
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
    assert s.roles.policy_loss.max_len == s.generation.max_response_length
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


def test_loop_settings_carry_the_step_loop_sections():
    cfg = load_config("conf/grpo_tiny.yaml", [
        "trainer.seed=7", "data.batch_size=6", "rollout.n=4", "rollout.max_response_length=12",
        "actor.ppo_epochs=3", "actor.mini_batch_size=8", "actor.max_tokens_per_micro_batch=1000",
        "ref.max_tokens_per_micro_batch=2000", "critic.max_tokens_per_micro_batch=3000",
        "algorithm.gamma=0.9", "algorithm.kl_penalty=k3", "algorithm.overlong_buffer.enable=true",
        "algorithm.overlong_buffer.len=5", "algorithm.overlong_buffer.penalty_factor=0.25",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=6",
        "algorithm.overlong_filter=true", "controller.enabled=true", "controller.grow=1.5",
        "controller.max_oom_retries=5", "reward.stop_failed_fraction=0.5", "reward.pass_threshold=0.75",
        "trainer.save_every=4", "trainer.save_every_minutes=0", "trainer.test_freq=2", "data.val_files=[val.jsonl]",
        "rollout.val_n=3", "rollout.val_temperature=0.7", "trainer.log_samples_every=5"])
    s = build_ppo_settings(cfg, device=torch.device("cpu"))
    loop = s.loop
    # the loop's other facts are read where they live, once
    assert (s.run.seed, s.data.batch_size, s.generation.n, s.generation.max_response_length) == (7, 6, 4, 12)
    assert (s.roles.actor_update.epochs, s.roles.actor_update.mini_batch_size) == (3, 8)
    assert (s.reward.stop_failed_fraction, s.reward.pass_threshold) == (0.5, 0.75)
    assert loop.micro_batch_tokens == {"actor": 1000, "ref": 2000, "critic": 3000}
    a = loop.advantages
    assert (a.name, a.gamma, a.kl_penalty) == ("grpo", 0.9, "k3")
    assert (a.overlong_buffer, a.overlong_buffer_len, a.overlong_penalty_factor) == (True, 5, 0.25)
    assert (a.filter_groups, a.max_gen_rounds, a.overlong_filter) == (True, 6, True)
    assert (loop.controller.enabled, loop.controller.grow, loop.controller.max_oom_retries) == (True, 1.5, 5)
    assert (loop.save_every, loop.save_every_minutes, loop.test_freq, loop.val_n, loop.val_temperature,
            loop.log_samples_every) == (
        4, 0, 2, 3, 0.7, 5)


def test_role_build_settings_carry_sources_layouts_and_optimizers():
    cfg = load_config("conf/ppo_tiny.yaml", [
        "trainer.seed=11", "model.dtype=bfloat16", "critic.path=/tmp/critic", "actor.optim.lr=0.003",
        "actor.optim.betas=[0.8,0.95]", "critic.optim.lr_schedule=cosine", "critic.optim.grad_clip=0.5",
        "actor.activation_checkpointing=full", "ref.compile=true", "actor.offload_optimizer=true",
        "reward.timeout_s=0", "reward.default_score=-1.0", "trainer.share_prompts=true"])
    s = build_ppo_settings(cfg, device=torch.device("cpu"))
    b = s.build
    assert (s.run.seed, b.dtype, b.critic_path, b.share_prompts) == (11, "bfloat16", "/tmp/critic", True)
    assert b.actor_optim.lr == 0.003 and b.actor_optim.betas == (0.8, 0.95)
    assert (b.critic_optim.lr_schedule, b.critic_optim.grad_clip) == ("cosine", 0.5)
    assert b.layouts["actor"].activation_checkpointing == "full" and not b.layouts["actor"].compile
    assert b.layouts["ref"].compile and set(b.layouts) == {"actor", "ref", "critic", "reward"}
    assert b.actor_optim.stream_from_host and not b.critic_optim.stream_from_host
    assert not s.generation.offload_optimizer_while_generating
    assert s.reward.timeout_s is None and s.reward.default_score == -1.0  # 0: no limit
    assert s.reward.function == f"builtin:task:{cfg.data.task}"


def test_run_and_data_settings_carry_what_the_run_state_reads():
    cfg = load_config("conf/ppo_tiny.yaml", [
        "trainer.total_epochs=2", "trainer.keep_last=5", "trainer.resume=auto", "trainer.export_hf=every_save",
        "trainer.on_damaged_checkpoint=fallback", "trainer.wandb=true", "data.prompt_key=question",
        "data.train_files=a.jsonl", "data.max_prompt_length=99", "data.shuffle=false", "model.tokenizer=builtin:char",
        "algorithm.kl_ctrl=adaptive", "algorithm.kl_coef=0.2", "algorithm.target_kl=0.05", "algorithm.kl_horizon=500"])
    s = build_ppo_settings(cfg, device=torch.device("cpu"))
    r, d = s.run, s.data
    assert (r.total_epochs, r.keep_last, r.resume, r.export_hf, r.on_damaged_checkpoint) == (
        2, 5, "auto", "every_save", "fallback")
    assert r.config_record["trainer"]["keep_last"] == 5  # W&B records the resolved config as plain data
    assert (d.prompt_key, d.train_files, d.max_prompt_length, d.shuffle, d.tokenizer) == (
        "question", ("a.jsonl",), 99, False, "builtin:char")
    k = s.loop.advantages.kl_control
    assert (k.kind, k.coef, k.target, k.horizon) == ("adaptive", 0.2, 0.05, 500)
    assert build_ppo_settings(load_config("conf/ppo_tiny.yaml"), device=torch.device("cpu")).run.config_record is None


def test_placement_exposes_the_plan_groups_and_environment():
    from launcher.dist import DistEnv
    from launcher.planning.plan import compute_plan, resolve_model_config
    from ppo.roles.placement import Placement

    cfg = load_config("conf/ppo_tiny.yaml")
    plan = compute_plan(cfg, world_size=1, model=resolve_model_config(cfg))
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    p = Placement(plan, {}, env)
    assert p.plan is plan and p.env is env and (p.rank, p.device) == (0, torch.device("cpu"))
