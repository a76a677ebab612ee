"""The device plan: which global ranks host which role, and each role group's layout.

Offline, for any world size, without starting a process:

    python -m launcher.planning.plan conf/ppo_7b.yaml --world-size 8
    python -m launcher.planning.plan conf/ppo_7b.yaml --world-size 1024 --json
    python -m launcher.planning.plan conf/ppo_7b.yaml --world-size 64 --auto [--json] [--schedules sync,async]

`compute_plan` is a pure function of the config, the model shape and the world size;
rank 0 calls it at start-up, broadcasts the result, and every rank builds the groups.
`--auto` ranks placements and layouts by the calibrated cost model (launcher/planning/autoplan.py);
`placement.mode: auto` launches the best of them (same search, deterministic on every rank).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

from launcher.config.load import load_config
from launcher.config.schema import MODEL_ROLES, Config, PoolConfig, active_roles, role_section, section_name
from launcher.errors import UserError
from launcher.planning.layout import validate_role_layout
from models.config import ModelConfig
from parallel.dims import ParallelDims, TopologyError


@dataclass(slots=True)
class RoleGroup:
    role: str
    ranks: list[int]
    tp: int
    pp: int
    dp: int
    ep: int = 1  # expert parallelism inside dp (a mixture of experts)

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep)


@dataclass(slots=True)
class DevicePlan:
    world_size: int
    mode: str
    pools: list[list[str]]
    groups: dict[str, RoleGroup] = field(default_factory=dict)
    gen_tp: int = 1
    gen_dp: int = 1
    predicted: dict = field(default_factory=dict)  # the cost model's estimate (launcher/planning/stepmodel.py)

    def roles_of(self, rank: int) -> list[str]:
        return [r for r, g in self.groups.items() if rank in g.ranks]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> DevicePlan:
        groups = {k: RoleGroup(**v) for k, v in d["groups"].items()}
        return cls(world_size=d["world_size"], mode=d["mode"], pools=d["pools"], groups=groups,
                   gen_tp=d["gen_tp"], gen_dp=d["gen_dp"], predicted=d.get("predicted") or {})

    def table(self) -> str:
        def span(ranks: list[int]) -> str:
            contiguous = ranks == list(range(ranks[0], ranks[-1] + 1))
            return f"{ranks[0]}-{ranks[-1]}" if contiguous and len(ranks) > 1 else ",".join(map(str, ranks))

        rows = [("role", "ranks", "gpus", "tp", "pp", "dp", "ep", "notes")]
        for role, g in self.groups.items():
            note = f"generates at tp={self.gen_tp} x dp={self.gen_dp}" if role == "rollout" else ""
            if g.ep > 1:
                note = f"{g.ep} expert-parallel ranks of 1/{g.ep} of the experts, {g.dp // g.ep} replicas"
            rows.append((role, span(g.ranks), str(len(g.ranks)), str(g.tp), str(g.pp), str(g.dp), str(g.ep), note))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"device plan: {self.mode} placement over {self.world_size} ranks"]
        for i, r in enumerate(rows):
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if i == 0:
                lines.append("  " + "  ".join("-" * w for w in widths))
        p = self.predicted
        if p:
            busy = "/".join(f"{q['utilization']:.0%}" for q in p["pools"])
            fit = f"; does not fit: {p['reject']}" if p["reject"] else ""
            lines.append(f"  cost model ({p.get('calibration', '?')}): {p['predicted_step_s']:.3f} s/step, "
                         f"{p['samples_per_s']:.1f} samples/s, useful {p['useful_utilization']:.1%}, "
                         f"pools busy {busy}, peak {p['peak_gb']:.1f} GB per GPU{fit}")
        return "\n".join(lines)


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
    """The layout section a role reads (the rollout's is the actor's; a rule reward has none)."""
    return cfg.actor if role == "rollout" else role_section(cfg, role)


def _validate_megatron_layout(role: str, *, tp: int, pp: int, shape: ModelConfig) -> None:
    """Layouts megatron-core cannot shard: its embedding is vocab-parallel in every role (tp | vocab), its
    attention needs whole KV groups per rank (tp | KV heads), its stages are an even split (pp | layers)."""
    for what, n, k in (("vocab_size", shape.vocab_size, tp), ("num_key_value_heads", shape.num_key_value_heads, tp),
                       ("num_hidden_layers", shape.num_hidden_layers, pp)):
        if n % k:
            name = "tp" if k == tp and what != "num_hidden_layers" else "pp"
            raise UserError(f"{role}.backend=megatron: {role}.{name}({k}) must divide {what}({n})")


def _validate_megatron_moe(role: str, sec) -> None:
    """What megatron-core's MoE layers (models/megatron_moe.py) cannot do here, refused before launch."""
    if getattr(sec, "activation_checkpointing", None) == "full":
        raise UserError(f"{role}.backend=megatron with a mixture of experts: activation_checkpointing=full is not "
                        "supported: megatron's full recompute runs the layers' first forward without autograd, so the "
                        "router statistics the load-balancing loss is computed from would carry no gradient; use none")
    if sec.ep > 1:
        raise UserError(f"{role}.backend=megatron: {role}.ep={sec.ep}: megatron-core's expert parallelism is wired and "
                        "its forward, gradients, export and reshard equal ep=1 on CPU, but its DDP and distributed "
                        "optimizer over expert groups have not run on GPUs yet (test_megatron_moe_gpu.py, 2 GPUs); "
                        f"use {role}.ep=1 with the megatron backend, or {role}.backend=native")


