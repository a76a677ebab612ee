"""The device plan: which global ranks host which role, and each role group's layout.

Offline, for any world size, without starting a process:

    python -m launcher.plan conf/ppo_7b.yaml --world-size 8
    python -m launcher.plan conf/ppo_7b.yaml --world-size 1024 --json

`compute_plan` is a pure function of the config, the model shape and the world size;
rank 0 calls it at start-up, broadcasts the result, and every rank builds the groups.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

from launcher.config import Config, PoolConfig, load_config, uses_critic, uses_ref
from launcher.errors import UserError
from models.config import ModelConfig
from parallel.dims import ParallelDims, TopologyError


@dataclass(slots=True)
class RoleGroup:
    role: str
    ranks: list[int]
    tp: int
    pp: int
    dp: int

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(tp=self.tp, pp=self.pp, dp=self.dp)


@dataclass(slots=True)
class DevicePlan:
    world_size: int
    mode: str
    pools: list[list[str]]
    groups: dict[str, RoleGroup] = field(default_factory=dict)
    gen_tp: int = 1
    gen_dp: int = 1

    def roles_of(self, rank: int) -> list[str]:
        return [r for r, g in self.groups.items() if rank in g.ranks]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> DevicePlan:
        groups = {k: RoleGroup(**v) for k, v in d["groups"].items()}
        return cls(world_size=d["world_size"], mode=d["mode"], pools=d["pools"], groups=groups,
                   gen_tp=d["gen_tp"], gen_dp=d["gen_dp"])

    def table(self) -> str:
        def span(ranks: list[int]) -> str:
            contiguous = ranks == list(range(ranks[0], ranks[-1] + 1))
            return f"{ranks[0]}-{ranks[-1]}" if contiguous and len(ranks) > 1 else ",".join(map(str, ranks))

        rows = [("role", "ranks", "gpus", "tp", "pp", "dp", "notes")]
        for role, g in self.groups.items():
            note = f"generates at tp={self.gen_tp} x dp={self.gen_dp}" if role == "rollout" else ""
            rows.append((role, span(g.ranks), str(len(g.ranks)), str(g.tp), str(g.pp), str(g.dp), note))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"device plan: {self.mode} placement over {self.world_size} ranks"]
        for i, r in enumerate(rows):
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if i == 0:
                lines.append("  " + "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def active_roles(cfg: Config) -> list[str]:
    """Roles this config needs, in plan order."""
    roles = ["actor", "rollout"]
    if uses_ref(cfg):
        roles.append("ref")
    if uses_critic(cfg):
        roles.append("critic")
    roles.append("reward")  # rule rewards run on the reward ranks' CPUs; a reward model on their GPUs
    return roles


def _pools(cfg: Config, roles: list[str]) -> list[PoolConfig]:
    if cfg.placement.mode == "colocated":
        return [PoolConfig(roles=list(roles), size=1)]
    pools = [PoolConfig(roles=[r for r in p.roles if r in roles], size=p.size) for p in cfg.placement.pools]
    if not pools:
        rest = [r for r in roles if r not in ("actor", "rollout")]
        pools = [PoolConfig(roles=["actor", "rollout"], size=1), PoolConfig(roles=rest, size=1)]
    listed = [r for p in cfg.placement.pools for r in p.roles]
    for p in pools:
        if not p.roles:
            raise UserError(f"placement.pools: a pool of roles {listed} has no role this run uses "
                            f"(algorithm={cfg.algorithm.name}, active roles: {', '.join(roles)}); remove it")
    placed = [r for p in pools for r in p.roles]
    missing = [r for r in roles if r not in placed]
    twice = sorted({r for r in placed if placed.count(r) > 1})
    if missing:
        raise UserError(f"placement.pools: roles {missing} are not placed; add them to a pool")
    if twice:
        raise UserError(f"placement.pools: roles {twice} appear in more than one pool")
    actor_pool = next(p for p in pools if "actor" in p.roles)
    if "rollout" not in actor_pool.roles:
        raise UserError("placement.pools: rollout must share the actor's pool "
                        "(the hybrid engine reshards the actor's weights in place for generation)")
    return pools


def _role_section(cfg: Config, role: str):
    return {"actor": cfg.actor, "rollout": cfg.actor, "ref": cfg.ref, "critic": cfg.critic,
            "reward": cfg.reward}[role]


def _validate_megatron_layout(role: str, *, tp: int, pp: int, shape: ModelConfig) -> None:
    """Layouts megatron-core cannot shard: its embedding is vocab-parallel in every role (tp | vocab), its
    attention needs whole KV groups per rank (tp | KV heads), its stages are an even split (pp | layers)."""
    for what, n, k in (("vocab_size", shape.vocab_size, tp), ("num_key_value_heads", shape.num_key_value_heads, tp),
                       ("num_hidden_layers", shape.num_hidden_layers, pp)):
        if n % k:
            name = "tp" if k == tp and what != "num_hidden_layers" else "pp"
            raise UserError(f"{role}.backend=megatron: {role}.{name}({k}) must divide {what}({n})")


def compute_plan(cfg: Config, *, world_size: int, model: ModelConfig,
                 reward_model: ModelConfig | None = None) -> DevicePlan:
    """Assign ranks to roles and validate every layout. Raises UserError with the numbers."""
    if world_size < 1:
        raise UserError(f"world size must be >= 1, got {world_size}")
    roles = active_roles(cfg)
    pools = _pools(cfg, roles)
    if cfg.placement.mode == "split" and world_size < len(pools):
        raise UserError(f"split placement over {len(pools)} pools needs at least {len(pools)} ranks, "
                        f"got world size {world_size}; use placement.mode=colocated")
    total = sum(p.size for p in pools)
    if world_size % total:
        sizes = " + ".join(str(p.size) for p in pools)
        raise UserError(f"placement pool sizes ({sizes} = {total}) must divide the world size ({world_size}): "
                        f"pools get world_size * size / {total} ranks each")
    plan = DevicePlan(world_size=world_size, mode=cfg.placement.mode, pools=[list(p.roles) for p in pools])
    start = 0
    for p in pools:
        n = world_size * p.size // total
        ranks = list(range(start, start + n))
        start += n
        for role in p.roles:
            sec = _role_section(cfg, role)
            tp, pp = sec.tp, sec.pp
            if role == "rollout":
                tp, pp = (cfg.rollout.gen_tp or cfg.actor.tp), 1
            if role == "reward" and cfg.reward.type == "rule":
                tp, pp = 1, 1  # rule functions: plain data parallel over the pool's ranks
            shape = reward_model if (role == "reward" and reward_model is not None) else model
            if not (role == "reward" and cfg.reward.type == "rule"):
                try:
                    ParallelDims(tp=tp, pp=pp, dp=1).validate_model(
                        num_heads=shape.num_attention_heads, num_kv_heads=shape.num_key_value_heads,
                        num_layers=shape.num_hidden_layers,
                        vocab_size=shape.vocab_size if role in ("actor", "rollout") else None, role=role)
                except TopologyError as e:
                    raise UserError(str(e).replace("rollout tp", "rollout.gen_tp")) from None
                if role != "rollout" and sec.backend == "megatron":
                    _validate_megatron_layout(role, tp=tp, pp=pp, shape=shape)
            if n % (tp * pp):
                raise UserError(f"{role} tp({tp}) x pp({pp}) = {tp * pp} must divide its pool of {n} ranks "
                                f"(roles {', '.join(p.roles)})")
            dp = n // (tp * pp)
            if role != "rollout" and sec.dp and sec.dp != dp:
                raise UserError(f"{role}.dp={sec.dp} but its pool of {n} ranks with tp({tp}) x pp({pp}) "
                                f"gives dp={dp}; set {role}.dp=0 to derive it")
            plan.groups[role] = RoleGroup(role=role, ranks=ranks, tp=tp, pp=pp, dp=dp)
    actor = plan.groups["actor"]
    plan.gen_tp = plan.groups["rollout"].tp
    plan.gen_dp = len(actor.ranks) // plan.gen_tp
    if (actor.tp * actor.pp) % plan.gen_tp:
        raise UserError(f"rollout.gen_tp({plan.gen_tp}) must divide the actor's tp({actor.tp}) x pp({actor.pp}) "
                        f"= {actor.tp * actor.pp}: each training replica splits into whole generation replicas")
    return plan


def validate_batch(cfg: Config, plan: DevicePlan) -> None:
    """A launch (not an offline plan) also needs the step's samples to split over every DP group."""
    samples = cfg.data.batch_size * cfg.rollout.n
    for name, dp in [("rollout gen_dp", plan.gen_dp)] + [(f"{r}.dp", g.dp) for r, g in plan.groups.items()
                                                          if r != "rollout"]:
        if samples % dp:
            raise UserError(f"data.batch_size({cfg.data.batch_size}) x rollout.n({cfg.rollout.n}) = {samples} samples "
                            f"must split evenly over {name}={dp}; use a batch size that is a multiple of {dp}")


def resolve_model_config(cfg: Config) -> ModelConfig:
    """The actor's shape: config.json of model.path, or the preset."""
    from models.config import ModelConfigError, preset_config

    try:
        if cfg.model.path:
            from models.hf_io import read_config

            return read_config(cfg.model.path)
        return preset_config(cfg.model.preset)
    except (ModelConfigError, FileNotFoundError) as e:
        raise UserError(f"model: {e}") from None


def resolve_reward_model_config(cfg: Config) -> ModelConfig | None:
    if cfg.reward.type != "model" or not cfg.reward.model_path:
        return None
    from models.hf_io import read_config

    try:
        return read_config(cfg.reward.model_path)
    except Exception as e:  # noqa: BLE001 - any unreadable reward model is a user error here
        raise UserError(f"reward.model_path: {e}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launcher.plan", description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="key=value overrides")
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--json", action="store_true", help="print plan.json instead of the table")
    args = ap.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        plan = compute_plan(cfg, world_size=args.world_size, model=resolve_model_config(cfg),
                            reward_model=resolve_reward_model_config(cfg))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(plan.to_json() if args.json else plan.table())
    return 0

if __name__ == "__main__":
    sys.exit(main())
