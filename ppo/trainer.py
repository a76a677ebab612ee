"""The PPO/GRPO step loop over the role groups of a device plan (driven by launcher/main.py).

    torchrun --nproc_per_node 2 launcher/main.py conf/ppo_tiny.yaml

One step, on every rank (each rank does the stages of the roles it hosts; in split
placement the groups work concurrently and meet at two exchanges):

    prompts -> generate (actor ranks, hybrid engine) -> share samples
            -> old log-probs (actor) | ref log-probs (ref) | values (critic) | scores (reward)
            -> merge results -> advantages (pure, every rank) -> actor update | critic update
            -> metrics.jsonl, checkpoints
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from ppo import core_algos as algos
from ppo.experience import Experience, Sample, all_gather_objects, merge_results, share_samples
from ppo.roles import build_roles
from ppo.samples import SampleLog
from ppo.state import TrainState

STAGES = ("gen", "reshard", "old_log_prob", "ref", "reward", "values", "adv", "update_actor", "update_critic")


class StageTimer:
    """Wall time per stage on this rank (device-synchronised), tagged into the GPU monitor."""

    def __init__(self, device: torch.device, monitor=None, on_stage=None):
        self.device, self.monitor, self.on_stage = device, monitor, on_stage
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        if self.monitor is not None:
            self.monitor.set_stage(name)
        if self.on_stage is not None:  # the watchdog's heartbeat names the stage a stalled rank was in
            self.on_stage(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
            if self.monitor is not None:
                self.monitor.set_stage("idle")


class PPOTrainer:
    """`heartbeat` (set_stage(stage, step), e.g. launcher.watchdog.Watchdog) hears every stage;
    `stop_requested() -> reason | None` (launcher.preempt.StopRequest) is asked at each step end."""

    def __init__(self, cfg, *, plan, groups, env, run_dir: Path, model_config, monitor=None, heartbeat=None,
                 stop_requested=None):
        self.plan, self.env, self.run_dir = plan, env, Path(run_dir)
        self.log = logging.getLogger("hybridrl")
        self.rank = env.rank
        self.state = TrainState.create(cfg, run_dir=self.run_dir, rank=env.rank)
        self.cfg = cfg = self.state.cfg  # trainer.total_epochs resolved into total_steps from the data
        from ppo.resume import layout_of

        self.state.layout = layout_of(plan)
        self.heartbeat, self.stop_requested = heartbeat, stop_requested
        self.last_save = time.monotonic()
        self.roles = build_roles(cfg, plan=plan, groups=groups, env=env, model_config=model_config,
                                 tokenizer=self.state.tokenizer, run_dir=self.run_dir)
        self.monitor = monitor  # launcher.monitor.GpuMonitor on each node's first rank, or None
        t = cfg.trainer
        self.sample_log = None  # rank 0 shows a few samples every trainer.log_samples_every steps
        if self.rank == 0 and t.log_samples_every:
            self.sample_log = SampleLog(self.run_dir, every=t.log_samples_every, count=t.log_samples_count,
                                        tokenizer=self.state.tokenizer)
        self.state.model_params = model_config.matmul_params()  # FLOP accounting's N (no embedding lookup)
        self.pending: Experience | None = None  # async: the batch generated one step ahead
        # One epoch over one mini-batch, and no in-reward KL penalty: the old log-probs would be the
        # update's own forward, bit for bit, so that forward serves both (ratio == 1 by construction).
        a, samples = cfg.actor, cfg.data.batch_size * cfg.rollout.n
        self.fused_old_logp = (a.ppo_epochs == 1 and (a.mini_batch_size == 0 or a.mini_batch_size >= samples)
                               and not (cfg.algorithm.use_kl_penalty and "ref" in plan.groups)
                               and not cfg.trainer.async_rollout)
        self.base_budgets = {"actor": cfg.actor.max_tokens_per_micro_batch, "ref": cfg.ref.max_tokens_per_micro_batch,
                             "critic": cfg.critic.max_tokens_per_micro_batch}
        self.budgets = dict(self.base_budgets)
        self.controller = self.controller_base = None
        if cfg.controller.enabled:
            from ppo.controller import BatchController

            c = cfg.controller
            self.controller_base = cfg.actor.max_tokens_per_micro_batch
            self.controller = BatchController(
                rollout_tokens=self.roles.rollout_token_budget(), micro_batch_tokens=self.controller_base,
                low_util=c.low_util, high_mem=c.high_mem, grow=c.grow, shrink=c.shrink,
                hysteresis_steps=c.hysteresis_steps)
        self.state.controller = self.controller

    # ------------------------------------------------------------------ one step
    def generate(self, step: int, timer: StageTimer) -> Experience:
        """Draw the step's prompts, generate on the actor ranks, share the samples with every rank."""
        batch = self.state.next_prompts()
        mine: list[Sample] = []
        if self.roles.rollout is not None:
            with timer("gen"):
                mine = self.roles.rollout.generate(batch, step=step, seed=self.cfg.trainer.seed, timer=timer)
            timer.times["gen"] -= timer.times.get("reshard", 0.0)  # gen is decoding; reshard its own stage
        return Experience(share_samples(mine))

    def score(self, exp: Experience, timer: StageTimer, *, old_logp: bool) -> dict:
        """Each role group over its DP shard (concurrently in split placement)."""
        roles, results = self.roles, {}
        if roles.actor is not None and old_logp:
            with timer("old_log_prob"):
                r = self.budgeted("old_log_prob", lambda b: roles.actor.compute_logprobs(
                    exp, roles.actor_plan(exp, b), with_entropy=True), "actor")
                results.update(old_logp=r["logp"], entropy=r["entropy"])
        if roles.ref is not None:
            with timer("ref"):
                results["ref_logp"] = self.budgeted("ref", lambda b: roles.ref.compute_logprobs(
                    exp, roles.ref_plan(exp, b)), "ref")["logp"]
        if roles.critic is not None:
            with timer("values"):
                results.update(self.budgeted("values", lambda b: roles.critic.compute_values(
                    exp, roles.critic_plan(exp, b)), "critic"))
        if roles.reward is not None:
            with timer("reward"):
                results.update(roles.reward.score(exp))  # score, reward_failed (rule functions), reward/<key>
        return results

    def step(self, step: int) -> dict[str, float]:
        cfg, roles = self.cfg, self.roles
        is_async = cfg.trainer.async_rollout
        hb = self.heartbeat
        timer = StageTimer(self.env.device, self.monitor, on_stage=None if hb is None else
                           lambda name: hb.set_stage(name, step))
        t_step = time.perf_counter()

        # 1. the batch: generated now (on-policy), or one step ago (async, one step off-policy)
        exp = self.pending if self.pending is not None else self.generate(step, timer)
        self.pending = None

        # 2. scoring; async skips the old-log-prob recompute: the behaviour log-probs recorded at
        #    generation are the importance-ratio denominators
        results = self.score(exp, timer, old_logp=not (is_async or self.fused_old_logp))
        if is_async and step + 1 < cfg.trainer.total_steps:
            # the actor ranks generate batch k+1 while the other groups score batch k
            self.pending = self.generate(step + 1, timer)
        merged = merge_results(results)
        if is_async:
            merged["old_logp"] = {s.uid: torch.tensor(s.behaviour_logprobs) for s in exp.samples}

        # 3. advantages: a pure function of the merged batch, computed identically on every rank
        with timer("adv"):
            tensors, adv_metrics = self.compute_advantages(exp, merged)
        self.check_reward_failures(step, adv_metrics, num_samples=len(exp.samples))

        # 4. updates: actor and critic groups (concurrent when placed apart)
        actor_m, critic_m = {}, {}
        if roles.actor is not None:
            with timer("update_actor"):
                actor_m = self.budgeted("update_actor", lambda b: roles.update_actor(exp, tensors, max_tokens=b),
                                        "actor", retry_safe=lambda: roles.actor.optimizer_steps_in_update == 0)
        if roles.critic is not None:
            with timer("update_critic"):
                critic_m = self.budgeted("update_critic", lambda b: roles.update_critic(exp, tensors, max_tokens=b),
                                         "critic", retry_safe=lambda: roles.critic.optimizer_steps_in_update == 0)
        timer.times["step"] = time.perf_counter() - t_step
        if self.sample_log is not None and self.sample_log.due(step):
            self.sample_log.write(step, exp.samples, tensors["scores"], tensorboard=self.state.tensorboard())
        return self.collect_metrics(step, exp, tensors, adv_metrics, actor_m, critic_m, timer.times)

    def budgeted(self, stage: str, fn, role: str, *, retry_safe=None):
        """Run a stage with its role's micro-batch token budget; on CUDA OOM halve it and rerun
        (no sample is lost: fn re-reads the whole batch). Updates retry only before their first
        optimizer step, so no mini-batch is applied twice."""
        from ppo.controller import is_cuda_oom, run_with_oom_backoff

        def safe_oom(err: BaseException) -> bool:
            return is_cuda_oom(err) and (retry_safe is None or retry_safe())

        def record(old: int, new: int) -> None:
            self.log.warning("%s: CUDA out of memory at %d tokens per micro-batch; retrying with %d", stage, old, new)
            self.budgets[role] = new
            if self.controller is not None:
                self.controller.record_oom(failed=old, new=new)

        out, self.budgets[role] = run_with_oom_backoff(
            fn, budget=self.budgets[role], min_budget=min(256, self.budgets[role]),
            max_retries=self.cfg.controller.max_oom_retries, on_oom=record, is_oom=safe_oom, name=stage)
        return out

    def control(self, metrics: dict[str, float]) -> None:
        """Step boundary only: the batch controller resizes token budgets from utilization/memory."""
        from ppo.controller import agree_feedback

        util = metrics.get("gpu/util_mean")
        util = None if util is None else util / 100.0
        mem = None
        if self.env.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.env.device).total_memory
            mem = min(1.0, torch.cuda.max_memory_reserved(self.env.device) / total)
        util, mem = agree_feedback(util, mem)
        d = self.controller.decide(util, mem)
        scale = d.micro_batch_tokens / self.controller_base
        for role, base in self.base_budgets.items():
            self.budgets[role] = max(256, int(base * scale))
        if self.roles.rollout is not None:
            self.roles.rollout.set_token_budget(d.rollout_tokens)
        metrics["controller/micro_batch_tokens"] = d.micro_batch_tokens
        metrics["controller/rollout_tokens"] = d.rollout_tokens
        if self.rank == 0 and d.action != "hold":
            self.log.info("batch controller: %s (%s) -> micro-batch %d tokens, rollout %d tokens",
                          d.action, d.reason, d.micro_batch_tokens, d.rollout_tokens)

    def compute_advantages(self, exp: Experience, merged: dict[str, dict[int, torch.Tensor]]):
        """[B, R] tensors for the updates: mask, old_logp, advantages, (returns, values, ref_logp)."""
        cfg, a = self.cfg, self.cfg.algorithm
        mask = exp.response_mask()
        scores = torch.tensor([float(merged["score"][s.uid]) for s in exp.samples])
        token_rewards = algos.scores_to_token_rewards(scores, mask)
        t = {"mask": mask, "scores": scores}
        if "old_logp" in merged:
            t["old_logp"] = exp.stack(merged["old_logp"])
        metrics: dict[str, float] = _reward_extra_metrics(merged)  # reward/<key>/mean of dict results
        if "reward_failed" in merged:
            failed = sum(float(merged["reward_failed"][s.uid]) for s in exp.samples)
            metrics["reward/failed"] = failed
            metrics["reward/failed_frac"] = failed / len(exp.samples)
        if "old_logp" in t and not self.cfg.trainer.async_rollout:
            # on-policy the engine's log-probs and the trainer's must agree (same weights, same temperature)
            diff = (exp.behaviour_logprobs() - t["old_logp"]).abs() * mask
            metrics["rollout/logprob_diff_max"] = float(diff.max())
            metrics["rollout/logprob_diff_mean"] = float(diff.sum() / mask.sum().clamp_min(1))
        if merged.get("entropy"):
            metrics["actor/entropy"] = float(algos.masked_mean(exp.stack(merged["entropy"]), mask.float()))
        if "ref_logp" in merged:
            t["ref_logp"] = exp.stack(merged["ref_logp"])
        if "ref_logp" in t and "old_logp" in t:
            kl = algos.kl_estimate(t["old_logp"], t["ref_logp"], kind=a.kl_penalty)
            metrics["actor/kl"] = float(algos.masked_mean(kl, mask.float()))
            if a.use_kl_penalty:
                token_rewards, kl_m = algos.apply_kl_penalty(token_rewards, t["old_logp"], t["ref_logp"], mask,
                                                             kl_coef=self.state.kl_ctrl.value, kind=a.kl_penalty)
                self.state.kl_ctrl.update(kl_m["kl"], n_steps=len(exp.samples))
                metrics["actor/kl_coef"] = kl_m["kl_coef"]
        group_ids = torch.tensor([s.prompt_index for s in exp.samples])
        if a.name == "ppo":
            t["values"] = exp.stack(merged["values"])
            adv, ret = algos.compute_gae(token_rewards, t["values"], mask, gamma=a.gamma, lam=a.lam,
                                         whiten_advantages=True)
            t["returns"] = ret
            metrics["critic/explained_var"] = _explained_variance(t["values"], ret, mask)
        elif a.name == "grpo":
            adv = algos.compute_grpo_advantages(token_rewards.sum(-1), group_ids, mask,
                                                norm_by_std=a.norm_adv_by_std)
        elif a.name == "rloo":
            adv = algos.compute_rloo_advantages(token_rewards.sum(-1), group_ids, mask)
        else:
            adv = algos.compute_reinforce_pp_advantages(token_rewards, mask, gamma=a.gamma)
        adv = adv[0] if isinstance(adv, tuple) else adv
        t["advantages"] = adv * mask
        if cfg.actor.use_kl_loss and "ref_logp" not in t:
            raise RuntimeError("actor.use_kl_loss needs the reference role (ref.enabled=true)")
        return t, metrics

    def check_reward_failures(self, step: int, adv_metrics: dict[str, float], *, num_samples: int) -> None:
        """Every rank sees the same merged failure count, so every rank stops here together."""
        frac, limit = adv_metrics.get("reward/failed_frac", 0.0), self.cfg.reward.stop_failed_fraction
        if frac < limit or frac == 0.0:
            return
        from ppo.rewards import RewardFailureError

        manager = getattr(self.roles.reward, "manager", None)
        errors = sorted({e for part in all_gather_objects(list(manager.errors.values()) if manager else [])
                         for e in part})
        raise RewardFailureError(
            f"step {step + 1}: the reward function ({self.cfg.reward.function}) failed on "
            f"{int(adv_metrics['reward/failed'])} of {num_samples} samples "
            f"({frac:.0%}, reward.stop_failed_fraction={limit:g}); the run stops instead of training on "
            f"reward.default_score. Distinct errors so far: " + " | ".join(errors[:5])
            + (f" (+{len(errors) - 5} more in logs/rank_*.log)" if len(errors) > 5 else ""))

    # ------------------------------------------------------------------ metrics
    def collect_metrics(self, step, exp, tensors, adv_metrics, actor_m, critic_m, times) -> dict[str, float]:
        roles = self.roles
        mine = {"times": times,
                "actor": actor_m if roles.actor is not None and roles.actor.is_owner else None,
                "critic": critic_m if roles.critic is not None and roles.critic.is_owner else None,
                "peak_gb": (torch.cuda.max_memory_allocated(self.env.device) / 2**30
                            if self.env.device.type == "cuda" else None),
                **host_memory_gb()}
        parts = all_gather_objects(mine)
        if self.env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.env.device)
        if self.rank != 0:
            return {}
        mask = tensors["mask"]
        resp_len = mask.sum(-1).float()
        m: dict[str, float] = {"step": step + 1, "reward/mean": float(tensors["scores"].mean()),
                               "reward/max": float(tensors["scores"].max()),
                               "response_length/mean": float(resp_len.mean()),
                               "response_length/max": float(resp_len.max()),
                               "response_length/clip_frac": float(sum(s.finish_reason == "length"
                                                                      for s in exp.samples) / len(exp.samples))}
        m.update(adv_metrics)
        for key, prefix in (("actor", "actor/"), ("critic", "critic/")):
            vals = [p[key] for p in parts if p[key]]
            for k in (vals[0] if vals else {}):
                m[prefix + k] = sum(v[k] for v in vals) / len(vals)
        if "actor/kl" not in m and "actor/kl_loss" in m:  # fused old log-probs: the KL loss term is the KL
            m["actor/kl"] = m["actor/kl_loss"]
        for stage in set().union(*(p["times"] for p in parts)):
            m[f"timing_s/{stage}"] = max(p["times"].get(stage, 0.0) for p in parts)
        step_s = m["timing_s/step"]
        n_tokens = float(sum(s.length for s in exp.samples))
        m["perf/samples_per_s"] = len(exp.samples) / step_s
        m["perf/tokens_per_s"] = n_tokens / step_s
        m.update(self.flop_metrics(exp, m))
        peaks = [p["peak_gb"] for p in parts if p["peak_gb"] is not None]
        if peaks:
            m["mem/peak_gb"] = max(peaks)
        # host memory per rank (offloaded optimizer states live there): now, and the process's peak so far
        m["mem/host_rss_gb"] = max(p["host_rss_gb"] for p in parts)
        m["mem/host_peak_gb"] = max(p["host_peak_gb"] for p in parts)
        return m

    def flop_metrics(self, exp: Experience, m: dict[str, float]) -> dict[str, float]:
        """Useful utilization (counted model FLOPs of the whole step over time x peak x GPUs) and the
        actor update's MFU, per DESIGN.md "Honest numbers"; against the H200's measured peak."""
        from ppo.flops import H200_PEAK_BF16_FLOPS, ppo_stage_flops

        n = self.state.model_params
        roles = self.plan.groups
        trained = sum(s.length for s in exp.samples)
        # shared prompts: each prompt is packed once per group of samples
        policy = sum(exp.prompt_units()[1]) if self.cfg.trainer.share_prompts else None
        flops = ppo_stage_flops(
            n_params_actor=n, n_params_critic=n if "critic" in roles else None,
            n_params_ref=n if "ref" in roles else None,
            n_params_rm=n if self.cfg.reward.type == "model" else None, trained_tokens=trained,
            generated_tokens=sum(len(s.response_ids) for s in exp.samples),
            prefill_tokens=sum(len(s.prompt_ids) for s in exp.samples) // max(1, self.cfg.rollout.n),
            ppo_epochs=self.cfg.actor.ppo_epochs,
            old_logp_forward=not (self.cfg.trainer.async_rollout or self.fused_old_logp), policy_tokens=policy)
        actor_s = m.get("timing_s/update_actor", 0.0)
        n_actor = len(roles["actor"].ranks)
        return {"perf/flops": sum(flops.values()),
                "perf/useful_util": sum(flops.values()) / m["timing_s/step"] / (self.plan.world_size
                                                                                * H200_PEAK_BF16_FLOPS),
                "perf/mfu/actor": flops["update_actor"] / actor_s / (n_actor * H200_PEAK_BF16_FLOPS)
                if actor_s > 0 else 0.0}

    # ------------------------------------------------------------------ validation
    def validation_due(self, step: int) -> bool:
        """After step (0-based) `step`: every trainer.test_freq steps and after the last one."""
        t = self.cfg.trainer
        return self.state.val_dataset is not None and (
            step + 1 == t.total_steps or (t.test_freq > 0 and (step + 1) % t.test_freq == 0))

    def validate(self, step: int) -> dict[str, float]:
        """val/* metrics on rank 0 ({} elsewhere); collective over the world."""
        from ppo.validation import run_validation

        r = self.cfg.rollout
        hb = self.heartbeat  # the GPU monitor tags these samples "val"; a stalled rank is reported in it
        timer = StageTimer(self.env.device, self.monitor, on_stage=None if hb is None else
                           lambda name: hb.set_stage(name, step))
        with timer("val"):
            m = run_validation(self.roles, self.state.val_dataset, step=step, seed=self.cfg.trainer.seed,
                               val_n=r.val_n, temperature=r.val_temperature,
                               threshold=self.cfg.reward.pass_threshold, rank=self.rank)
        if m:
            m["timing_s/val"] = timer.times["val"]
        return m

    # ------------------------------------------------------------------ loop
    def fit(self) -> str | None:
        """Train to trainer.total_steps; returns None, or why it stopped early (preemption)."""
        cfg = self.cfg
        start, self.pending = self.state.maybe_resume(self.roles)
        if start == 0 and cfg.trainer.sft_warmup_steps:
            self.roles.sft_warmup(self.state, steps=cfg.trainer.sft_warmup_steps, run_dir=self.run_dir)
        elif cfg.trainer.sft_warmup_steps:  # resumed: the reference is the warmed-up policy, not the init
            self.roles.load_reference(self.run_dir / "sft_warmup", critic_trunk=False)
        if self.state.val_dataset is not None and cfg.trainer.val_before_train and start == 0:
            self.state.log_metrics({"step": 0, **self.validate(0)})
        bar = self.state.progress(start)
        for step in range(start, cfg.trainer.total_steps):
            metrics = self.step(step)
            if self.validation_due(step):
                metrics.update(self.validate(step + 1))
            if self.monitor is not None:
                gpu = self.monitor.step_summary()
                # NVML's memory includes the allocator's cache: keep it apart from torch's mem/peak_gb
                if "mem/peak_gb" in gpu:
                    gpu["gpu/mem_peak_gb"] = gpu.pop("mem/peak_gb")
                metrics.update(gpu)
            if self.controller is not None:
                self.control(metrics)
            self.state.log_metrics(metrics)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{metrics.get('reward/mean', 0):.3f}")
            last = step + 1 == cfg.trainer.total_steps
            periodic = cfg.trainer.save_every and (step + 1) % cfg.trainer.save_every == 0
            stop, timed = self.at_step_end()
            if (last and cfg.trainer.save_final) or periodic or timed or stop:
                if self.heartbeat is not None:
                    self.heartbeat.set_stage("checkpoint", step)
                self.state.save(step + 1, self.roles, final=last, pending=self.pending)
                self.last_save = time.monotonic()
            if stop and not last:
                if self.rank == 0:
                    self.log.warning("stopping after step %d (%s); resume with trainer.resume=auto", step + 1, stop)
                break
        else:
            stop = None
        if bar is not None:
            bar.close()
        self.state.close()
        return stop

    def at_step_end(self) -> tuple[str | None, bool]:
        """Agreed by every rank (one tiny all-reduce): (why to stop, or None; whether the
        time-based checkpoint, trainer.save_every_minutes, is due)."""
        reason = self.stop_requested() if self.stop_requested is not None else None
        minutes = self.cfg.trainer.save_every_minutes
        due = minutes > 0 and time.monotonic() - self.last_save >= minutes * 60
        flags = torch.tensor([float(reason is not None), float(due)], device=self.env.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop = (reason or "another rank was asked to stop") if flags[0] > 0 else None
        return stop, bool(flags[1] > 0)


def _reward_extra_metrics(merged: dict[str, dict[int, torch.Tensor]]) -> dict[str, float]:
    """`reward/<key>/mean` for each extra numeric key of the reward function's dict results."""
    return {f"{k}/mean": float(torch.stack(list(v.values())).float().mean())
            for k, v in merged.items() if k.startswith("reward/") and v}


def host_memory_gb() -> dict[str, float]:
    """{"host_rss_gb": resident set now, "host_peak_gb": its peak so far} of this process (Linux /proc and
    getrusage; pinned host buffers are resident, so offloaded optimizer states count)."""
    import resource

    page = resource.getpagesize()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * page
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return {"host_rss_gb": rss / 2**30, "host_peak_gb": max(peak, rss) / 2**30}


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.float()
    var_r = algos.masked_var(returns, m)
    return float(1 - algos.masked_var(returns - values, m) / var_r.clamp_min(1e-8))


def run_training(cfg, *, plan, groups, env, run_dir, model_config, monitor=None, heartbeat=None,
                 stop_requested=None) -> str | None:
    """cfg: launcher.config.Config; monitor: an optional GPU monitor with set_stage/step_summary/stop.
    Returns None when trainer.total_steps were trained, else why the run stopped early."""
    trainer = PPOTrainer(cfg, plan=plan, groups=groups, env=env, run_dir=run_dir, model_config=model_config,
                         monitor=monitor, heartbeat=heartbeat, stop_requested=stop_requested)
    stopped = trainer.fit()
    if env.rank == 0 and stopped is None:
        logging.getLogger("hybridrl").info("done: %s", json.dumps({"run_dir": str(run_dir)}))
    if dist.is_initialized():
        dist.barrier()
    return stopped


__all__ = ["PPOTrainer", "run_training", "STAGES"]