def validate_moe(cfg: Config, model: ModelConfig) -> None:
    """What a mixture-of-experts policy (Qwen3-MoE) can run, refused before launch otherwise: either training
    backend with data parallelism and expert parallelism inside it (<role>.ep, native backend; megatron at ep=1; the
    experts are neither tensor- nor pipeline-parallel), the native rollout engine at generation tp 1 (it records the
    experts for routing replay); and actor.router_replay / router_aux_loss_coef only with such a policy."""
    if cfg.actor.router_replay and not model.is_moe:
        raise UserError(f"actor.router_replay=true replays a mixture of experts' routing, and the model "
                        f"({model.model_type}) has no experts; set actor.router_replay=false")
    coef = cfg.actor.router_aux_loss_coef
    if coef is not None and not model.is_moe:
        raise UserError(f"actor.router_aux_loss_coef={coef} weighs a mixture of experts' load-balancing loss, and the "
                        f"model ({model.model_type}) has no experts; remove actor.router_aux_loss_coef")
    if coef is not None and coef < 0:
        raise UserError(f"actor.router_aux_loss_coef({coef}) must be >= 0 (0: no load-balancing loss)")
    for role in MODEL_ROLES:
        sec = role_section(cfg, role)
        if sec is None or sec.ep == 1 or (role != "actor" and role not in active_roles(cfg)):
            continue
        shape = model
        if role == "reward":
            raise UserError(f"reward.model.ep={sec.ep}: expert parallelism is wired for the actor, the reference and "
                            "the critic; use reward.model.ep=1")
        if sec.ep < 1:
            raise UserError(f"{role}.ep({sec.ep}) must be >= 1")
        if not shape.is_moe:
            raise UserError(f"{role}.ep={sec.ep} spreads a mixture of experts' experts over ranks, and the model "
                            f"({shape.model_type}) has no experts; use {role}.ep=1")
        if shape.num_experts % sec.ep:
            raise UserError(f"{role}.ep({sec.ep}) must divide num_experts({shape.num_experts})")
    if not model.is_moe:
        return
    what = f"the model is a mixture of experts ({model.num_experts} experts, top-{model.num_experts_per_tok})"
    for role in ("actor", "ref", "critic"):
        sec = role_section(cfg, role)
        if sec is None or (role != "actor" and role not in active_roles(cfg)):
            continue
        if sec.tp > 1 or sec.pp > 1:
            raise UserError(f"{role}.tp={sec.tp}, {role}.pp={sec.pp}: {what}, whose experts both training backends run "
                            f"whole on each rank; use {role}.tp=1 and {role}.pp=1 (data parallel: FSDP or megatron's "
                            f"distributed optimizer shards them, or {role}.ep spreads them over ranks)")
        if sec.backend == "megatron":
            _validate_megatron_moe(role, sec)
    if cfg.actor.lora.rank > 0:
        raise UserError(f"actor.lora.rank={cfg.actor.lora.rank}: {what}; LoRA adapters are placed on linear modules, "
                        f"and the experts are stacked tensors with no adapter support yet: train it at full "
                        f"parameters (actor.lora.rank=0)")
    if cfg.rollout.engine != "native":
        raise UserError(f"rollout.engine={cfg.rollout.engine}: {what}; the native engine decodes it and records the "
                        "experts for routing replay: use rollout.engine=native")
    if cfg.rollout.gen_tp > 1:
        raise UserError(f"rollout.gen_tp={cfg.rollout.gen_tp}: {what}, whose experts the native engine runs whole; "
                        "use rollout.gen_tp=1")
    if cfg.placement.mode == "auto":
        raise UserError(f"placement.mode=auto: {what}, and the cost model has no MoE layouts yet; use colocated or "
                        "split")


