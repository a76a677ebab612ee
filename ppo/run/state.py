"""Everything of a run that is not a model: tokenizer, prompts and their sampler, the KL
controller, metrics sinks (metrics.jsonl, TensorBoard, W&B, progress bar), checkpoint
save/resume.

    state = TrainState.create(settings.run, settings.data, reward=settings.reward,
                              kl_control=settings.loop.advantages.kl_control, model_path=settings.build.model_path,
                              sft_warmup=settings.loop.sft_warmup_steps > 0, run_dir=run_dir, rank=rank)
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch.distributed as dist

from ppo.algos import core_algos as algos
from ppo.settings import DataSettings, KLControlSettings, RewardSettings, RunSettings

LEDGER = "prompts.jsonl"  # the prompt ledger: a row per draw (step, epoch, dataset rows) and per drop (step, dropped)


class TrainState:
    def __init__(self, run: RunSettings, data: DataSettings, *, total_steps: int, run_dir: Path, rank: int,
                 tokenizer, dataset, sampler, kl_ctrl, layout: dict | None = None, val_dataset=None):
        """total_steps: the run's steps (trainer.total_epochs resolved against the data);
        layout: the device plan's layout (ppo.run.resume.layout_of), saved in checkpoints and checked on resume."""
        self.run, self.data, self.total_steps = run, data, total_steps
        self.run_dir, self.rank, self.layout = run_dir, rank, layout
        self.tokenizer, self.dataset, self.sampler, self.kl_ctrl = tokenizer, dataset, sampler, kl_ctrl
        self.val_dataset = val_dataset  # data.val_files, or None
        self.log = logging.getLogger("hybridrl")
        self._tb = None
        self.resumed_at = 0  # steps after it written by an earlier attempt are superseded (metrics, TensorBoard)
        self._wandb = None

    @classmethod
    def create(cls, run: RunSettings, data: DataSettings, *, reward: RewardSettings, kl_control: KLControlSettings,
               model_path: str | None, sft_warmup: bool, run_dir: Path, rank: int,
               layout: dict | None = None) -> TrainState:
        """model_path: the policy's weights (where model.tokenizer=auto finds its tokenizer); sft_warmup: the run
        starts with the supervised warm-up (data.train_files must then hold answers)."""
        from ppo.data.prompts import PromptDataset, PromptSampler, check_sft_answers
        from ppo.data.tokenizer import load_tokenizer, resolve_tokenizer

        tok_spec = resolve_tokenizer(data.tokenizer, model_path)
        tok = load_tokenizer(tok_spec)
        if rank == 0 and data.tokenizer == "auto":
            why = "from model.path" if model_path and tok_spec == model_path else (
                "model.path has no tokenizer.json" if model_path else "no model.path")
            logging.getLogger("hybridrl").info("tokenizer: %s (%s; set model.tokenizer to choose another)",
                                               tok_spec, why)
        d = data
        keys = dict(tokenizer=tok, prompt_key=d.prompt_key, answer_key=d.answer_key,
                    max_prompt_length=d.max_prompt_length)
        val_dataset = PromptDataset.from_files(list(d.val_files), **keys) if d.val_files else None
        if d.train_files:
            dataset = PromptDataset.from_files(list(d.train_files), **keys)
            if sft_warmup:
                check_sft_answers(dataset, answer_key=d.sft_answer_key)
        else:
            dataset = PromptDataset.from_task(d.task, d.task_size, seed=run.seed, tokenizer=tok,
                                              max_prompt_length=d.max_prompt_length)
        if len(dataset) < d.batch_size:
            from ppo.data.prompts import DataError

            raise DataError(f"the prompt data holds {len(dataset)} usable prompts, fewer than data.batch_size "
                            f"({d.batch_size})")
        sampler = PromptSampler(len(dataset), batch_size=d.batch_size, seed=run.seed, shuffle=d.shuffle)
        if not reward.is_model:
            check_reward_columns(reward, [*dataset.columns, *(val_dataset.columns if val_dataset else [])])
        return cls(run, data, total_steps=total_steps(run, sampler.batches_per_epoch), run_dir=run_dir, rank=rank,
                   tokenizer=tok, dataset=dataset, sampler=sampler, kl_ctrl=build_kl_controller(kl_control),
                   layout=layout, val_dataset=val_dataset)

    # ------------------------------------------------------------------ data
    def next_prompts(self, step: int) -> list[dict]:
        """The next prompts, drawn while (0-based) `step` runs, identical on every rank: [{index, prompt_ids,
        ground_truth}]. Rank 0 records the draw in the prompt ledger (<run>/prompts.jsonl: the 1-based step it was
        drawn in, the epoch, the dataset rows); a resume at step k supersedes the draws made after k."""
        idx = self.sampler.next_batch()
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / LEDGER, "a") as f:
                f.write(json.dumps({"step": step + 1, "epoch": self.sampler.epoch, "rows": [int(j) for j in idx]})
                        + "\n")
        # source: the draw's ledger entry, [epoch, dataset row] (a dropped partial rollout is recorded by it)
        return [dict(index=i, source=[self.sampler.epoch, int(j)], **self.dataset.row(j)) for i, j in enumerate(idx)]

    def record_dropped(self, step: int, sources: list[list[int] | None]) -> None:
        """Rank 0 records in the prompt ledger the prompts whose groups were dropped in (0-based) `step`
        (trainer.stale_policy=drop), by their rows' `source` ([epoch, dataset row]; None: a row drawn before the
        key existed): {"step", "dropped"}, superseded on resume like the draws. Nothing dropped: no row."""
        if self.rank == 0 and sources:
            with open(self.run_dir / LEDGER, "a") as f:
                f.write(json.dumps({"step": step + 1, "dropped": sources}) + "\n")

    def sft_batch(self, i: int) -> list[tuple[list[int], list[int]]]:
        """Warm-up batch i: (prompt ids, answer ids + eos) from data.train_files, else the synthetic task."""
        d, seed = self.data, self.run.seed * 7919 + i
        if d.train_files:
            from ppo.data.prompts import sft_pairs

            return sft_pairs(self.dataset, d.batch_size, seed=seed, tokenizer=self.tokenizer,
                             answer_key=d.sft_answer_key)
        from ppo.data.tasks import sft_examples

        return sft_examples(d.task, d.batch_size, seed=seed, tokenizer=self.tokenizer)

    # ------------------------------------------------------------------ metrics
    def log_metrics(self, m: dict[str, float]) -> None:
        if self.rank != 0 or not m:
            return
        clean = {k: (float(v) if isinstance(v, (int, float)) and math.isfinite(float(v)) else None)
                 for k, v in m.items()}
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(clean) + "\n")
        step = int(m["step"])
        if (tb := self.tensorboard()) is not None:
            for k, v in clean.items():
                if v is not None and k != "step":
                    tb.add_scalar(k, v, step)
        if self.run.wandb:
            self._log_wandb(clean, step)
        if self.run.progress_bar and step % 10 and step != self.total_steps:
            return  # the bar shows progress; a metrics line every 10 steps keeps the console readable
        keys = ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/kl", "critic/vf_loss",
                "timing_s/step", "perf/samples_per_s", "val/reward/mean", "val/pass@1")
        self.log.info("step %d: %s", step, " ".join(f"{k}={clean[k]:.4g}" for k in keys
                                                      if clean.get(k) is not None))

    def tensorboard(self):
        """Rank 0's SummaryWriter on <run dir>/tensorboard (created on first use), or None when off."""
        if self.rank != 0 or not self.run.tensorboard:
            return None
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides the events an earlier attempt wrote for the steps this one re-runs
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=self.resumed_at + 1)
        return self._tb

    def _log_wandb(self, m: dict, step: int) -> None:
        try:
            import wandb
        except ImportError:
            if self._wandb is None:
                self.log.warning("trainer.wandb=true but wandb is not installed (pip install wandb); skipping")
                self._wandb = False
            return
        if self._wandb is None:
            self._wandb = wandb.init(project=self.run.wandb_project, name=self.run.experiment_name,
                                     config=self.run.config_record, dir=str(self.run_dir),
                                     **wandb_resume_args(self.run_dir, resumed_at=self.resumed_at))
        if self._wandb:
            wandb.log({k: v for k, v in m.items() if v is not None}, step=step)

    def progress(self, start: int):
        if self.rank != 0 or not self.run.progress_bar:
            return None
        from tqdm import tqdm

        return tqdm(total=self.total_steps, initial=start, desc="ppo", unit="step", dynamic_ncols=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int, roles, *, final: bool, ahead=None, controller=None) -> Path:
        """Checkpoint `step`: every rank's workers and RNG, the sampler, KL and batch controllers and the
        batches generated ahead (`ahead`, ppo.batch.ahead.BatchesAhead). Collective over the world."""
        from ppo.run.checkpoint import capture_rng_state, save_checkpoint

        per_rank = {"rng": capture_rng_state(), "workers": roles_state(roles)}
        shared = {"step": step, "sampler": self.sampler.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                  # plain dicts: checkpoints load with torch.load(weights_only=True)
                  "ahead": ahead.state_dict() if ahead is not None else [],
                  "layout": self.layout,
                  "controller": controller.state_dict() if controller is not None else None}
        path = save_checkpoint(self.run_dir, step, rank=self.rank, world_size=dist.get_world_size(),
                               per_rank_state=per_rank, shared_state=shared,
                               export=(lambda tmp: export_weights(roles, tmp))
                               if final or self.run.export_hf == "every_save" else None,
                               keep_last=self.run.keep_last)
        if self.rank == 0:
            self.log.info("checkpoint %s", path)
        return path

    def maybe_resume(self, roles, *, controller=None, max_staleness: int = 0):
        """Restore the newest complete checkpoint when trainer.resume asks (into roles, this state and
        the batch controller). Returns (start step, the batches generated ahead: ppo.batch.ahead.BatchesAhead
        bounded by max_staleness, empty when starting fresh)."""
        from ppo.batch.ahead import BatchesAhead
        from ppo.run.checkpoint import checkpoint_world_size, load_checkpoint, load_shared_state, restore_rng_state
        from ppo.run.relayout import check_same_backend, converted_roles, is_relayout
        from ppo.run.resume import select_checkpoint, supersede_metrics

        mode = self.run.resume
        fresh = BatchesAhead(max_staleness=max_staleness)
        if mode == "never":
            return 0, fresh
        world = dist.get_world_size() if dist.is_initialized() else 1
        if mode == "auto":
            path = select_checkpoint(self.run_dir, policy=self.run.on_damaged_checkpoint, rank=self.rank,
                                     world_size=world)
        else:
            path = Path(mode)
        if path is None:
            if self.rank == 0:
                self.log.info("trainer.resume=auto: no checkpoint in %s, starting fresh", self.run_dir)
            supersede_metrics(self.run_dir, step=-1, rank=self.rank)  # the fresh start writes every row again
            supersede_metrics(self.run_dir, step=-1, rank=self.rank, name=LEDGER)
            return 0, fresh
        shared = load_shared_state(path)
        saved_world = checkpoint_world_size(path)
        relayout = is_relayout(shared.get("layout"), saved_world, self.layout, world)
        if not relayout:
            per_rank, shared = load_checkpoint(path, rank=self.rank)
            _agree(lambda: check_same_backend(path, per_rank["workers"], roles))
            # a megatron-trained role resuming with the native backend is converted from every saved rank's state:
            # the relayout path, at this layout too
            relayout = _any_rank(bool(converted_roles(per_rank["workers"], roles)))
        if relayout:
            self._load_relayout(path, roles, shared=shared, saved_world=saved_world, world=world)
        else:
            load_roles_state(roles, per_rank["workers"])
            restore_rng_state(per_rank["rng"])
        self.sampler.load_state_dict(shared["sampler"])
        self.kl_ctrl.load_state_dict(shared["kl_ctrl"])
        if controller is not None and shared.get("controller"):
            controller.load_state_dict(shared["controller"])
        if self.rank == 0:
            self.log.info("resumed from %s at step %d", path, shared["step"])
        # "pending": the one batch of a checkpoint written before trainer.max_staleness (one step off)
        saved = shared["ahead"] if "ahead" in shared else [shared["pending"]] if shared.get("pending") else []
        ahead = BatchesAhead.from_state(saved, max_staleness=max_staleness)
        supersede_metrics(self.run_dir, step=int(shared["step"]), rank=self.rank)
        # the draws made after the checkpoint are drawn again (those before it are trained, or held by it: batches
        # generated ahead, groups in flight)
        supersede_metrics(self.run_dir, step=int(shared["step"]), rank=self.rank, name=LEDGER)
        self.resumed_at = int(shared["step"])
        return self.resumed_at, ahead

    def _load_relayout(self, path: Path, roles, *, shared: dict, saved_world: int, world: int) -> None:
        """Resume onto another layout (ppo/run/relayout.py): every rank reads every saved rank's state, checks it
        can load it here (the verdicts gathered, so every rank stops alike), reshards its roles and re-seeds its
        RNG from (seed, step, rank)."""
        from ppo.run.checkpoint import load_rank_states
        from ppo.run.relayout import (
            check_relayout,
            converted_roles,
            describe_layout,
            describe_relayout,
            load_roles_resharded,
            seed_rng,
        )

        saved_layout, step = shared.get("layout") or {}, int(shared["step"])
        rank_states = load_rank_states(path, world_size=saved_world)
        _agree(lambda: check_relayout(path, rank_states, roles, saved_desc=describe_layout(saved_layout, saved_world)))
        converted = sorted({name for st in rank_states for name in converted_roles(st["workers"], roles)})
        if self.rank == 0:
            self.log.info(describe_relayout(step, saved_layout, saved_world, self.layout or {}, world,
                                            converted=converted))
        load_roles_resharded(roles, rank_states)
        seed_rng(self.run.seed, step=step, rank=self.rank)


