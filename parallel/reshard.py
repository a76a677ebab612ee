"""Hybrid-engine reshard planner: training layout (tp, pp, dp) -> generation layout (gen_tp, gen_dp).

Pure: integers and parameter shapes in, a list of transfers out, so plans for 1024 ranks are
checked without processes (tests/parallel/test_reshard_plan.py). parallel/reshard_exec.py runs
a plan over real process groups.

Training shard of parameter p on actor rank r = (pp_idx, dp_idx, tp_idx) (parallel/dims.py
order): nothing unless stage pp_idx owns p (`pp_stage_of`); else the TP shard
`tp_slices(p, rank=tp_idx, world=tp)` whose dim 0 FSDP2 then splits across dp with torch.chunk
semantics (ceil(n/dp) rows per rank, the last ones short or empty). Every such shard is an
axis-aligned box of the full tensor, and the distinct boxes ("cells") partition it; a cell of a
TP-replicated parameter (norms) has tp holders.

Expert parallelism (ep > 1, tp = pp = 1; parallel/dims.py): a stacked expert tensor (`mlp.experts.*`, experts
along dim 0) is not FSDP-sharded: dp rank d holds experts [e * E/ep, (e + 1) * E/ep) whole, e = d % ep, so each
such cell has dp / ep holders. The engine runs experts whole, so its generation shard of them is the full tensor.

Generation shard: `tp_slices(p, rank=gen_tp_idx, world=gen_tp)` on every rank, all layers.
Ranks get generation coordinates as in HybridFlow's 3D-HybridEngine: with r = tp / gen_tp,
gen_tp_idx = tp_idx // r, so the training shard a rank holds lies inside its generation
shard. The ranks sharing one gen_tp_idx form a micro-DP "gather group" (gen_dp ranks, across
all pp stages and dp replicas) whose training shards together hold that generation shard
exactly once (modulo replicated norms); one all-gather in every gather group, all at once,
finishes the transition. Generation TP groups take one rank of each gather group, i.e. ranks
at stride r inside the training TP group. When gen_tp is a multiple of tp (q = gen_tp / tp)
each training TP shard is split over q generation shards and some sources lie outside the
gather group; the plan stays exact and the executor then uses the whole actor group.

Each destination receives exactly (bytes of its generation shard) - (bytes it already holds):
the cells partition the tensor, so every element it lacks comes from exactly one holder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallel.dims import ParallelDims, TopologyError
from parallel.sharding import layer_index, pp_stage_of, tp_shard_dim, tp_slices

TrainLayout = ParallelDims  # (tp, pp, dp) with the actor group's rank order
Box = tuple[tuple[int, int], ...]  # [start, stop) per dim, in full-tensor coordinates


@dataclass(frozen=True, slots=True)
class GenLayout:
    tp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise TopologyError(f"generation {name} must be a positive integer, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @classmethod
    def for_world(cls, world_size: int, *, tp: int) -> GenLayout:
        if world_size % tp:
            raise TopologyError(f"gen_tp({tp}) must divide the actor world size ({world_size})")
        return cls(tp=tp, dp=world_size // tp)


@dataclass(frozen=True, slots=True)
class ParamSpec:
    name: str  # Hugging Face name
    shape: tuple[int, ...]  # full (unsharded) shape
    itemsize: int  # bytes per element on the wire (the generation dtype)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(slots=True)
class Transfer:
    """`box` of parameter `param` (index into plan.specs) goes from local rank src to dst."""

    param: int
    src: int
    dst: int
    box: Box


@dataclass(slots=True)
class GenAssignment:
    """Generation coordinates of every actor rank (local indices 0..world-1)."""

    gen_tp_rank: list[int]
    gen_dp_rank: list[int]
    gather_groups: list[list[int]]  # [gen_tp][gen_dp]: ranks holding one generation TP shard
    gen_tp_groups: list[list[int]]  # [gen_dp][gen_tp]: one generation replica's TP group
    gather_is_closed: bool  # every source lies in its destination's gather group


@dataclass(slots=True)
class ReshardPlan:
    train: TrainLayout
    gen: GenLayout
    specs: list[ParamSpec]
    num_layers: int
    assignment: GenAssignment
    planned_ranks: tuple[int, ...]  # ranks whose sends and receives are complete in this plan
    recvs: dict[int, list[Transfer]] = field(default_factory=dict)  # dst -> transfers
    sends: dict[int, list[Transfer]] = field(default_factory=dict)  # src -> transfers
    schedules: dict = field(default_factory=dict, repr=False)  # executor's cache: (rank, bucket_bytes) -> ops

    def bytes_received(self, rank: int) -> int:
        return sum(box_numel(t.box) * self.specs[t.param].itemsize for t in self.recvs.get(rank, []))

    def lower_bound_bytes(self, rank: int) -> int:
        """Bytes of rank's generation shard minus the bytes of it the rank already holds."""
        g = self.assignment.gen_tp_rank[rank]
        total = 0
        for spec in self.specs:
            gbox = gen_box(spec, gen_tp=self.gen.tp, gen_tp_rank=g)
            held = train_box(spec, self.train, rank, num_layers=self.num_layers)
            inter = intersect(held, gbox) if held is not None else None
            total += (box_numel(gbox) - (box_numel(inter) if inter else 0)) * spec.itemsize
        return total