def validate_lora_head(cfg: Config, model: ModelConfig) -> None:
    """actor.lora.target_modules naming lm_head needs a head of its own: a head tied to the embeddings would make
    the merged head (and the warm-up's merge into the base) rewrite the embedding table too."""
    lo = cfg.actor.lora
    if lo.rank > 0 and "lm_head" in lo.target_modules and model.tie_word_embeddings:
        raise UserError("actor.lora.target_modules names lm_head, and the model ties its head to its embeddings "
                        "(tie_word_embeddings): leave lm_head out of actor.lora.target_modules")


def compute_plan(cfg: Config, *, world_size: int, model: ModelConfig,
                 reward_model: ModelConfig | None = None) -> DevicePlan:
    """Assign ranks to roles and validate every layout. Raises UserError with the numbers."""
    if world_size < 1:
        raise UserError(f"world size must be >= 1, got {world_size}")
    validate_moe(cfg, model)
    validate_lora_head(cfg, model)
    if cfg.placement.mode == "auto":
        return auto_plan(cfg, world_size=world_size, model=model, reward_model=reward_model)
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
            tp, pp = (1, 1) if sec is None else (sec.tp, sec.pp)  # a rule reward: data parallel over the pool
            if role == "rollout":
                tp, pp = (cfg.rollout.gen_tp or cfg.actor.tp), 1
            shape = reward_model if (role == "reward" and reward_model is not None) else model
            if sec is not None:
                try:
                    validate_role_layout(role, shape, tp=tp, pp=pp,
                                         stages_per_rank=1 if role == "rollout" else sec.pp_stages_per_rank)
                except TopologyError as e:
                    raise UserError(str(e).replace("rollout tp", "rollout.gen_tp")) from None
                if role != "rollout" and sec.backend == "megatron":
                    _validate_megatron_layout(role, tp=tp, pp=pp, shape=shape)
            if n % (tp * pp):
                raise UserError(f"{role} tp({tp}) x pp({pp}) = {tp * pp} must divide its pool of {n} ranks "
                                f"(roles {', '.join(p.roles)})")
            dp = n // (tp * pp)
            if role != "rollout" and sec is not None and sec.dp and sec.dp != dp:
                raise UserError(f"{role}.dp={sec.dp} but its pool of {n} ranks with tp({tp}) x pp({pp}) "
                                f"gives dp={dp}; set {role}.dp=0 to derive it")
            ep = 1 if role == "rollout" or sec is None else sec.ep
            if dp % ep:
                raise UserError(f"{role}.ep({ep}) must divide its dp({dp}) ({n} ranks / tp({tp}) x pp({pp})): an "
                                f"expert-parallel group is ep of the data-parallel ranks")
            plan.groups[role] = RoleGroup(role=role, ranks=ranks, tp=tp, pp=pp, dp=dp, ep=ep)
    actor = plan.groups["actor"]
    plan.gen_tp = plan.groups["rollout"].tp
    plan.gen_dp = len(actor.ranks) // plan.gen_tp
    if (actor.tp * actor.pp) % plan.gen_tp:
        raise UserError(f"rollout.gen_tp({plan.gen_tp}) must divide the actor's tp({actor.tp}) x pp({actor.pp}) "
                        f"= {actor.tp * actor.pp}: each training replica splits into whole generation replicas")
    plan.predicted = predict_plan(cfg, plan, model=model, reward_model=reward_model)
    return plan


def predict_plan(cfg: Config, plan: DevicePlan, *, model: ModelConfig,
                 reward_model: ModelConfig | None = None) -> dict:
    """The cost model's estimate of a plan on placement.calibration's machine (plan.json carries it, so a
    run's measured stage times can be set beside it)."""
    from launcher.planning.autoplan import candidate_from_plan
    from launcher.planning.costmodel import build_workload, load_calibration
    from launcher.planning.stepmodel import estimate

    try:
        cal = load_calibration(cfg.placement.calibration)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"placement.calibration: {e}") from None
    w = build_workload(cfg, model=model, reward_model=reward_model)
    est = estimate(w, cal, candidate_from_plan(plan, is_async=cfg.trainer.max_staleness > 0))
    return dict(est.summary(cal), calibration=cal.name, prompt_len=w.prompt_len, response_len=w.response_len)


