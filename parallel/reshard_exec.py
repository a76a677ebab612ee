"""Run a reshard plan (parallel/reshard.py) over real process groups: gloo in tests, NCCL on GPU.

    groups = build_reshard_groups((train, gen), ranks=list(range(world)))   # collective, every rank
    plan = plan_reshard(train, gen, specs, only_rank=groups.local_rank)
    gen_weights = execute_reshard(plan, training_shards(runner), groups=groups, bucket_bytes=256 << 20)

Transfers stay inside this rank's micro-DP gather group: together they are one all-gather per
group, all groups at once, but with no padding and no duplicate norms, so every rank receives
exactly the plan's lower bound. The plan is cut into buckets of dim-0 slabs, identical on all
ranks; bucket k is in flight while bucket k-1 is unpacked, so copies overlap communication, and
each bucket stages at most bucket_bytes // 2, so staging never exceeds bucket_bytes. Two ways
to move a bucket (`method`):

  alltoall  one all_to_all_single over packed buffers per bucket: a handful of launches per
            transition, at the price of packing and unpacking every piece (HBM copies, ~10x
            faster than the links they feed).
  p2p       one batched isend/irecv per piece, zero-copy where the piece is contiguous (dim-0
            boxes): no copies, but hundreds of ops, each with Python and launch overhead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel.reshard import (
    Box,
    GenAssignment,
    GenLayout,
    ParamSpec,
    ReshardPlan,
    TrainLayout,
    assign_generation_ranks,
    box_numel,
    box_slices,
    gen_box,
    intersect,
    plan_buckets,
    train_box,
)


@dataclass(slots=True)
class ReshardGroups:
    """Process groups of one actor group's hybrid engine; every rank builds all of them."""

    ranks: list[int]  # global ranks of the actor group, in local-rank order
    local_rank: int | None  # this process's index in `ranks`; None if it is not an actor rank
    assignment: GenAssignment
    gather_group: dist.ProcessGroup | None  # this rank's micro-DP group (holds one gen TP shard)
    gen_tp_group: dist.ProcessGroup | None  # this rank's generation TP group (for the rollout engine)
    actor_group: dist.ProcessGroup | None
    warmed: set[int] = field(default_factory=set)  # ids of groups that ran their first collective

    @property
    def gen_tp_rank(self) -> int:
        return self.assignment.gen_tp_rank[self.local_rank]

    @property
    def gen_dp_rank(self) -> int:
        return self.assignment.gen_dp_rank[self.local_rank]

    @property
    def transfer_group(self) -> dist.ProcessGroup | None:
        return self.gather_group if self.assignment.gather_is_closed else self.actor_group


def build_reshard_groups(plan_or_layouts: ReshardPlan | tuple[TrainLayout, GenLayout], ranks: list[int], *,
                         backend: str | None = None) -> ReshardGroups:
    """Create the gather groups, generation TP groups and the actor group. Collective on the world."""
    if isinstance(plan_or_layouts, ReshardPlan):
        asg = plan_or_layouts.assignment
    else:
        train, gen = plan_or_layouts
        asg = assign_generation_ranks(train, gen)
    if len(ranks) != len(asg.gen_tp_rank):
        raise ValueError(f"{len(ranks)} actor ranks given for a layout of {len(asg.gen_tp_rank)} ranks")
    me = dist.get_rank()
    local = ranks.index(me) if me in ranks else None

    def make(members_list: list[list[int]]) -> dist.ProcessGroup | None:
        mine = None
        for members in members_list:  # same order on every rank: new_group is collective
            pg = dist.new_group([ranks[m] for m in members], backend=backend)
            if local in members:
                mine = pg
        return mine

    gather = make(asg.gather_groups)
    gen_tp = make(asg.gen_tp_groups)
    actor = dist.new_group(list(ranks), backend=backend)
    return ReshardGroups(ranks=list(ranks), local_rank=local, assignment=asg, gather_group=gather,
                         gen_tp_group=gen_tp, actor_group=actor if local is not None else None)


# ---------------------------------------------------------------- shards in and out

def training_shards(runner) -> dict[str, torch.Tensor]:
    """HF name -> this rank's local training shard of a parallel.runner.ModelRunner (TP+FSDP2
    `to_local()` views that share storage with the parameters; see `NativeRunner.training_shards`)."""
    return runner.training_shards()