# ---------------------------------------------------------------- boxes

def box_numel(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= max(0, b - a)
    return n


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def box_slices(box: Box, *, origin: Box | None = None) -> tuple[slice, ...]:
    """Index into a tensor whose element [0, 0, ...] sits at `origin` of the full tensor."""
    if origin is None:
        return tuple(slice(a, b) for a, b in box)
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def _slices_to_box(sl: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(sl, shape))


def gen_box(spec: ParamSpec, *, gen_tp: int, gen_tp_rank: int) -> Box:
    return _slices_to_box(tp_slices(spec.name, spec.shape, rank=gen_tp_rank, world=gen_tp), spec.shape)


def fsdp_rows(rows: int, *, dp: int, dp_rank: int) -> tuple[int, int]:
    """torch.chunk split of `rows` into dp parts as FSDP2 does: ceil(rows/dp) each, tail short/empty."""
    step = -(-rows // dp)
    lo = min(dp_rank * step, rows)
    return lo, min(lo + step, rows)


def is_expert_param(name: str) -> bool:
    """A mixture of experts' stacked expert tensor (experts along dim 0): models/moe.py GroupedExperts."""
    return ".mlp.experts." in name


def expert_rows(spec: ParamSpec, train: TrainLayout, *, ep_rank: int) -> tuple[int, int]:
    """Rows (experts) of an expert tensor that the ranks of expert-parallel rank ep_rank hold whole."""
    per = spec.shape[0] // train.ep
    return ep_rank * per, (ep_rank + 1) * per


def train_box(spec: ParamSpec, train: TrainLayout, rank: int, *, num_layers: int) -> Box | None:
    """Box of the full tensor that `rank` holds in training (may be empty), None off its pp stage."""
    pp_idx, dp_idx, tp_idx = train.coords(rank)
    if pp_stage_of(spec.name, num_layers=num_layers, pp=train.pp) != pp_idx:
        return None
    if train.ep > 1 and is_expert_param(spec.name):
        full = _slices_to_box(tuple(slice(None) for _ in spec.shape), spec.shape)
        return (expert_rows(spec, train, ep_rank=dp_idx % train.ep),) + full[1:]
    box = list(_slices_to_box(tp_slices(spec.name, spec.shape, rank=tp_idx, world=train.tp), spec.shape))
    if spec.shape:
        (a, b) = box[0]
        lo, hi = fsdp_rows(b - a, dp=train.dp, dp_rank=dp_idx)
        box[0] = (a + lo, a + hi)
    return tuple(box)


def param_specs(model_cfg, *, itemsize: int) -> list[ParamSpec]:
    """Specs of every parameter of a full model of `model_cfg` (built on the meta device: no memory)."""
    import torch

    from models.llama import LlamaForCausalLM

    with torch.device("meta"):
        m = LlamaForCausalLM(model_cfg)
    # tied heads keep both names: a pipeline's last stage holds lm_head.weight on its own
    return [ParamSpec(n, tuple(p.shape), itemsize) for n, p in m.named_parameters(remove_duplicate=False)]


def num_layers_of(specs: list[ParamSpec]) -> int:
    idx = [i for s in specs if (i := layer_index(s.name)) is not None]
    return max(idx) + 1 if idx else 1


# ---------------------------------------------------------------- rank assignment

def assign_generation_ranks(train: TrainLayout, gen: GenLayout) -> GenAssignment:
    """HybridFlow grouping: each rank's generation TP shard contains (or splits) its training one."""
    world = train.world_size
    if gen.world_size != world:
        raise TopologyError(
            f"generation tp({gen.tp}) x dp({gen.dp}) = {gen.world_size} must equal the training "
            f"tp({train.tp}) x pp({train.pp}) x dp({train.dp}) = {world}; use GenLayout.for_world({world}, tp=...)")
    g_of = []
    for r in range(world):
        pp_idx, dp_idx, tp_idx = train.coords(r)
        if train.tp % gen.tp == 0:
            g_of.append(tp_idx // (train.tp // gen.tp))
        elif gen.tp % train.tp == 0:
            q = gen.tp // train.tp
            # each training TP shard splits into q generation shards, spread over its pp x dp holders
            g_of.append(tp_idx * q + (pp_idx * train.dp + dp_idx) % q)
        else:
            raise TopologyError(
                f"gen_tp({gen.tp}) must divide training tp({train.tp}) or be a multiple of it")
    gather = [[r for r in range(world) if g_of[r] == g] for g in range(gen.tp)]
    if any(len(m) != gen.dp for m in gather):
        raise TopologyError(
            f"cannot split tp({train.tp}) x pp({train.pp}) x dp({train.dp}) into gen_tp({gen.tp}) groups of "
            f"gen_dp({gen.dp}) ranks; pick gen_tp so that pp*dp is a multiple of gen_tp/tp")
    dp_of = [0] * world
    for members in gather:
        for j, r in enumerate(members):
            dp_of[r] = j
    tp_groups = [[gather[g][j] for g in range(gen.tp)] for j in range(gen.dp)]
    return GenAssignment(gen_tp_rank=g_of, gen_dp_rank=dp_of, gather_groups=gather, gen_tp_groups=tp_groups,
                         gather_is_closed=train.tp % gen.tp == 0)


# ---------------------------------------------------------------- planning

def _cells(spec: ParamSpec, train: TrainLayout, *, num_layers: int) -> list[tuple[Box, list[int]]]:
    """The distinct non-empty training boxes of a parameter (a partition of it) and their holders."""
    stage = pp_stage_of(spec.name, num_layers=num_layers, pp=train.pp)
    if train.ep > 1 and is_expert_param(spec.name):  # tp = pp = 1: ep cells, each on dp / ep replicas
        rest = _slices_to_box(tuple(slice(None) for _ in spec.shape), spec.shape)[1:]
        return [((expert_rows(spec, train, ep_rank=e),) + rest,
                 [train.local_rank(pp=0, dp=d, tp=0) for d in range(e, train.dp, train.ep)]) for e in range(train.ep)]
    sharded = tp_shard_dim(spec.name) is not None and train.tp > 1
    cells = []
    for tp_idx in range(train.tp if sharded else 1):
        tbox = _slices_to_box(tp_slices(spec.name, spec.shape, rank=tp_idx, world=train.tp), spec.shape)
        # replicated parameters: every tp rank of the stage holds the same box
        tps = [tp_idx] if sharded else list(range(train.tp))
        for dp_idx in range(train.dp):
            box = tbox
            if spec.shape:
                (a, b) = tbox[0]
                lo, hi = fsdp_rows(b - a, dp=train.dp, dp_rank=dp_idx)
                box = ((a + lo, a + hi),) + tbox[1:]
            if box_numel(box):
                cells.append((box, [train.local_rank(pp=stage, dp=dp_idx, tp=t) for t in tps]))
    return cells


def plan_reshard(train: TrainLayout, gen: GenLayout, param_specs: list[ParamSpec], *,
                 only_rank: int | None = None, num_layers: int | None = None) -> ReshardPlan:
    """Transfers that turn every rank's training shards into its generation shards.

    only_rank: plan just the sends and receives of that rank (what one process needs; the full
    plan at 1024 ranks holds millions of transfers). Sources among several holders of a
    replicated cell are picked inside the destination's gather group, spread by gen_dp rank.
    """
    asg = assign_generation_ranks(train, gen)
    nl = num_layers if num_layers is not None else num_layers_of(param_specs)
    if train.pp > nl:
        raise TopologyError(f"training pp({train.pp}) must not exceed num_hidden_layers({nl})")
    world = train.world_size
    planned = tuple(range(world)) if only_rank is None else (only_rank,)
    plan = ReshardPlan(train=train, gen=gen, specs=list(param_specs), num_layers=nl, assignment=asg,
                       planned_ranks=planned)
    for r in planned:
        plan.recvs[r] = []
        plan.sends[r] = []
    my_g = asg.gen_tp_rank[only_rank] if only_rank is not None else None
    for pi, spec in enumerate(param_specs):
        cells = _cells(spec, train, num_layers=nl)
        for g in range(gen.tp):
            gbox = gen_box(spec, gen_tp=gen.tp, gen_tp_rank=g)
            members = asg.gather_groups[g]
            for cbox, holders in cells:
                mine = only_rank is not None and only_rank in holders
                if only_rank is not None and not mine and g != my_g:
                    continue  # neither source nor destination of this cell's pieces
                inter = intersect(cbox, gbox)
                if inter is None:
                    continue
                in_group = [h for h in holders if asg.gen_tp_rank[h] == g] or holders
                if only_rank is None or mine:
                    dsts = members
                else:
                    dsts = [only_rank]  # a destination only: skip the scan of the whole group
                for dst in dsts:
                    if dst in holders:
                        continue  # already local: copied in place by the executor
                    src = in_group[asg.gen_dp_rank[dst] % len(in_group)]
                    if only_rank is not None and only_rank not in (src, dst):
                        continue
                    t = Transfer(param=pi, src=src, dst=dst, box=inter)
                    if dst in plan.recvs:
                        plan.recvs[dst].append(t)
                    if src in plan.sends:
                        plan.sends[src].append(t)
    return plan


# ---------------------------------------------------------------- buckets

@dataclass(frozen=True, slots=True)
class Slab:
    """Rows [start, stop) of dim 0 of parameter `param` (full-tensor coordinates)."""

    param: int
    start: int
    stop: int


def _slab_cost(spec: ParamSpec, train: TrainLayout, gen: GenLayout, *, send_copies: int):
    """n -> bytes one rank may stage for any n consecutive dim-0 rows of `spec`: the rows of its
    generation shard among them, plus send_copies copies of the rows of its training cell among
    them (a cell is at most ceil(tp-local rows / dp) consecutive rows)."""
    rows = spec.shape[0] if spec.shape else 1
    width = spec.numel // max(rows, 1)
    dim = tp_shard_dim(spec.name)
    gen_rows, gen_width = (rows // gen.tp, width) if dim == 0 else (rows, width // gen.tp if dim else width)
    tp_rows, cell_width = (rows // train.tp, width) if dim == 0 else (rows, width // train.tp if dim else width)
    cell_rows = -(-tp_rows // (train.ep if train.ep > 1 and is_expert_param(spec.name) else train.dp))
    return lambda n: spec.itemsize * (min(n, gen_rows) * gen_width + send_copies * min(n, cell_rows) * cell_width)


def plan_buckets(plan: ReshardPlan, *, bucket_bytes: int, send_copies: int = 1) -> list[list[Slab]]:
    """Cut every parameter into dim-0 slabs and group them into buckets, identically on every rank.

    The executor double-buffers (one bucket in flight while the previous one is unpacked), so a
    bucket may stage at most bucket_bytes // 2: peak staging stays within bucket_bytes. The cost
    is a rank-independent upper bound, so all ranks cut the same buckets without talking.
    send_copies: how many staged copies of one training row a rank may send (1 when each distinct
    piece is packed once; the gather-group size - 1 when every peer gets its own packed copy).
    """
    half = bucket_bytes // 2
    buckets: list[list[Slab]] = []
    cur: list[Slab] = []
    room = half
    for pi, spec in enumerate(plan.specs):
        rows = spec.shape[0] if spec.shape else 1
        cost = _slab_cost(spec, plan.train, plan.gen, send_copies=send_copies)
        if cost(1) > half:
            raise ValueError(f"bucket_bytes({bucket_bytes}) is too small: one row of {spec.name} may stage "
                             f"{cost(1)} bytes and a bucket holds half the budget; use bucket_bytes >= {2 * cost(1)}")
        start = 0
        while start < rows:
            lo, hi = 0, rows - start  # largest n with cost(n) <= room (cost is non-decreasing)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if cost(mid) <= room else (lo, mid - 1)
            if lo == 0:
                buckets.append(cur)
                cur, room = [], half
                continue
            cur.append(Slab(pi, start, start + lo))
            room -= cost(lo)
            start += lo
    if cur:
        buckets.append(cur)
    return buckets