AUTO_CHOSEN = ("tp", "pp", "dp")


def auto_plan(cfg: Config, *, world_size: int, model: ModelConfig,
              reward_model: ModelConfig | None = None) -> DevicePlan:
    """placement.mode=auto: the cost model's fastest feasible plan for the config's sync/async schedule.

    The search picks the pools and every role's layout, so a config that also fixes them is refused
    (a key that would be silently overridden)."""
    import copy

    from launcher.planning.autoplan import search
    from launcher.planning.costmodel import load_calibration

    sections = {section_name(r): role_section(cfg, r) for r in MODEL_ROLES}
    fixed = [f"{name}.{k}={getattr(sec, k)}" for name, sec in sections.items() if sec is not None
             for k in AUTO_CHOSEN if getattr(sec, k) != (0 if k == "dp" else 1)]
    fixed += [f"rollout.gen_tp={cfg.rollout.gen_tp}"] if cfg.rollout.gen_tp else []
    fixed += ["placement.pools=[...]"] if cfg.placement.pools else []
    if fixed:
        raise UserError(f"placement.mode=auto chooses the pools and layouts itself, but the config sets "
                        f"{', '.join(fixed)}; remove them (tp/pp=1, dp=0, gen_tp=0, pools=[]) or pick "
                        f"placement.mode=colocated|split")
    try:
        cal = load_calibration(cfg.placement.calibration)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"placement.calibration: {e}") from None
    result = search(cfg, world_size=world_size, model=model, reward_model=reward_model, cal=cal, top=1)
    if not result.best:
        why = "; ".join(result.rejected[:3]) or "no layout divides the batch and the model"
        raise UserError(f"placement.mode=auto: no plan fits {world_size} GPUs of {cal.name}: {why}")
    best = result.best[0]
    c = best.candidate
    resolved = copy.deepcopy(cfg)
    resolved.placement.mode = c.mode
    resolved.placement.pools = [PoolConfig(roles=list(r), size=n) for r, n in c.pools] if c.mode == "split" else []
    for role, (tp, pp, _) in c.layouts:
        if (sec := role_section(resolved, role)) is not None:  # a rule reward has no layout
            sec.tp, sec.pp = tp, pp
    resolved.rollout.gen_tp = c.gen_tp
    plan = compute_plan(resolved, world_size=world_size, model=model, reward_model=reward_model)
    plan.predicted.update(chosen_by="placement.mode=auto", candidates_estimated=result.evaluated)
    return plan


def validate_batch(cfg: Config, plan: DevicePlan) -> None:
    """A launch (not an offline plan) also needs the step's samples to split over every DP group."""
    samples = cfg.data.batch_size * cfg.rollout.n
    for name, dp in [("rollout gen_dp", plan.gen_dp)] + [(f"{r}.dp", g.dp) for r, g in plan.groups.items()
                                                          if r != "rollout"]:
        if samples % dp:
            raise UserError(f"data.batch_size({cfg.data.batch_size}) x rollout.n({cfg.rollout.n}) = {samples} samples "
                            f"must split evenly over {name}={dp}; use a batch size that is a multiple of {dp}")
    if cfg.rollout.batches_in_flight > 1 and cfg.data.batch_size % plan.gen_dp:
        raise UserError(f"rollout.batches_in_flight: each generation replica trains the same number of groups a "
                        f"step; data.batch_size({cfg.data.batch_size}) must be a multiple of the rollout's "
                        f"gen_dp({plan.gen_dp})")
    if cfg.rollout.decode_beside and plan.gen_tp > 1:
        raise UserError(f"rollout.decode_beside decodes on a thread of each generation replica while the trainer runs "
                        f"its collectives; a replica of gen_tp={plan.gen_tp} ranks decodes by collectives too, in an "
                        f"order the ranks could not agree on: set rollout.gen_tp=1 or remove rollout.decode_beside")