def _any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank (every rank gets the same answer)."""
    from ppo.batch.experience import all_gather_objects

    return any(all_gather_objects(flag))


def _agree(check) -> None:
    """Run a resume check on every rank and raise its ResumeError on all of them when any rank's failed (a rank
    that hosts none of the roles concerned must not go on into a collective the others never join)."""
    from ppo.batch.experience import all_gather_objects
    from ppo.run.resume import ResumeError

    try:
        check()
        reason = None
    except ResumeError as e:
        reason = str(e)
    reasons = sorted({r for r in all_gather_objects(reason) if r is not None})
    if reasons:
        raise ResumeError("; ".join(reasons))


WANDB_ID = "wandb_id"


def wandb_resume_args(run_dir: Path, *, resumed_at: int) -> dict:
    """wandb.init's arguments that make every attempt of a run one W&B run without doubled rows: the first attempt
    draws the run id and keeps it in <run>/wandb_id; a later attempt (a restart, a resume) rewinds that run's
    history to the step it resumed from (W&B's resume_from="<id>?_step=<step>"), so the steps it re-runs replace
    the rows the earlier attempt logged after its last checkpoint, as metrics.jsonl's are superseded."""
    path = run_dir / WANDB_ID
    if path.exists():
        run_id = path.read_text().strip()
        return {"resume_from": f"{run_id}?_step={resumed_at}"}
    import secrets

    run_id = secrets.token_hex(8)
    path.write_text(run_id + "\n")
    return {"id": run_id, "resume": "allow"}


def total_steps(run: RunSettings, batches_per_epoch: int) -> int:
    """The run's steps: trainer.total_steps, or trainer.total_epochs x batches per epoch when total_epochs > 0."""
    if not run.total_epochs:
        return run.total_steps
    steps = run.total_epochs * batches_per_epoch
    logging.getLogger("hybridrl").info("trainer.total_epochs=%d: %d batches per epoch, %d steps",
                                       run.total_epochs, batches_per_epoch, steps)
    return steps


def build_kl_controller(s: KLControlSettings) -> algos.AdaptiveKLController | algos.FixedKLController:
    """The in-reward KL penalty's coefficient, adaptive or fixed (algorithm.kl_ctrl)."""
    if s.kind == "adaptive":
        return algos.AdaptiveKLController(init_kl_coef=s.coef, target_kl=s.target, horizon=s.horizon)
    return algos.FixedKLController(kl_coef=s.coef)


def check_reward_columns(reward: RewardSettings, columns: list[str]) -> None:
    """Load the rule reward function on every rank and check the data columns it names exist, so a
    bad function or a missing column stops every rank before training (RewardFunctionError)."""
    from ppo.data.reward_calls import plan_reward_call
    from ppo.data.rewards import load_reward_function

    plan_reward_call(load_reward_function(reward.function), signature=reward.signature, columns=columns)


# ---------------------------------------------------------------------- worker state
def worker_state(worker) -> dict:
    """This rank's part of a worker: the runner's own checkpoint state (model shards, optimizer state, in
    the backend's layout) and the LR schedule."""
    state = {"runner": worker.runner.checkpoint_state(getattr(worker, "optimizer", None)),
             "backend": getattr(worker.runner, "backend", "native")}
    if getattr(worker, "scheduler", None) is not None:
        state["sched"] = worker.scheduler.state_dict()
    return state


def load_worker_state(worker, state: dict) -> None:
    worker.runner.load_checkpoint_state(getattr(worker, "optimizer", None), state["runner"])
    if "sched" in state:
        worker.scheduler.load_state_dict(state["sched"])


def roles_state(roles) -> dict:
    """This rank's workers, and the rollout's groups in flight (rollout.batches_in_flight > 1)."""
    state = {name: worker_state(w) for name in ("actor", "critic") if (w := getattr(roles, name)) is not None}
    if roles.rollout is not None and roles.rollout.partial is not None:
        state["rollout"] = {"partial": roles.rollout.partial.state_dict()}
    return state


def load_roles_state(roles, state: dict) -> None:
    for name, st in state.items():
        worker = getattr(roles, name)
        if worker is None:
            raise RuntimeError(f"checkpoint holds {name} state but this rank hosts no {name}: "
                               "resume with the same placement and world size")
        if name == "rollout":
            worker.restore_partial(st["partial"])
        else:
            load_worker_state(worker, st)


EXPORTED_ROLES = {"actor": "ForCausalLM", "critic": "ForSequenceClassification"}


def export_weights(roles, out: Path) -> list[str]:
    """HF directories `<out>/<role>` of actor and critic, any layout or placement (collective over
    the world). Returns the roles exported anywhere in the world."""
    from ppo.batch.experience import all_gather_objects
    from ppo.roles.workers import export_hf

    mine = [name for name, arch in EXPORTED_ROLES.items()
            if (w := getattr(roles, name)) is not None and export_hf(w, out / name, architecture=arch)]
    actor = roles.actor
    if actor is not None and actor.spec.lora is not None:  # a LoRA actor: its adapters as a PEFT directory too
        from ppo.roles.workers import export_peft_adapter
        from ppo.run.checkpoint import ADAPTER_ROLE

        if export_peft_adapter(actor, out / ADAPTER_ROLE, base_model=roles.base_model_path):
            mine.append(ADAPTER_ROLE)
    return sorted({r for part in all_gather_objects(mine) for r in part})