def shard_state_dict(full: dict[str, torch.Tensor], train: TrainLayout, rank: int, *,
                     num_layers: int) -> dict[str, torch.Tensor]:
    """Training shards of `rank` cut from a full state dict per the layout rules (benchmarks)."""
    out = {}
    for name, t in full.items():
        box = train_box(ParamSpec(name, tuple(t.shape), t.element_size()), train, rank, num_layers=num_layers)
        if box is not None:
            out[name] = t[box_slices(box)].clone()  # own storage: the full tensor can be freed
    return out


@dataclass(slots=True)
class ReshardStats:
    bytes_received: int = 0
    bytes_sent: int = 0
    bytes_copied_local: int = 0
    gen_alloc_bytes: int = 0  # the generation shard itself (aliased parameters excluded)
    staging_bytes: int = 0  # live now
    peak_staging_bytes: int = 0
    aliased: int = 0  # parameters handed out as the training tensors themselves
    buckets: int = 0

    def alloc(self, n: int) -> None:
        self.staging_bytes += n
        self.peak_staging_bytes = max(self.peak_staging_bytes, self.staging_bytes)

    def free(self, n: int) -> None:
        self.staging_bytes -= n


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _warm_up(groups: ReshardGroups, pg: dist.ProcessGroup, device: torch.device) -> None:
    # NCCL: the first p2p batch on a group must involve all its ranks; a collective makes it exist
    if id(pg) in groups.warmed:
        return
    dist.all_reduce(torch.zeros(1, device=device), group=pg)
    groups.warmed.add(id(pg))


@dataclass(frozen=True, slots=True)
class _Op:
    send: bool
    param: int
    peer: int  # local rank of the other side
    box: Box  # full-tensor coordinates, clipped to the bucket's slab
    tag: int  # position in the (src, dst) message stream: gloo matches on it, NCCL on order


def _schedule(plan: ReshardPlan, me: int, bucket_bytes: int, send_copies: int) -> list[list[_Op]]:
    """This rank's ops in every bucket (empty ones included), in an order both sides of every pair
    agree on: by slab, then (param, peer, box). Cached on the plan."""
    key = (me, bucket_bytes, send_copies)
    if key in plan.schedules:
        return plan.schedules[key]
    sends: dict[int, list] = {}
    recvs: dict[int, list] = {}
    for tr in sorted(plan.sends[me], key=lambda t: (t.param, t.dst, t.box)):
        sends.setdefault(tr.param, []).append(tr)
    for tr in sorted(plan.recvs[me], key=lambda t: (t.param, t.src, t.box)):
        recvs.setdefault(tr.param, []).append(tr)
    tags: dict[tuple[int, int], int] = {}

    def tag(src: int, dst: int) -> int:
        k = tags.get((src, dst), 0)
        tags[(src, dst)] = k + 1
        return k

    out = []
    for bucket in plan_buckets(plan, bucket_bytes=bucket_bytes, send_copies=send_copies):
        ops = []
        for slab in bucket:
            rows = ((slab.start, slab.stop),)
            for tr in sends.get(slab.param, ()):
                sub = intersect(tr.box, rows + tr.box[1:])
                if sub is not None:
                    ops.append(_Op(True, slab.param, tr.dst, sub, tag(me, tr.dst)))
            for tr in recvs.get(slab.param, ()):
                sub = intersect(tr.box, rows + tr.box[1:])
                if sub is not None:
                    ops.append(_Op(False, slab.param, tr.src, sub, tag(tr.src, me)))
        out.append(ops)
    plan.schedules[key] = out
    return out


def _group_members(plan: ReshardPlan, me: int) -> list[int]:
    asg = plan.assignment
    return asg.gather_groups[asg.gen_tp_rank[me]] if asg.gather_is_closed else list(range(plan.train.world_size))


def _group_is_active(plan: ReshardPlan, me: int) -> bool:
    """Does any rank of my transfer group receive anything? (all of them must join its collectives)"""
    key = ("active", me)
    if key not in plan.schedules:
        plan.schedules[key] = any(plan.lower_bound_bytes(m) > 0 for m in _group_members(plan, me))
    return plan.schedules[key]


METHODS = ("alltoall", "p2p")


