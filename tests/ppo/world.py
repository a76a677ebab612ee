"""In-process harness for the orchestration layer's unit tests: a gloo world of one rank and
the pieces the launcher hands `ppo` (config, plan, role groups, environment), no torchrun.

    with world_of_one():
        run = tiny_run(tmp_path, "algorithm.name=grpo")
        trainer = run.trainer()                    # PPOTrainer with the launcher's typed settings
    state = train_state(load_config(None, ["data.batch_size=4"]), tmp_path)   # TrainState alone, no world
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from launcher.config.load import load_config
from launcher.dist import DistEnv, build_role_groups
from launcher.handoff import build_ppo_settings
from launcher.planning.plan import compute_plan, resolve_model_config

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["trainer.progress_bar=false", "trainer.tensorboard=false", "monitor.enabled=false",
         "trainer.sft_warmup_steps=0", "data.batch_size=8", "data.task_size=64", "rollout.max_response_length=4",
         "actor.mini_batch_size=0", "critic.mini_batch_size=0", "actor.ppo_epochs=1"]


@contextlib.contextmanager
def world_of_one():
    """A default process group of one gloo rank for the block (torch's collectives become local)."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass
class Run:
    cfg: object
    settings: object  # ppo.settings.PPOSettings
    plan: object
    groups: dict
    env: DistEnv
    model_config: object

    def trainer(self, run_dir: Path | None = None):
        from ppo.trainer import PPOTrainer

        return PPOTrainer(settings=self.settings, placement=self.placement,
                          run_dir=run_dir or Path(self.cfg.trainer.runs_dir), model_config=self.model_config)

    @property
    def placement(self):
        from ppo.roles.placement import Placement

        return Placement(self.plan, self.groups, self.env)


def tiny_run(tmp_path: Path, *overrides: str, config: str = "conf/ppo_tiny.yaml") -> Run:
    """The launcher's hand-off for a one-rank colocated run of `config` (call inside world_of_one)."""
    cfg = load_config(str(ROOT / config), [f"trainer.runs_dir={tmp_path}", *SMALL, *overrides])
    model_config = resolve_model_config(cfg)
    plan = compute_plan(cfg, world_size=1, model=model_config)
    groups = build_role_groups(plan, rank=0, device_type="cpu")
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    return Run(cfg, build_ppo_settings(cfg, device=env.device), plan, groups, env, model_config)


def train_state(cfg, run_dir: Path, *, rank: int = 0):
    """ppo.run.state.TrainState from the settings the launcher hands over for `cfg`, as PPOTrainer builds it."""
    from ppo.run.state import TrainState

    s = build_ppo_settings(cfg, device=torch.device("cpu"))
    return TrainState.create(s.run, s.data, reward=s.reward, kl_control=s.loop.advantages.kl_control,
                             model_path=s.build.model_path, sft_warmup=s.loop.sft_warmup_steps > 0, run_dir=run_dir,
                             rank=rank)