def validate_context(cfg: Config, model: ModelConfig) -> None:
    """The longest sample (the longest kept prompt and a full response) fits the model's context: beyond
    max_position_embeddings its positions were never trained (or its rotary table ends)."""
    longest = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if longest > model.max_position_embeddings:
        raise UserError(f"data.max_prompt_length({cfg.data.max_prompt_length}) + rollout.max_response_length"
                        f"({cfg.rollout.max_response_length}) = {longest} tokens exceeds the model's context "
                        f"(max_position_embeddings={model.max_position_embeddings}); shorten either")


def validate_kv_cache(cfg: Config, plan: DevicePlan, *, cuda: bool) -> None:
    """On a GPU, the longest sample's KV cache fits the generation engine's budget (the cost model's sizing of
    rollout/model_runner.py): one that holds no sequence stops before launch, with the numbers, rather than in
    the engine at step 1. Off CUDA the engine's cache is host memory and is not budgeted."""
    reason = (plan.predicted or {}).get("kv_reject")
    if cuda and reason:
        raise UserError(f"the generation engine cannot hold one sample: {reason}")


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
    if cfg.reward.model is None or not cfg.reward.model.path:
        return None
    from models.hf_io import read_config

    try:
        return read_config(cfg.reward.model.path)
    except Exception as e:  # noqa: BLE001 - any unreadable reward model is a user error here
        raise UserError(f"reward.model.path: {e}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launcher.planning.plan", description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="key=value overrides")
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--json", action="store_true", help="print plan.json instead of the table")
    ap.add_argument("--auto", action="store_true", help="rank placements and layouts by the cost model")
    ap.add_argument("--top", type=int, default=5, help="--auto: how many plans to print")
    ap.add_argument("--schedules", default="config",
                    help="--auto: config (trainer.max_staleness as set), or a list of sync,async "
                         "(async: batches generated ahead, max_staleness >= 1)")
    ap.add_argument("--calibration", default=None, help="--auto: machine type or JSON (default placement.calibration)")
    ap.add_argument("--prompt-len", type=int, default=None, help="--auto: assumed prompt tokens")
    ap.add_argument("--response-len", type=int, default=None, help="--auto: assumed response tokens")
    args = ap.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        model, rm = resolve_model_config(cfg), resolve_reward_model_config(cfg)
        if args.auto:
            return _print_auto(cfg, args, model=model, reward_model=rm)
        from launcher.planning.fit import fit_memory

        for line in fit_memory(cfg, lambda c: compute_plan(c, world_size=args.world_size, model=model,
                                                           reward_model=rm).predicted):
            print(f"auto: {line}", file=sys.stderr)
        plan = compute_plan(cfg, world_size=args.world_size, model=model, reward_model=rm)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(plan.to_json() if args.json else plan.table())
    return 0


def _print_auto(cfg: Config, args, *, model: ModelConfig, reward_model: ModelConfig | None) -> int:
    from launcher.planning.autoplan import format_table, overrides_of, search
    from launcher.planning.costmodel import load_calibration

    if args.world_size < 1:
        raise UserError(f"world size must be >= 1, got {args.world_size}")
    try:
        cal = load_calibration(args.calibration or cfg.placement.calibration)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"calibration: {e}") from None
    names = {"sync": False, "async": True}
    if args.schedules == "config":
        schedules = None
    else:
        bad = [s for s in args.schedules.split(",") if s not in names]
        if bad:
            raise UserError(f"--schedules: {bad} unknown; use config, sync, async or sync,async")
        schedules = tuple(names[s] for s in args.schedules.split(","))
    result = search(cfg, world_size=args.world_size, model=model, reward_model=reward_model, cal=cal,
                    schedules=schedules, top=args.top, prompt_len=args.prompt_len, response_len=args.response_len)
    rm, k = cfg.reward.model is not None, cfg.trainer.max_staleness
    if args.json:
        print(json.dumps({"world_size": args.world_size, "calibration": cal.name, "evaluated": result.evaluated,
                          "plans": [dict(e.summary(cal), overrides=overrides_of(e.candidate, reward_model=rm,
                                                                               max_staleness=k))
                                    for e in result.best],
                          "rejected_examples": result.rejected}, indent=2))
    else:
        print(format_table(result, cal, world_size=args.world_size))
        if result.best:
            print("  launch the best: " + " ".join(repr(o) if " " in o else o
                                                    for o in overrides_of(result.best[0].candidate, reward_model=rm,
                                                                          max_staleness=k)))
    return 0 if result.best else 2

if __name__ == "__main__":
    sys.exit(main())