def execute_reshard(plan: ReshardPlan, shards: dict[str, torch.Tensor], *, groups: ReshardGroups,
                    bucket_bytes: int, dtype: torch.dtype | None = None, method: str = "alltoall",
                    stats: ReshardStats | None = None) -> dict[str, torch.Tensor]:
    """Training shards (HF name -> local tensor) -> generation shards (HF name -> gen TP shard).

    Collective over the actor group. dtype: generation dtype (default: the shards' dtype); a
    parameter whose training shard already is its generation shard in that dtype is returned
    as the very same tensor, so gen layout == training layout copies nothing.
    method "alltoall": per bucket, one all_to_all_single in the gather group over packed buffers
    (few launches; every piece is copied in and out). "p2p": batched isend/irecv per piece,
    straight from the training shards into the generation tensors where contiguous (no copies,
    one op per piece). Both move exactly the plan's bytes.
    """
    if method not in METHODS:
        raise ValueError(f"unknown reshard method {method!r}; choose one of {METHODS}")
    stats = stats if stats is not None else ReshardStats()
    me = groups.local_rank
    if me is None or me not in plan.planned_ranks:
        raise ValueError(f"plan covers ranks {plan.planned_ranks[:8]}..., not this rank ({me}); "
                         f"plan with only_rank=groups.local_rank")
    if not shards:
        raise ValueError("no training shards given")
    first = next(iter(shards.values()))
    device, dtype = first.device, dtype or first.dtype
    g = plan.assignment.gen_tp_rank[me]
    unknown = sorted(set(shards) - {s.name for s in plan.specs})
    if unknown:
        raise KeyError(f"training shards {unknown[:4]} are not in the plan's parameter specs")

    out: dict[str, torch.Tensor] = {}
    tboxes, gboxes = [], []
    for spec in plan.specs:
        tbox = train_box(spec, plan.train, me, num_layers=plan.num_layers)
        gbox = gen_box(spec, gen_tp=plan.gen.tp, gen_tp_rank=g)
        tboxes.append(tbox)
        gboxes.append(gbox)
        if tbox is not None:
            want = tuple(b - a for a, b in tbox)
            have = shards.get(spec.name)
            if have is None or tuple(have.shape) != want:
                raise ValueError(
                    f"rank {me}: training shard of {spec.name} has shape "
                    f"{None if have is None else tuple(have.shape)}, the layout tp({plan.train.tp}) pp("
                    f"{plan.train.pp}) dp({plan.train.dp}) says {want}; pass what param.to_local() gives")
            if tbox == gbox and have.dtype == dtype:
                out[spec.name] = have
                stats.aliased += 1
                continue
        t = torch.empty(tuple(b - a for a, b in gbox), dtype=dtype, device=device)
        out[spec.name] = t
        stats.gen_alloc_bytes += _nbytes(t)
        inter = intersect(tbox, gbox) if tbox is not None else None
        if inter is not None:
            t[box_slices(inter, origin=gbox)].copy_(shards[spec.name][box_slices(inter, origin=tbox)])
            stats.bytes_copied_local += box_numel(inter) * t.element_size()

    if method == "p2p":
        _run_p2p(plan, me, shards, out, tboxes, gboxes, groups=groups, bucket_bytes=bucket_bytes, dtype=dtype,
                 device=device, stats=stats)
    else:
        _run_alltoall(plan, me, shards, out, tboxes, gboxes, groups=groups, bucket_bytes=bucket_bytes,
                      dtype=dtype, device=device, stats=stats)
    return out


