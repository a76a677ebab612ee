"""One PPO/GRPO step over the role groups of a device plan (PPOTrainer.step; the trainer wing's package docstring
shows the data flow), and run_training, the launcher's entry into the loop."""

from __future__ import annotations

import json
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ppo.batch.ahead import BatchesAhead, staleness_metrics
from ppo.batch.experience import Experience, all_gather_objects, merge_results
from ppo.batch.step_batch import ReferenceLogprobs, StepBatch, compute_step_batch
from ppo.control.budgets import TokenBudgets
from ppo.control.controller import BatchController, agree_feedback
from ppo.metrics.host_gc import GcPauses
from ppo.metrics.profiling import StepProfiler
from ppo.metrics.samples import SampleLog
from ppo.metrics.step_metrics import StepMetrics
from ppo.metrics.timing import DeviceSpan, StageTimer
from ppo.roles.build import build_roles
from ppo.roles.generation import sized_for_prompts
from ppo.roles.placement import Placement
from ppo.roles.step_plan import old_logp_share, old_logp_source, ref_beside_actor
from ppo.roles.workers import PendingResults
from ppo.run.state import TrainState
from ppo.settings import PPOSettings
from ppo.trainer.batches import BatchDrawing
from ppo.trainer.fit import FitLoop


@dataclass(frozen=True, slots=True)
class ReferenceRoute:
    """How a step's reference log-probs travel (PPOTrainer.reference_route); the default: waited for with the
    other scores."""

    defer: bool = False  # waited for after the advantages, not before
    on_device: bool = False  # the update reads them on the device (the reference placed exactly like the actor)
    span: DeviceSpan | None = None  # the reference's kernels, for its timing, when they stay on the device


