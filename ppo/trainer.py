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
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from launcher.config import Config, uses_critic, uses_ref
from launcher.log import get_logger
from ppo import core_algos as algos
from ppo.experience import Experience, Sample, all_gather_objects, merge_results, share_samples
from ppo.roles import build_roles
from ppo.state import TrainState

STAGES = ("gen", "reshard", "old_log_prob", "ref", "reward", "values", "adv", "update_actor", "update_critic")


class StageTimer:
    """Wall time per stage on this rank (device-synchronised), tagged into the GPU monitor."""

    def __init__(self, device: torch.device, monitor=None):
        self.device, self.monitor = device, monitor
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        if self.monitor is not None:
            self.monitor.set_stage(name)
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
    def __init__(self, cfg: Config, *, plan, groups, env, run_dir: Path, model_config):
        self.cfg, self.plan, self.env, self.run_dir = cfg, plan, env, Path(run_dir)
        self.log = get_logger()
        self.rank = env.rank
        self.state = TrainState.create(cfg, run_dir=self.run_dir, rank=env.rank)
        self.roles = build_roles(cfg, plan=plan, groups=groups, env=env, model_config=model_config,
                                 tokenizer=self.state.tokenizer, run_dir=self.run_dir)
        self.monitor = self._start_monitor()
        self.state.model_params = model_config.num_params()

    # ------------------------------------------------------------------ set-up
    def _start_monitor(self):
        if not self.cfg.monitor.enabled or self.env.local_rank != 0:
            return None
        from launcher.monitor import GpuMonitor

        return GpuMonitor(self.run_dir / "util.jsonl", interval_s=self.cfg.monitor.interval_s,
                          device_indices=None, rank=self.rank).start()

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict[str, float]:
        cfg, roles = self.cfg, self.roles
        timer = StageTimer(self.env.device, self.monitor)
        t_step = time.perf_counter()
        batch = self.state.next_prompts()

        # 1. generation on the actor ranks, then every rank holds every sample
        mine: list[Sample] = []
        if roles.rollout is not None:
            with timer("gen"):
                mine = roles.rollout.generate(batch, step=step, seed=cfg.trainer.seed, timer=timer)
            timer.times["gen"] -= timer.times.get("reshard", 0.0)  # gen is decoding; reshard its own stage
        exp = Experience(share_samples(mine))

        # 2. scoring: each group over its DP shard (concurrently in split placement)
        results: dict[str, dict[int, torch.Tensor]] = {}
        if roles.actor is not None:
            with timer("old_log_prob"):
                r = roles.actor.compute_logprobs(exp, roles.actor_minibatches(exp), with_entropy=True)
                results.update(old_logp=r["logp"], entropy=r["entropy"])
        if roles.ref is not None:
            with timer("ref"):
                results["ref_logp"] = roles.ref.compute_logprobs(exp, roles.ref_minibatches(exp))["logp"]
        if roles.critic is not None:
            with timer("values"):
                results.update(roles.critic.compute_values(exp, roles.critic_minibatches(exp)))
        if roles.reward is not None:
            with timer("reward"):
                results["score"] = roles.reward.score(exp)
        merged = merge_results(results)

        # 3. advantages: a pure function of the merged batch, computed identically on every rank
        with timer("adv"):
            tensors, adv_metrics = self.compute_advantages(exp, merged)

        # 4. updates: actor and critic groups (concurrent when placed apart)
        actor_m, critic_m = {}, {}
        if roles.actor is not None:
            with timer("update_actor"):
                actor_m = roles.update_actor(exp, tensors)
        if roles.critic is not None:
            with timer("update_critic"):
                critic_m = roles.update_critic(exp, tensors)
        timer.times["step"] = time.perf_counter() - t_step
        return self.collect_metrics(step, exp, tensors, adv_metrics, actor_m, critic_m, timer.times)

    def compute_advantages(self, exp: Experience, merged: dict[str, dict[int, torch.Tensor]]):
        """[B, R] tensors for the updates: mask, old_logp, advantages, (returns, values, ref_logp)."""
        cfg, a = self.cfg, self.cfg.algorithm
        mask = exp.response_mask()
        scores = torch.tensor([float(merged["score"][s.uid]) for s in exp.samples])
        token_rewards = algos.scores_to_token_rewards(scores, mask)
        t = {"mask": mask, "old_logp": exp.stack(merged["old_logp"]), "scores": scores}
        metrics: dict[str, float] = {}
        if merged.get("entropy"):
            metrics["actor/entropy"] = float(algos.masked_mean(exp.stack(merged["entropy"]), mask.float()))
        if "ref_logp" in merged:
            t["ref_logp"] = exp.stack(merged["ref_logp"])
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
            adv, ret = algos.compute_gae(token_rewards, t["values"], mask, gamma=a.gamma, lam=a.lam)
            t["returns"] = ret
            adv = algos.whiten(adv, mask)
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

    # ------------------------------------------------------------------ metrics
    def collect_metrics(self, step, exp, tensors, adv_metrics, actor_m, critic_m, times) -> dict[str, float]:
        roles = self.roles
        mine = {"times": times,
                "actor": actor_m if roles.actor is not None and roles.actor.is_owner else None,
                "critic": critic_m if roles.critic is not None and roles.critic.is_owner else None,
                "peak_gb": (torch.cuda.max_memory_allocated(self.env.device) / 2**30
                            if self.env.device.type == "cuda" else None)}
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
                m[prefix + _rename(k)] = sum(v[k] for v in vals) / len(vals)
        for stage in set().union(*(p["times"] for p in parts)):
            m[f"timing_s/{stage}"] = max(p["times"].get(stage, 0.0) for p in parts)
        step_s = m["timing_s/step"]
        n_tokens = float(sum(s.length for s in exp.samples))
        m["perf/samples_per_s"] = len(exp.samples) / step_s
        m["perf/tokens_per_s"] = n_tokens / step_s
        m["perf/mfu/actor"] = self.state.actor_mfu(exp, m.get("timing_s/update_actor", 0.0),
                                                   n_gpus=len(self.plan.groups["actor"].ranks))
        peaks = [p["peak_gb"] for p in parts if p["peak_gb"] is not None]
        if peaks:
            m["mem/peak_gb"] = max(peaks)
        return m

    # ------------------------------------------------------------------ loop
    def fit(self) -> None:
        cfg = self.cfg
        start = self.state.maybe_resume(self.roles)
        if start == 0 and cfg.trainer.sft_warmup_steps:
            self.roles.sft_warmup(self.state, steps=cfg.trainer.sft_warmup_steps)
        bar = self.state.progress(start)
        for step in range(start, cfg.trainer.total_steps):
            metrics = self.step(step)
            if self.monitor is not None:
                metrics.update(self.monitor.step_summary())
            self.state.log_metrics(metrics)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{metrics.get('reward/mean', 0):.3f}")
            last = step + 1 == cfg.trainer.total_steps
            if last or (cfg.trainer.save_every and (step + 1) % cfg.trainer.save_every == 0):
                self.state.save(step + 1, self.roles, final=last)
        if bar is not None:
            bar.close()
        if self.monitor is not None:
            self.monitor.stop()
        self.state.close()


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.float()
    var_r = algos.masked_var(returns, m)
    return float(1 - algos.masked_var(returns - values, m) / var_r.clamp_min(1e-8))


def _rename(k: str) -> str:
    return {"loss": "pg_loss", "vf_loss": "vf_loss"}.get(k, k)


def run_training(cfg: Config, *, plan, groups, env, run_dir, model_config) -> None:
    trainer = PPOTrainer(cfg, plan=plan, groups=groups, env=env, run_dir=run_dir, model_config=model_config)
    trainer.fit()
    if env.rank == 0:
        get_logger().info("done: %s", json.dumps({"run_dir": str(run_dir)}))
    if dist.is_initialized():
        dist.barrier()


__all__ = ["PPOTrainer", "run_training", "STAGES", "uses_critic", "uses_ref"]