def _run_p2p(plan, me, shards, out, tboxes, gboxes, *, groups, bucket_bytes, dtype, device, stats) -> None:
    schedule = [ops for ops in _schedule(plan, me, bucket_bytes, 1) if ops]
    if not schedule:
        return
    pg = groups.transfer_group
    _warm_up(groups, pg, device)
    names = [s.name for s in plan.specs]
    pending = None
    for ops in schedule:
        p2p, unpack, staged, packed = [], [], 0, {}
        for op in ops:
            name = names[op.param]
            if op.send:
                buf = packed.get((op.param, op.box))
                if buf is None:
                    view = shards[name][box_slices(op.box, origin=tboxes[op.param])]
                    if view.is_contiguous() and view.dtype == dtype:
                        buf = view  # zero copy: straight from the training shard
                    else:
                        buf = torch.empty(view.shape, dtype=dtype, device=device)
                        buf.copy_(view)
                        staged += _nbytes(buf)
                        stats.alloc(_nbytes(buf))
                    packed[(op.param, op.box)] = buf
                p2p.append(dist.P2POp(dist.isend, buf, peer=groups.ranks[op.peer], group=pg, tag=op.tag))
                stats.bytes_sent += _nbytes(buf)
            else:
                view = out[name][box_slices(op.box, origin=gboxes[op.param])]
                if view.is_contiguous():
                    buf = view  # zero copy: straight into the generation tensor
                else:
                    buf = torch.empty(view.shape, dtype=dtype, device=device)
                    staged += _nbytes(buf)
                    stats.alloc(_nbytes(buf))
                    unpack.append((view, buf))
                p2p.append(dist.P2POp(dist.irecv, buf, peer=groups.ranks[op.peer], group=pg, tag=op.tag))
                stats.bytes_received += _nbytes(buf)
        stats.buckets += 1
        works = dist.batch_isend_irecv(p2p)
        if pending is not None:
            _finish(pending, stats)  # unpack the previous bucket while this one is on the wire
        pending = (works, [v for v, _ in unpack], [b for _, b in unpack], staged)
    _finish(pending, stats)



def _bucket_views(by_peer: list[list[_Op]], flat: torch.Tensor, tensors: dict, names: dict,
                  boxes: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The ops' boxes laid out back to back in `flat` (peer by peer, as all_to_all_single splits it),
    and the same boxes as slices of their tensors (`boxes` gives each tensor's origin)."""
    flat_views, tensor_views, off = [], [], 0
    for lst in by_peer:
        for op in lst:
            n = box_numel(op.box)
            flat_views.append(flat[off:off + n].view(tuple(b - a for a, b in op.box)))
            tensor_views.append(tensors[names[op.param]][box_slices(op.box, origin=boxes[op.param])])
            off += n
    return flat_views, tensor_views

def _run_alltoall(plan, me, shards, out, tboxes, gboxes, *, groups, bucket_bytes, dtype, device, stats) -> None:
    if not _group_is_active(plan, me):
        return
    members = _group_members(plan, me)
    pg = groups.transfer_group
    _warm_up(groups, pg, device)
    size = len(members)
    grank = {m: dist.get_group_rank(pg, groups.ranks[m]) for m in members}
    names = [s.name for s in plan.specs]
    item = torch.empty(0, dtype=dtype).element_size()
    pending = None
    # every rank of the group joins every bucket's collective, even with nothing of its own in it
    for ops in _schedule(plan, me, bucket_bytes, max(size - 1, 1)):
        send_by: list[list[_Op]] = [[] for _ in range(size)]
        recv_by: list[list[_Op]] = [[] for _ in range(size)]
        for op in ops:
            (send_by if op.send else recv_by)[grank[op.peer]].append(op)
        in_splits = [sum(box_numel(op.box) for op in lst) for lst in send_by]
        out_splits = [sum(box_numel(op.box) for op in lst) for lst in recv_by]
        inp = torch.empty(sum(in_splits), dtype=dtype, device=device)
        outp = torch.empty(sum(out_splits), dtype=dtype, device=device)
        staged = (inp.numel() + outp.numel()) * item
        stats.alloc(staged)
        dst_views, src_views = _bucket_views(send_by, inp, shards, names, tboxes)
        if dst_views:
            torch._foreach_copy_(dst_views, src_views)  # pack (and cast) in one call
        recv_views, gen_views = _bucket_views(recv_by, outp, out, names, gboxes)
        stats.bytes_sent += inp.numel() * item
        stats.bytes_received += outp.numel() * item
        stats.buckets += 1
        work = dist.all_to_all_single(outp, inp, out_splits, in_splits, group=pg, async_op=True)
        if pending is not None:
            _finish(pending, stats)  # unpack the previous bucket while this one is on the wire
        pending = ([work], gen_views, recv_views, staged, inp)
    if pending is not None:
        _finish(pending, stats)


def _finish(pending, stats: ReshardStats) -> None:
    works, dst_views, src_views, staged = pending[:4]  # the rest only keeps send buffers alive
    for w in works:
        if w is not None:  # NCCL may return one work for the whole coalesced batch
            w.wait()
    if dst_views:
        torch._foreach_copy_(dst_views, src_views)
    stats.free(staged)