class PPOTrainer(BatchDrawing, FitLoop):
    """One step on this rank over the role groups of the plan (`step`), the batch drawn by BatchDrawing
    (ppo/trainer/batches.py) and the run's steps looped by FitLoop (ppo/trainer/fit.py).

    `heartbeat` (set_stage(stage, step), e.g. launcher.watchdog.Watchdog) hears every stage;
    `stop_requested() -> reason | None` (launcher.preempt.StopRequest) is asked at each step end."""

    def __init__(self, *, settings: PPOSettings, placement: Placement, run_dir: Path, model_config,
                 monitor=None, heartbeat=None, stop_requested=None):
        """settings: the typed pieces the run state, the loop, the roles and the generation read
        (launcher/handoff.py); placement: this rank's plan, role groups and environment."""
        self.settings, self.loop = settings, settings.loop
        self.plan, self.run_dir = placement.plan, Path(run_dir)
        self.device = placement.device
        self.log = logging.getLogger("hybridrl")
        self.rank = placement.rank
        from ppo.run.resume import layout_of

        self.state = TrainState.create(settings.run, settings.data, reward=settings.reward,
                                       kl_control=settings.loop.advantages.kl_control,
                                       model_path=settings.build.model_path,
                                       sft_warmup=settings.loop.sft_warmup_steps > 0, run_dir=self.run_dir,
                                       rank=self.rank, layout=layout_of(self.plan))
        self.total_steps = self.state.total_steps  # trainer.total_epochs resolved from the data
        self.heartbeat, self.stop_requested = heartbeat, stop_requested
        self.last_save = time.monotonic()
        longest = max(ds.longest_prompt for ds in (self.state.dataset, self.state.val_dataset) if ds is not None)
        self.settings = settings = replace(settings, generation=sized_for_prompts(settings.generation, longest))
        self.roles = build_roles(settings, placement, model_config=model_config, tokenizer=self.state.tokenizer,
                                 total_steps=self.total_steps)
        self.monitor = monitor  # launcher.monitor.GpuMonitor on each node's first rank, or None
        loop = self.loop
        self.sample_log = None  # rank 0 shows a few samples every trainer.log_samples_every steps
        if self.rank == 0 and loop.log_samples_every:
            self.sample_log = SampleLog(self.run_dir, every=loop.log_samples_every, count=loop.log_samples_count,
                                        tokenizer=self.state.tokenizer)
        self.profiler = StepProfiler(loop.profile_steps, out_dir=self.run_dir / "profile", rank=self.rank,
                                     device=self.device)
        # trainer.max_staleness: the batches generated ahead (restored by fit() on resume)
        # (none with partial rollouts: rollout.batches_in_flight keeps prompts in flight instead)
        self.ahead_bound = 0 if loop.batches_in_flight > 1 else loop.max_staleness
        self.ahead = BatchesAhead(max_staleness=self.ahead_bound)
        self.gc_pauses = GcPauses()  # the collector's stalls of this rank's host, per step (host/gc_s)
        self.metrics = StepMetrics(plan=self.plan, rank=self.rank, device=self.device, model_config=model_config,
                                   gc_pauses=self.gc_pauses, n=settings.generation.n,
                                   ppo_epochs=settings.roles.actor_update.epochs,
                                   share_prompts=settings.build.share_prompts, reward_model=settings.reward.is_model,
                                   adapter_params=_adapter_params(settings.build.actor_lora, model_config))
        self.frozen_graphs = -1  # compiled graphs when the survivors were last frozen (trainer.gc_freeze)
        self.ref_beside_actor = ref_beside_actor(self.plan)
        if self.ref_beside_actor and self.roles.actor is not None:
            a, r = self.roles.actor, self.roles.ref
            if (a.pp_idx, a.dp_idx, a.tp_idx) != (r.pp_idx, r.dp_idx, r.tp_idx):
                raise RuntimeError(f"rank {self.rank}: the actor's mesh coordinates {(a.pp_idx, a.dp_idx, a.tp_idx)} "
                                   f"differ from the reference's {(r.pp_idx, r.dp_idx, r.tp_idx)} on the same ranks")
        self.first_nonfinite: str | None = None  # this rank's first non-finite quantity of the step, or None
        self.nonfinite_in_a_row = 0
        self.controller = None
        c = loop.controller
        if c.enabled:
            self.controller = BatchController(
                rollout_tokens=self.roles.rollout_token_budget(), micro_batch_tokens=loop.micro_batch_tokens["actor"],
                low_util=c.low_util, high_mem=c.high_mem, grow=c.grow, shrink=c.shrink,
                hysteresis_steps=c.hysteresis_steps)
        rollout = self.roles.rollout
        self.budgets = TokenBudgets(loop.micro_batch_tokens, controller=self.controller,
                                    max_oom_retries=c.max_oom_retries, rank=self.rank,
                                    set_rollout_tokens=None if rollout is None else rollout.set_token_budget)

    # ------------------------------------------------------------------ one step
    def old_logp_source(self, samples: int | None = None) -> str:
        """The step's old-log-prob source (ppo.roles.step_plan.old_logp_source), decided once per step from its
        batch's samples (default data.batch_size x rollout.n; an agent's cut trajectories make more)."""
        from ppo.algos.rollout_correction import resolve_mode

        s, update = self.settings, self.settings.roles.actor_update
        k = s.loop.max_staleness
        return old_logp_source(max_staleness=k, rollout_correction=resolve_mode(
                                   s.loop.advantages.rollout_correction, max_staleness=k), ppo_epochs=update.epochs,
                               mini_batch_size=update.mini_batch_size,
                               samples=samples or s.data.batch_size * s.generation.n,
                               kl_penalty_with_ref=s.loop.advantages.use_kl_penalty and "ref" in self.plan.groups)

    def score(self, exp: Experience, timer: StageTimer, *, old_logp: str, reward: bool = True,
              route: ReferenceRoute = ReferenceRoute()) -> tuple[dict, PendingResults | None]:
        """Each role group over its DP shard (concurrently in split placement); reward=False when
        dynamic sampling scored the samples already. old_logp: the step's old-log-prob source: "recompute"
        forwards the actor over the batch (with the entropy metric), "fused_first" over the mini-batches after the
        first (the update measures the entropy), the others not at all. The forwards (old log-probs, reference,
        values) are enqueued first and waited for last: rule rewards are scored on the host while their kernels
        run.
        route.defer: the reference's forward is not waited for but returned, still running (for
        reference_logprobs); route.span marks its device time. -> (results by key, the deferred reference pass
        on this rank's reference ranks, else None)."""
        roles, results, launched = self.roles, {}, {}
        if roles.actor is not None and old_logp in ("recompute", "fused_first"):
            later = old_logp == "fused_first"  # the first mini-batch's are its update forward's
            with timer("old_log_prob", sync=False):
                launched["old_log_prob"] = self.budgets.run("old_log_prob", "actor", lambda b: (
                    roles.actor.launch_logprobs(exp, roles.actor_plan(exp, b)[1 if later else 0:],
                                                with_entropy=not later)))
        if roles.ref is not None:
            with timer("ref", sync=False), route.span or nullcontext():
                launched["ref"] = self.budgets.run("ref", "ref", lambda b: roles.ref.launch_logprobs(
                    exp, roles.ref_plan(exp, b)))
        if roles.critic is not None:
            with timer("values", sync=False):
                launched["values"] = self.budgets.run("values", "critic", lambda b: (
                    roles.critic.launch_values(exp, roles.critic_plan(exp, b))))
        if roles.reward is not None and reward:
            with timer("reward", sync=False):  # a reward model's forward waits for its own outputs
                results.update(roles.reward.score(exp))  # score, reward_failed (rule functions), reward/<key>
        deferred = launched.pop("ref", None) if route.defer else None
        for stage, pending in launched.items():  # each stage's wait: its one device -> host copy
            with timer(stage):
                results.update(_step_keys(stage, pending.result()))
        return results, deferred

    def step(self, step: int) -> dict[str, float]:
        """One step, in the order of the data flow (docs/design.md): batch, scoring, advantages, updates."""
        timer = self.stage_timer(step)
        t_step = time.perf_counter()
        # 1. the batch: generated now (on-policy), up to trainer.max_staleness steps ago (generated ahead), or,
        #    with DAPO's dynamic sampling, generated and scored in rounds until every group carries signal
        generated = [] if len(self.ahead) else None  # the batches this step generates (None: its own, now)
        exp, gen, rewards, sampling_m = self.draw_batch(step, timer)
        generated = [exp] if generated is None else generated
        try:  # partial rollouts with rollout.decode_beside: the groups in flight decode on until the updates end
            # 2. scoring: old log-probs (see old_logp_source), reference, values, rewards
            old_logp = self.old_logp_source(len(exp.samples))
            route = self.reference_route(old_logp)
            results, ref_pass = self.score(exp, timer, old_logp=old_logp, reward=rewards is None, route=route)
            for index in self.ahead.to_generate(step=step, total_steps=self.total_steps):
                # the actor ranks generate batches up to k+K with this step's weights while the others score batch k
                ahead, gen = self.generate(index, timer, version=step)
                self.ahead.push(ahead)
                generated.append(ahead)
            merged = self.merge_scores(exp, results, rewards, old_logp=old_logp)
            # 3. advantages: a pure function of the merged batch, computed identically on every rank; the
            #    deferred reference forward may still run meanwhile (host work)
            with timer("adv", sync=False):
                ref = self.reference_logprobs(exp, merged, ref_pass, route=route, timer=timer)
                batch, adv_metrics = self.compute_advantages(exp, merged, old_logp=old_logp, ref_logp=ref.host,
                                                             step=step)
            batch.ref_logp = ref.get()  # deferred: waited for (and merged) now, or left on the device for the update
            adv_metrics.update(sampling_m)
            if self.loop.max_staleness:
                adv_metrics.update(staleness_metrics(exp, step=step, generated=generated, ahead=len(self.ahead)))
            self.check_reward_failures(step, adv_metrics, num_samples=len(exp.samples))
            # 4. updates: actor and critic groups (concurrent when placed apart); none on non-finite advantages (the
            #    same on every rank: a function of the merged batch)
            self.first_nonfinite = nonfinite_inputs(batch)
            actor_m = critic_m = None
            if self.first_nonfinite is None:
                actor_m = self.update_actor(exp, batch, timer, old_logp=old_logp, ref_span=route.span)
                critic_m = self.update_critic(exp, batch, timer)
                self.first_nonfinite = next((f"{name}: {w.first_nonfinite}" for name, w in
                                             (("actor", self.roles.actor), ("critic", self.roles.critic))
                                             if w is not None and w.first_nonfinite is not None), None)
        finally:
            gen.metrics.update(self.roles.rollout.end_beside() if self.roles.rollout is not None else {})
        timer.times["step"] = time.perf_counter() - t_step
        if self.sample_log is not None and self.sample_log.due(step):
            self.sample_log.write(step, exp.samples, batch.scores, tensorboard=self.state.tensorboard())
        return self.metrics.collect(step, exp, batch, adv_metrics, actor_m, critic_m, timer.times,
                                    gen_metrics=gen.metrics, old_logp_share=old_logp_share(
                                        old_logp, mini_batch_size=self.settings.roles.actor_update.mini_batch_size,
                                        samples=len(exp.samples)))

    def stage_timer(self, step: int) -> StageTimer:
        """The step's stage timer: the heartbeat hears each stage, the profiler marks them on profiled steps."""
        hb = self.heartbeat
        return StageTimer(self.device, self.monitor, on_stage=None if hb is None else
                          lambda name: hb.set_stage(name, step), annotate=self.profiler.due(step))

    def reference_route(self, old_logp: str) -> ReferenceRoute:
        """How the reference's log-probs reach the update. They feed only the loss unless they shape the rewards
        (KL penalty) or a KL metric against old log-probs: then the advantages are computed while the reference's
        forward still runs (deferred). Placed on the actor's ranks alike, they even stay on the device: the update
        reads them there and is enqueued right behind the reference's forward, with no wait between. The same
        on every rank (a function of the plan and the settings)."""
        deferred = ("ref" in self.plan.groups and old_logp in ("fused", "fused_first")
                    and not self.loop.advantages.use_kl_penalty)
        on_device = deferred and self.ref_beside_actor
        return ReferenceRoute(defer=deferred, on_device=on_device, span=DeviceSpan(self.device) if on_device else None)

    def merge_scores(self, exp: Experience, results: dict, rewards: dict | None, *, old_logp: str) -> dict:
        """Every sample's results on every rank (a collective): scores shaped (DAPO's overlong penalty) unless
        the generation rounds scored them already; the engine's log-probs as old log-probs when generated ahead."""
        merged = merge_results(results)
        if rewards is not None:
            merged.update(rewards)
        else:
            merged["score"] = self.shape_scores(exp, merged["score"])
        if old_logp == "behaviour":
            merged["old_logp"] = {s.uid: torch.tensor(s.behaviour_logprobs) for s in exp.samples}
        return merged

    def reference_logprobs(self, exp: Experience, merged: dict, ref_pass: PendingResults | None, *,
                           route: ReferenceRoute, timer: StageTimer) -> ReferenceLogprobs:
        """The step's reference log-probs as one handle (ppo.batch.step_batch.ReferenceLogprobs): the host rows
        merged with the other scores, the rows the deferred pass leaves on the device (route.on_device; none on
        the ranks that computed none), or that pass still running: the handle's get() waits for it and merges
        every rank's rows, a collective every rank makes, with or without the reference role."""
        if "ref" not in self.plan.groups:
            if self.loop.advantages.use_kl_loss:
                raise RuntimeError("actor.use_kl_loss needs the reference role (ref.enabled=true)")
            return ReferenceLogprobs()
        if "ref_logp" in merged:
            return ReferenceLogprobs(exp.stack(merged["ref_logp"]))
        if route.on_device:
            return ReferenceLogprobs(None if ref_pass is None else ref_pass.logp_rows)

        def wait() -> torch.Tensor:
            with timer("ref"):
                mine = {} if ref_pass is None else {"ref_logp": ref_pass.result()["logp"]}
            return exp.stack(merge_results(mine)["ref_logp"])

        return ReferenceLogprobs(wait=wait)

    def update_actor(self, exp: Experience, batch: StepBatch, timer: StageTimer, *, old_logp: str,
                     ref_span: DeviceSpan | None) -> dict | None:
        """The actor group's PPO epochs (None off the actor's metric owners). ref_span: the reference's kernels,
        when the update reads its log-probs on the device right behind them."""
        actor = self.roles.actor
        if actor is None:
            return None
        with timer("update_actor"):
            m = self.budgets.run("update_actor", "actor", lambda b: self.roles.update_actor(
                exp, batch, max_tokens=b, old_logp=old_logp),
                retry_safe=lambda: actor.optimizer_steps_in_update == 0)
        if ref_span is not None:  # the reference's kernels that ran on into the update's window count as its own
            overlap = timer.starts["ref"] + ref_span.seconds() - timer.starts["update_actor"]
            timer.carve("update_actor", "ref", min(max(0.0, overlap), timer.times["update_actor"]))
        return m if actor.is_owner else None

    def update_critic(self, exp: Experience, batch: StepBatch, timer: StageTimer) -> dict | None:
        """The critic group's value updates (None off the critic's metric owners)."""
        critic = self.roles.critic
        if critic is None:
            return None
        with timer("update_critic"):
            m = self.budgets.run("update_critic", "critic", lambda b: self.roles.update_critic(
                exp, batch, max_tokens=b), retry_safe=lambda: critic.optimizer_steps_in_update == 0)
        return m if critic.is_owner else None

    def control(self, metrics: dict[str, float]) -> None:
        """Step boundary only: the batch controller resizes the token budgets from this step's GPU
        utilization (the monitor's gpu/util_mean, a fraction in [0, 1]) and peak memory fraction."""
        util, mem = agree_feedback(metrics.get("gpu/util_mean"), self.memory_fraction())
        metrics.update(self.budgets.control(util_mean=util, mem_frac=mem))

    def memory_fraction(self) -> float | None:
        """This rank's peak reserved device memory over the device's total (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        total = torch.cuda.get_device_properties(self.device).total_memory
        return min(1.0, torch.cuda.max_memory_reserved(self.device) / total)

    def compute_advantages(self, exp: Experience, merged: dict[str, dict[int, torch.Tensor]], *, old_logp: str,
                           ref_logp: torch.Tensor | None = None, step: int = 0) -> tuple[StepBatch, dict[str, float]]:
        """ppo.batch.step_batch.compute_step_batch with this run's settings; the KL the in-reward penalty observed
        moves the run's KL controller here. ref_logp: [B, R] the reference's log-probs when they are here
        already; step: the step training (the tokens' version gaps). -> (the step's batch, metrics)."""
        a = self.loop.advantages
        kl_ctrl = self.state.kl_ctrl if a.use_kl_penalty else None
        batch, metrics, kl_seen = compute_step_batch(
            exp, merged, a=a, n=self.settings.generation.n,
            max_response_length=self.settings.generation.max_response_length,
            kl_coef=None if kl_ctrl is None else kl_ctrl.value, old_logp=old_logp, ref_logp=ref_logp,
            # (only where the split is computed: the recomputed old log-probs of decoupled PPO)
            token_staleness=exp.token_staleness(step) if self.loop.max_staleness and old_logp == "recompute" else None)
        if kl_seen is not None:
            kl_ctrl.update(kl_seen, n_steps=len(exp.samples))
        return batch, metrics

    def check_reward_failures(self, step: int, adv_metrics: dict[str, float], *, num_samples: int) -> None:
        """Every rank sees the same merged failure count, so every rank stops here together
        (ppo.data.rewards.should_stop; the distinct errors are gathered from every rank)."""
        from ppo.data.rewards import failure_error, should_stop

        limit = self.settings.reward.stop_failed_fraction
        if not should_stop(adv_metrics.get("reward/failed_frac", 0.0), limit):
            return
        manager = getattr(self.roles.reward, "manager", None)
        errors = sorted({e for part in all_gather_objects(list(manager.errors.values()) if manager else [])
                         for e in part})
        raise failure_error(step=step, failed=int(adv_metrics["reward/failed"]), num_samples=num_samples,
                            limit=limit, function=self.settings.reward.function, errors=errors)



def nonfinite_inputs(batch: StepBatch) -> str | None:
    """The first of the update's inputs holding NaN or inf ("advantages", "returns", ...), or None."""
    for name in ("scores", "advantages", "returns"):
        t = getattr(batch, name)
        if t is not None and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            return f"{name} ({bad} of {t.numel()} values NaN or inf); the actor and critic updates skipped"
    return None


