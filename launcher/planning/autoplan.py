"""Search of placements and layouts by the cost model: `python -m launcher.planning.plan X.yaml --world-size W --auto`.

    result = search(cfg, world_size=64, model=model_cfg, cal=load_calibration("h200"))
    result.best[0].summary(cal), result.evaluated, result.rejected

Searched: colocated (every role on every GPU) and split placements (actor+rollout | the rest, and for
PPO with a reference also actor+rollout | critic+reward | ref), the pool sizes (every size up to two
nodes, whole nodes beyond), tp (powers of two within a node, dividing the heads) x pp (dividing the
layers) x dp per role and the generation tp. Role layouts are ranked alone first (the stage times of a
role do not depend on the other roles' layouts) and the fastest few of each, whose own memory fits,
are combined and estimated whole (phases, memory of the shared GPUs). Deterministic: candidates are
enumerated in a fixed order and ties broken by their description.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from launcher.planning.costmodel import Calibration, Candidate, Workload, model_pass_s
from launcher.planning.layout import validate_role_layout
from launcher.planning.stepmodel import Estimate, _activation_gb, _role_model, estimate
from parallel.dims import TopologyError

TRAINED = ("actor", "critic")
KEEP_PER_ROLE = 3  # fastest layouts per role carried into the joint search


@dataclass(slots=True)
class SearchResult:
    best: list[Estimate]
    evaluated: int
    rejected: list[str] = field(default_factory=list)  # a few reasons, for the user when nothing fits


def _pow2_upto(n: int) -> list[int]:
    return [2**i for i in range(n.bit_length()) if 2**i <= n]


def _fits(role: str, model, *, tp: int, pp: int, stages_per_rank: int = 1) -> bool:
    """The planner's own size rule (launcher.planning.layout.validate_role_layout), so no proposal is refused later."""
    try:
        validate_role_layout(role, model, tp=tp, pp=pp, stages_per_rank=stages_per_rank)
    except TopologyError:
        return False
    return True


def _tp_options(model, cal: Calibration) -> list[int]:
    return [t for t in _pow2_upto(cal.gpus_per_node)
            if model.num_attention_heads % t == 0 and model.num_key_value_heads % t == 0]


def _pp_options(model) -> list[int]:
    # whole layers per stage (even stages balance best); the size rules are _fits'
    return [p for p in (1, 2, 4, 8, 16) if model.num_hidden_layers % p == 0]


def pool_sizes(world: int, parts: int, cal: Calibration) -> list[tuple[int, ...]]:
    """Ways to cut `world` GPUs into `parts` pools: any sizes up to two nodes, whole nodes beyond."""
    unit = 1 if world <= 2 * cal.gpus_per_node else cal.gpus_per_node
    if world % unit:
        unit = 1
    n = world // unit
    if parts == 1:
        return [(world,)]
    if parts == 3 and n > 64:  # three pools at scale: 1/8 steps, enough to place the small roles
        unit, n = world // 8, 8
    out = []
    for cut in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cut, n)
        out.append(tuple((bounds[i + 1] - bounds[i]) * unit for i in range(parts)))
    return out


