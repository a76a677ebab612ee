"""hybridrl entry point: the same SPMD script on every rank.

    torchrun --nproc_per_node 2 launcher/main.py conf/ppo_tiny.yaml
    torchrun --nproc_per_node 4 launcher/main.py conf/ppo_tiny.yaml placement.mode=split
    torchrun --nproc_per_node 8 launcher/main.py conf/ppo_7b.yaml model.path=/data/Llama-2-7b-hf
    sbatch launcher/slurm/ppo.sbatch conf/ppo_7b.yaml trainer.total_steps=500

Every config key, with its type, default and meaning: `python -m launcher.config [section]`
(e.g. `python -m launcher.config data`). Override any of them as `key=value` after the YAML file;
lists as `data.train_files=[a.parquet,b.parquet]` (a single value means a one-element list).

Order of events: load and validate the config and the device plan on every rank (no
process group yet, so a bad config exits with code 2 at once); init the process group;
rank 0's plan is broadcast and every rank builds every role's groups; rank 0 creates the
run directory; the PPO loop runs; the process group is destroyed also on failure.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback

if __package__ in (None, ""):  # `torchrun launcher/main.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launcher.config.load import load_config, to_yaml  # noqa: E402
from launcher.config.schema import Config  # noqa: E402
from launcher.errors import UserError  # noqa: E402

# On a user error every rank exits 2. torchrun tears down all workers as soon as the first one exits:
# the other ranks wait this long before they print and exit, so rank 0's message comes first (and alone).
PEER_EXIT_GRACE_S = 5.0
# A failed rank of a multi-rank world waits this long before it exits. A rank whose peer died (kill -9, OOM killer)
# fails at once in its next collective, and if it exited as fast, torchrun would find both gone in one poll and
# name it, the survivor, as the root cause; waiting lets torchrun's monitor (every 0.1 s by default) see the rank
# that died first, and end this one itself.
FAILED_RANK_EXIT_GRACE_S = 2.0


def _parse(argv: list[str]) -> tuple[str, list[str]]:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    return argv[0], argv[1:]


def _seed_everything(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # the same on every rank: identical model initialisation


def _rank0_then_broadcast(fn, *, rank: int):
    """Run fn on rank 0 only; every rank gets its result, or the same UserError."""
    import torch.distributed as dist

    box = [None]
    if rank == 0:
        try:
            box = [("ok", fn())]
        except UserError as e:
            box = [("error", str(e))]
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise UserError(value)
    return value


def run(cfg: Config, *, rank: int, world_size: int, auto_choices: list[str] = ()) -> int:
    """auto_choices: the settings load_config chose (launcher.config.auto), logged by rank 0."""
    import torch.distributed as dist

    from launcher.dist import broadcast_plan, build_role_groups, init_distributed, limit_host_threads, resolve_device
    from launcher.log import add_file_log, setup_logging
    from launcher.monitor import smallest_gpu_memory_gb
    from launcher.planning.costmodel import resolve_calibration
    from launcher.planning.fit import fit_memory
    from launcher.planning.plan import (
        compute_plan,
        resolve_model_config,
        resolve_reward_model_config,
        validate_batch,
        validate_context,
        validate_kv_cache,
    )
    from launcher.preempt import EXIT_PREEMPTED, StopRequest, stop_file_blocks_start
    from launcher.rundir import prepare_run_dir, resume_of_attempt, write_atomic
    from launcher.runlock import job_id, restart_count
    from launcher.watchdog import Watchdog, clear_alarm

    t = cfg.trainer
    stop_file = os.environ.get("HYBRIDRL_STOP_FILE")  # the Slurm templates' preemption request
    if stop_file_blocks_start(stop_file):
        print(f"rank {rank}: stop file {stop_file} exists: this job was asked to stop; not starting "
              f"(exit {EXIT_PREEMPTED})", file=sys.stderr)
        return EXIT_PREEMPTED
    stop = StopRequest(grace_s=t.preempt_grace_s, stop_file=stop_file).install()

    # --- everything checkable is checked before a process group exists
    model_cfg, rm_cfg = resolve_model_config(cfg), resolve_reward_model_config(cfg)
    auto_choices = [*auto_choices, *resolve_calibration(cfg)]
    auto_choices = [*auto_choices, *fit_memory(cfg, lambda c: compute_plan(
        c, world_size=world_size, model=model_cfg, reward_model=rm_cfg).predicted, device_gb=smallest_gpu_memory_gb())]
    plan = compute_plan(cfg, world_size=world_size, model=model_cfg, reward_model=rm_cfg)
    validate_batch(cfg, plan)
    validate_context(cfg, model_cfg)
    device = resolve_device(cfg.trainer.device)
    validate_kv_cache(cfg, plan, cuda=device == "cuda")
    auto_choices = [*auto_choices, *filter(None, [limit_host_threads(device)])]

    env = init_distributed(device=device, backend=cfg.trainer.dist_backend, timeout_s=cfg.trainer.dist_timeout_s)
    logger = setup_logging(rank=env.rank, world_size=env.world_size)
    lock = watchdog = None
    clean = False
    try:
        plan = broadcast_plan(plan, rank=env.rank)

        def prepare():
            nonlocal lock
            resume = resume_of_attempt(t.runs_dir, t.experiment_name, resume=t.resume)
            path, lock = prepare_run_dir(t.runs_dir, t.experiment_name, resume=resume, overwrite=t.overwrite)
            clear_alarm(path)  # before the broadcast: no rank watches yet
            return path, resume

        run_dir, resume = _rank0_then_broadcast(prepare, rank=env.rank)
        restarted = resume != t.resume
        t.resume = resume  # a restarted attempt of this job continues its run (launcher.rundir.resume_of_attempt)

        def on_tick() -> None:  # the watchdog thread, every few seconds
            stop.poll_file()
            if lock is not None:  # rank 0: keep the run-directory lock fresh
                lock.refresh()

        # every rank beats from here on
        watchdog = Watchdog(run_dir, rank=env.rank, world_size=env.world_size, timeout_s=t.watchdog_timeout_s,
                            on_tick=on_tick).start()
        add_file_log(logger, run_dir / "logs", rank=env.rank)
        if env.rank == 0:
            write_atomic(run_dir / "config.yaml", to_yaml(cfg))
            write_atomic(run_dir / "plan.json", plan.to_json())
            logger.info("run directory %s, backend %s on %s", run_dir, env.backend, env.device)
            if restarted:
                logger.warning("attempt %d of job %s (restarted by torchrun or requeued by Slurm): continuing its "
                               "run from the newest intact checkpoint (trainer.resume=auto)", restart_count(),
                               job_id())
            logger.info("\n%s", plan.table())
            for line in auto_choices:
                logger.info("auto: %s", line)
        _seed_everything(cfg.trainer.seed)
        groups = build_role_groups(plan, rank=env.rank, device_type=env.device.type)
        logger.info("rank %d: roles %s, groups built", env.rank, ",".join(plan.roles_of(env.rank)))

        monitor = None
        if cfg.monitor.enabled and env.local_rank == 0:  # one sampler per node, for all its GPUs
            from launcher.monitor import GpuMonitor

            monitor = GpuMonitor(run_dir / "util.jsonl", interval_s=cfg.monitor.interval_s, rank=env.rank).start()
        from launcher.handoff import build_ppo_settings
        from ppo.roles.placement import Placement
        from ppo.trainer import run_training

        try:
            stopped = run_training(settings=build_ppo_settings(cfg, device=env.device),
                                   placement=Placement(plan, groups, env), run_dir=run_dir, model_config=model_cfg,
                                   monitor=monitor, heartbeat=watchdog, stop_requested=lambda: stop.requested)
        finally:
            if monitor is not None:
                monitor.stop()
        clean = True
        if stopped is not None:
            _report(f"rank {env.rank}: stopped early ({stopped}) with a checkpoint; exit {EXIT_PREEMPTED}: relaunch "
                    f"with trainer.resume=auto to continue")
            return EXIT_PREEMPTED
        return 0
    finally:
        if watchdog is not None:
            watchdog.stop(clean=clean)
        if lock is not None:
            lock.release()
        stop.uninstall()
        if dist.is_initialized():
            dist.destroy_process_group()


def _report(message: str) -> None:
    """A stop reason: on stderr, and in this rank's log file in the run directory (when it exists by now)."""
    from launcher.log import log_to_files

    log_to_files(logging.ERROR, message)
    print(message, file=sys.stderr, flush=True)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Each layer's own bad-input errors: they exit with 2 and a message, never a traceback."""
    from models.config import ModelConfigError
    from parallel.dims import TopologyError
    from ppo.data.prompts import DataError
    from ppo.data.rewards import RewardFailureError, RewardFunctionError
    from ppo.data.tokenizer import TokenizerError
    from ppo.run.checkpoint import CheckpointError
    from ppo.run.resume import ResumeError
    from ppo.trainer import NonFiniteStepsError

    return (UserError, ModelConfigError, TopologyError, DataError, RewardFunctionError, TokenizerError,
            CheckpointError, ResumeError, RewardFailureError, NonFiniteStepsError)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    try:
        path, overrides = _parse(argv)
        auto_choices: list[str] = []
        cfg = load_config(path, overrides, auto_choices=auto_choices)
        return run(cfg, rank=rank, world_size=world_size, auto_choices=auto_choices)
    except _user_errors() as e:
        from ppo.run.checkpoint import CheckpointError

        if rank == 0 or isinstance(e, CheckpointError):
            _report(f"error: {e}")
        else:  # mostly the same error as rank 0's: torchrun ends this rank while it waits once rank 0 has exited
            from launcher.log import log_to_files

            log_to_files(logging.ERROR, f"error: {e}")
            time.sleep(PEER_EXIT_GRACE_S)
            print(f"rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return UserError.exit_code
    except KeyboardInterrupt:  # before the preemption handler is installed (config loading)
        print(f"rank {rank}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one paragraph per rank, the traceback goes to the log file
        from launcher.log import get_logger

        logger = get_logger()
        logger.debug("traceback:\n%s", traceback.format_exc())
        if os.environ.get("HYBRIDRL_TRACEBACK") or not logger.handlers:
            traceback.print_exc()
        where = traceback.extract_tb(e.__traceback__)[-1]
        _report(f"rank {rank}: failed: {type(e).__name__}: {e} (at {os.path.basename(where.filename)}:"
                f"{where.lineno}; full traceback in the run directory's logs/rank_{rank}.log)")
        if world_size > 1:
            time.sleep(FAILED_RANK_EXIT_GRACE_S)
        return 1


if __name__ == "__main__":
    sys.exit(main())