def _step_keys(stage: str, results: dict) -> dict:
    """A scoring pass's results under the keys of the step's merged results."""
    if stage == "old_log_prob":
        return {"old_logp": results["logp"], "entropy": results["entropy"]}
    return {"ref_logp": results["logp"]} if stage == "ref" else results


def _adapter_params(lora, model_config) -> int:
    """A LoRA actor's adapter parameter count (0 for full-parameter training): the FLOP accounting's A."""
    if lora is None:
        return 0
    from models.lora import LoRASpec, adapter_param_count

    return adapter_param_count(model_config, LoRASpec(rank=lora.rank, alpha=lora.alpha,
                                                      target_modules=tuple(lora.target_modules)))


def run_training(*, settings: PPOSettings, placement: Placement, run_dir, model_config, monitor=None,
                 heartbeat=None, stop_requested=None) -> str | None:
    """settings: launcher/handoff.py's typed pieces; placement: this rank's plan, groups and environment;
    monitor: an optional GPU monitor with set_stage/step_summary/stop. Returns None when the run's steps
    were trained, else why the run stopped early."""
    trainer = PPOTrainer(settings=settings, placement=placement, run_dir=run_dir,
                         model_config=model_config, monitor=monitor, heartbeat=heartbeat,
                         stop_requested=stop_requested)
    try:
        stopped = trainer.fit()
    finally:
        if hasattr(trainer.roles.reward, "close"):
            trainer.roles.reward.close()
    if placement.rank == 0 and stopped is None:
        logging.getLogger("hybridrl").info("done: %s", json.dumps({"run_dir": str(run_dir)}))
    if dist.is_initialized():
        dist.barrier()
    return stopped


__all__ = ["PPOTrainer", "ReferenceRoute", "run_training"]