def role_layouts(w: Workload, cal: Calibration, role: str, *, gpus: int, model, samples: int,
                 share_prompts: bool, stages_per_rank: int = 1
                 ) -> tuple[list[tuple[float, tuple[int, int, int]]], float]:
    """(seconds, (tp, pp, dp)) of a role on `gpus` GPUs, fastest first, those whose own memory fits and
    that the planner accepts (validate_role_layout); and the least GB per GPU any layout of the role
    needs (to say why nothing fits)."""
    m = _role_model(w, role)
    if role == "reward" and m is None:  # rule reward: data parallel over the pool's CPUs
        return ([(0.0, (1, 1, gpus))] if samples % gpus == 0 else []), 0.0
    out, least = [], float("inf")
    for tp in _tp_options(model, cal):
        for pp in _pp_options(model):
            if gpus % (tp * pp) or (pp > 1 and share_prompts and role in ("actor", "ref")):
                continue
            if not _fits(role, model, tp=tp, pp=pp, stages_per_rank=stages_per_rank):
                continue
            dp = gpus // (tp * pp)
            if samples % dp:
                continue
            lay = (tp, pp, dp)
            train = role in TRAINED
            secs = model_pass_s(w, cal, role, m, layout=lay, train=train)
            if role == "actor" and w.old_logp_share:
                secs += w.old_logp_share * model_pass_s(w, cal, role, m, layout=lay, train=False)
            if role == "critic":
                secs += model_pass_s(w, cal, role, m, layout=lay, train=False)
            per = 16 if train else 4
            own = m.n_params * per / (tp * pp * dp) / 1e9 + _activation_gb(w, cal, role, m, lay, train=train)
            least = min(least, own)
            if own <= cal.hbm_gb:
                out.append((secs, lay))
    return sorted(out), least


