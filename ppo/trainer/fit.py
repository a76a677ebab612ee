"""The trainer's loop over the run's steps (ppo.trainer.step.PPOTrainer.fit): resume or the supervised warm-up,
each step under the profiler when due, validation, the GPU monitor's summary, the batch controller, the step-end
agreement (stop, time-based checkpoint, non-finite steps), checkpoints, and the collector frozen after warm-up."""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist

from ppo.batch.experience import all_gather_objects
from ppo.metrics.host_gc import freeze_survivors
from ppo.metrics.timing import StageTimer, compiled_graphs
from ppo.roles.generation import settle_residency
from ppo.run.checkpoint import seal_directory, verify_sealed


class NonFiniteStepsError(RuntimeError):
    """trainer.max_nonfinite_steps steps in a row were not applied (non-finite loss, gradient norm or advantages);
    the launcher exits with code 2, the last checkpoint untouched."""


class FitLoop:
    """PPOTrainer's loop (module docstring); runs the trainer's step()."""

    def validation_due(self, step: int) -> bool:
        """After step (0-based) `step`: every trainer.test_freq steps and after the last one."""
        every = self.loop.test_freq
        return self.state.val_dataset is not None and (
            step + 1 == self.total_steps or (every > 0 and (step + 1) % every == 0))

    def validate(self, step: int) -> dict[str, float]:
        """val/* metrics on rank 0 ({} elsewhere); collective over the world."""
        from ppo.roles.validation import run_validation

        loop = self.loop
        hb = self.heartbeat  # the GPU monitor tags these samples "val"; a stalled rank is reported in it
        timer = StageTimer(self.device, self.monitor, on_stage=None if hb is None else
                           lambda name: hb.set_stage(name, step))
        with timer("val"):
            m = run_validation(self.roles, self.state.val_dataset, step=step, seed=self.settings.run.seed,
                               val_n=loop.val_n, temperature=loop.val_temperature,
                               threshold=self.settings.reward.pass_threshold, rank=self.rank)
        if m:
            m["timing_s/val"] = timer.times["val"]
        return m

    def fit(self) -> str | None:
        """Train to trainer.total_steps; returns None, or why it stopped early (preemption)."""
        loop = self.loop
        start, self.ahead = self.state.maybe_resume(self.roles, controller=self.controller,
                                                    max_staleness=self.ahead_bound)
        if start == 0 and loop.sft_warmup_steps:
            self.roles.sft_warmup(self.state, steps=loop.sft_warmup_steps, max_tokens=loop.micro_batch_tokens["actor"],
                                  run_dir=self.run_dir)
            if self.rank == 0:  # the reference a resume reloads: checked like a checkpoint's files
                seal_directory(self.run_dir / "sft_warmup")
        elif loop.sft_warmup_steps:  # resumed: the reference is the warmed-up policy, not the init
            verify_sealed(self.run_dir / "sft_warmup")
            self.roles.load_reference(self.run_dir / "sft_warmup", critic_trunk=False)
        if self.state.val_dataset is not None and loop.val_before_train and start == 0:
            self.state.log_metrics({"step": 0, **self.validate(0)})
        bar = self.state.progress(start)
        for step in range(start, self.total_steps):
            with self.profiler.around(step):
                metrics = self.step(step)
            if step == start and self.settings.generation.settle_residency and self.device.type == "cuda":
                decision = settle_residency(self.roles.rollout, train_peak=self.metrics.train_peak)
                if self.rank == 0:
                    self.log.info("auto: %s", decision)
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
            stop, timed, nonfinite = self.at_step_end()
            self.count_nonfinite(step, nonfinite, metrics)
            self.state.log_metrics(metrics)
            if self.nonfinite_in_a_row >= loop.max_nonfinite_steps:
                raise NonFiniteStepsError(f"{self.nonfinite_in_a_row} steps in a row (up to step {step + 1}) had "
                                          f"non-finite values and were not applied (trainer.max_nonfinite_steps="
                                          f"{loop.max_nonfinite_steps}); the last: {nonfinite}. The run stops with "
                                          f"its last checkpoint untouched; look for NaN/inf in the data, rewards or "
                                          f"learning rate, or lower the learning rate")
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{metrics.get('reward/mean', 0):.3f}")
            last = step + 1 == self.total_steps
            periodic = loop.save_every and (step + 1) % loop.save_every == 0
            if (last and loop.save_final) or periodic or timed or stop:
                if self.heartbeat is not None:
                    self.heartbeat.set_stage("checkpoint", step)
                self.state.save(step + 1, self.roles, final=last, ahead=self.ahead, controller=self.controller)
                self.last_save = time.monotonic()
            if stop and not last:
                if self.rank == 0:
                    self.log.warning("stopping after step %d (%s); resume with trainer.resume=auto", step + 1, stop)
                break
            if loop.gc_freeze and not last:
                self.freeze_after_warmup(step)
        else:
            stop = None
        if bar is not None:
            bar.close()
        self.state.close()
        if self.frozen_graphs >= 0:  # the frozen objects go back to the collector
            gc.unfreeze()
        self.gc_pauses.close()
        return stop

    def freeze_after_warmup(self, step: int) -> None:
        """After the first step and any step that compiled a graph: collect, then freeze the survivors
        (ppo.metrics.host_gc). Rank-local, no collective. Its pause falls between steps and is logged, not counted
        in the next step's host/gc_s."""
        graphs = compiled_graphs()
        if graphs == self.frozen_graphs:
            return
        frozen, seconds = freeze_survivors()
        self.gc_pauses.take()
        self.frozen_graphs = graphs
        if self.rank == 0:
            self.log.info("gc: after step %d, %d objects frozen out of full collections (%.3f s)",
                          step + 1, frozen, seconds)

    def at_step_end(self) -> tuple[str | None, bool, str | None]:
        """Agreed by every rank (one tiny all-reduce): (why to stop, or None; whether the
        time-based checkpoint, trainer.save_every_minutes, is due; the step's first non-finite quantity, any
        rank's, or None when the whole step was applied)."""
        reason = self.stop_requested() if self.stop_requested is not None else None
        minutes = self.loop.save_every_minutes
        due = minutes > 0 and time.monotonic() - self.last_save >= minutes * 60
        flags = torch.tensor([float(reason is not None), float(due), float(self.first_nonfinite is not None)],
                             device=self.device)
        multi = dist.is_initialized() and dist.get_world_size() > 1
        if multi:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop = (reason or "another rank was asked to stop") if flags[0] > 0 else None
        nonfinite = None
        if flags[2] > 0:  # rare: every rank learns what was not finite, and where
            seen = all_gather_objects(self.first_nonfinite) if multi else [self.first_nonfinite]
            nonfinite = next(f"rank {r}: {s}" for r, s in enumerate(seen) if s is not None)
        return stop, bool(flags[1] > 0), nonfinite

    def count_nonfinite(self, step: int, nonfinite: str | None, metrics: dict[str, float]) -> None:
        """train/nonfinite_skipped (1: some or all of the step's update was not applied) and the run of such steps
        in a row, which trainer.max_nonfinite_steps bounds."""
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if nonfinite else 0
        if self.rank == 0:
            metrics["train/nonfinite_skipped"] = float(nonfinite is not None)
            if nonfinite:
                self.log.warning("step %d: non-finite %s: not applied (%d in a row, trainer.max_nonfinite_steps=%d)",
                                 step + 1, nonfinite, self.nonfinite_in_a_row, self.loop.max_nonfinite_steps)