def _gen_tps(model, cal: Calibration, actor: tuple[int, int, int], samples: int) -> list[int]:
    tp, pp, dp = actor
    n = tp * pp * dp
    out = []
    for g in _tp_options(model, cal):
        if ((tp * pp) % g == 0 and (tp % g == 0 or g % tp == 0) and samples % (n // g) == 0
                and _fits("rollout", model, tp=g, pp=1)):
            out.append(g)
    return out


def _structures(roles: list[str]) -> list[tuple[str, list[tuple[str, ...]]]]:
    rest = tuple(r for r in roles if r not in ("actor", "rollout"))
    out = [("colocated", [tuple(roles)]), ("split", [("actor", "rollout"), rest])]
    if "ref" in roles and "critic" in roles:
        out.append(("split", [("actor", "rollout"), tuple(r for r in rest if r != "ref"), ("ref",)]))
    return out


def search(cfg, *, world_size: int, model, reward_model=None, cal: Calibration,
           schedules: tuple[bool, ...] | None = None, top: int = 5, prompt_len: int | None = None,
           response_len: int | None = None) -> SearchResult:
    """The `top` fastest feasible candidates (sync/async per `schedules`; default the config's)."""
    from launcher.config.schema import active_roles, role_section
    from launcher.planning.costmodel import build_workload

    roles = active_roles(cfg)
    samples = cfg.data.batch_size * cfg.rollout.n
    schedules = (cfg.trainer.max_staleness > 0,) if schedules is None else schedules
    found: list[Estimate] = []
    rejected: list[str] = []
    evaluated = 0
    for is_async in schedules:
        w = build_workload(cfg, model=model, reward_model=reward_model, prompt_len=prompt_len,
                           response_len=response_len, is_async=is_async)
        for mode, pools in _structures(roles):
            if mode == "split" and world_size < len(pools):
                continue
            for sizes in pool_sizes(world_size, len(pools), cal):
                per_role = {}
                for pool, n in zip(pools, sizes):
                    for role in pool:
                        if role != "rollout":
                            shape = reward_model if (role == "reward" and reward_model) else model
                            fits, least = role_layouts(w, cal, role, gpus=n, model=shape, samples=samples,
                                                       share_prompts=w.share_prompts,
                                                       stages_per_rank=getattr(role_section(cfg, role),
                                                                               "pp_stages_per_rank", 1))
                            per_role[role] = fits[:KEEP_PER_ROLE]
                            if not fits and len(rejected) < 5:
                                why = (f"needs {least:.0f} GB per GPU > {cal.hbm_gb:.0f} GB usable at best"
                                       if least < float("inf") else f"no tp x pp x dp splits {samples} samples")
                                rejected.append(f"{mode} {'|'.join('+'.join(p) for p in pools)} {sizes}: "
                                                f"{role} on {n} GPUs {why}")
                if any(not v for v in per_role.values()):
                    continue
                names = sorted(per_role)
                for combo in itertools.product(*(per_role[r] for r in names)):
                    lay = dict(zip(names, (c[1] for c in combo)))
                    for g in _gen_tps(model, cal, lay["actor"], samples):
                        cand = Candidate(mode=mode, pools=tuple((tuple(p), n) for p, n in zip(pools, sizes)),
                                         layouts=tuple(sorted(lay.items())), gen_tp=g, is_async=is_async)
                        est = estimate(w, cal, cand)
                        evaluated += 1
                        if est.reject:
                            if len(rejected) < 5:
                                rejected.append(f"{cand.describe()}: {est.reject}")
                            continue
                        found.append(est)
    # equal times: the simpler layout first (fewer GPUs per model replica), then a fixed textual order
    def simplicity(e: Estimate) -> int:
        return sum(t * p for _, (t, p, _) in e.candidate.layouts) + e.candidate.gen_tp

    found.sort(key=lambda e: (round(e.step_s, 6), simplicity(e), e.candidate.describe()))
    return SearchResult(best=found[:top], evaluated=evaluated, rejected=rejected)


def candidate_from_plan(plan, *, is_async: bool) -> Candidate:
    """The Candidate of a launcher.planning.plan.DevicePlan (to predict a plan a config already fixes)."""
    pools = tuple((tuple(p), len(plan.groups[p[0]].ranks)) for p in plan.pools)
    layouts = tuple(sorted((r, (g.tp, g.pp, g.dp)) for r, g in plan.groups.items() if r != "rollout"))
    return Candidate(mode=plan.mode, pools=pools, layouts=layouts, gen_tp=plan.gen_tp, is_async=is_async)


def overrides_of(c: Candidate, *, reward_model: bool, max_staleness: int = 1) -> list[str]:
    """key=value overrides that make a config launch candidate `c` (what placement.mode=auto applies).
    reward_model: the config scores with a reward model (reward.model set; a rule reward has no layout keys);
    max_staleness: the bound an async candidate launches with (the config's when it sets one)."""
    from launcher.config.schema import section_name

    out = [f"placement.mode={c.mode}", f"rollout.gen_tp={c.gen_tp}",
           f"trainer.max_staleness={max(1, max_staleness) if c.is_async else 0}"]
    if c.mode == "split":
        pools = ", ".join(f"{{roles: [{', '.join(r)}], size: {n}}}" for r, n in c.pools)
        out.append(f"placement.pools=[{pools}]")
    for role, (tp, pp, _) in c.layouts:
        if role == "reward" and not reward_model:
            continue
        key = section_name(role)
        out += [f"{key}.tp={tp}", f"{key}.pp={pp}", f"{key}.dp=0"]
    return out


def format_table(result: SearchResult, cal: Calibration, *, world_size: int) -> str:
    lines = [f"auto placement over {world_size} GPUs ({cal.name} calibration): {result.evaluated} candidates "
             f"estimated, best {len(result.best)}"]
    head = f"  {'#':>2}  {'samples/s':>9}  {'step s':>7}  {'useful':>6}  {'pool util':>16}  {'peak GB':>7}  plan"
    lines.append(head)
    for i, e in enumerate(result.best, 1):
        util = "/".join(f"{u:.0%}" for u in e.pool_utilization())
        lines.append(f"  {i:>2}  {e.samples_per_s:>9.2f}  {e.step_s:>7.3f}  {e.useful_utilization(cal):>6.1%}  "
                     f"{util:>16}  {max(e.peak_gb):>7.1f}  {e.candidate.describe()}")
    if result.best:
        stages = ", ".join(f"{k} {v:.3f}" for k, v in result.best[0].stages.items() if v)
        lines.append(f"  best plan's stages (s): {stages}")
    if not result.best and result.rejected:
        lines.append("  nothing fits; e.g.:")
        lines += [f"    {r}" for r in result.rejected]
    return "\n".join(lines)
