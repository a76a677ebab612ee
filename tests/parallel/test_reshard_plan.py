"""Reshard planner, no processes: exact cover, lower-bound bytes, sources own their data (8..1024 ranks).

The reference for "what a rank holds" is written independently of the planner: element indices
of the full tensor sliced with parallel/sharding.py's TP table and torch.chunk over dp, the way
TP + FSDP2 lay parameters out.
"""

from __future__ import annotations

import random

import pytest
import torch

from models.config import ModelConfig, preset_config
from parallel.dims import TopologyError
from parallel.reshard import (
    GenLayout,
    ParamSpec,
    TrainLayout,
    assign_generation_ranks,
    box_numel,
    box_slices,
    param_specs,
    plan_buckets,
    plan_reshard,
)
from parallel.sharding import pp_stage_of, tp_slices

TINY = param_specs(preset_config("tiny"), itemsize=4)


def _wide_specs(num_layers: int, *, itemsize: int = 2) -> list[ParamSpec]:
    """Small shapes divisible by 16 with one column-, one row-parallel and one replicated param per layer."""
    h, inter, vocab = 64, 128, 256
    specs = [ParamSpec("model.embed_tokens.weight", (vocab, h), itemsize)]
    for i in range(num_layers):
        p = f"model.layers.{i}"
        specs += [ParamSpec(f"{p}.self_attn.q_proj.weight", (h, h), itemsize),
                  ParamSpec(f"{p}.mlp.down_proj.weight", (h, inter), itemsize),
                  ParamSpec(f"{p}.input_layernorm.weight", (h,), itemsize)]
    return specs + [ParamSpec("model.norm.weight", (h,), itemsize), ParamSpec("lm_head.weight", (vocab, h), itemsize)]


def _held(spec: ParamSpec, train: TrainLayout, rank: int, num_layers: int) -> torch.Tensor:
    """Flat indices of the full tensor that `rank` holds in training (independent of the planner)."""
    pp_idx, dp_idx, tp_idx = train.coords(rank)
    if pp_stage_of(spec.name, num_layers=num_layers, pp=train.pp) != pp_idx:
        return torch.empty(0, dtype=torch.int64)
    full = torch.arange(spec.numel).view(spec.shape)
    local = full[tp_slices(spec.name, spec.shape, rank=tp_idx, world=train.tp)]
    chunks = local.chunk(train.dp, dim=0)
    return chunks[dp_idx].reshape(-1) if dp_idx < len(chunks) else torch.empty(0, dtype=torch.int64)


def _gen(spec: ParamSpec, gen: GenLayout, g: int) -> torch.Tensor:
    full = torch.arange(spec.numel).view(spec.shape)
    return full[tp_slices(spec.name, spec.shape, rank=g, world=gen.tp)].reshape(-1)


def _check_ranks(plan, specs, ranks) -> None:
    train, gen, nl = plan.train, plan.gen, plan.num_layers
    asg = plan.assignment
    held = {}

    def held_of(pi, r):
        if (pi, r) not in held:
            held[(pi, r)] = _held(specs[pi], train, r, nl)
        return held[(pi, r)]

    for dst in ranks:
        g = asg.gen_tp_rank[dst]
        by_param: dict[int, list] = {}
        for t in plan.recvs[dst]:
            assert t.dst == dst
            by_param.setdefault(t.param, []).append(t)
        lower = 0
        for pi, spec in enumerate(specs):
            want = _gen(spec, gen, g)
            count = torch.zeros(spec.numel, dtype=torch.int64)
            mine = held_of(pi, dst)
            have = mine[torch.isin(mine, want)]
            count[have] += 1
            lower += (want.numel() - have.numel()) * spec.itemsize
            full = torch.arange(spec.numel).view(spec.shape)
            for t in by_param.get(pi, []):
                idx = full[box_slices(t.box)].reshape(-1)
                assert idx.numel() == box_numel(t.box) > 0
                # the source owns every element it sends
                assert torch.isin(idx, held_of(pi, t.src)).all(), (spec.name, t)
                count[idx] += 1
            assert (count[want] == 1).all(), f"{spec.name} on rank {dst}: elements covered {count[want].unique()}"
            assert count.sum() == want.numel(), f"{spec.name} on rank {dst}: elements outside its gen shard"
        assert plan.bytes_received(dst) == lower == plan.lower_bound_bytes(dst)


def _check_full(train: TrainLayout, gen_tp: int, specs) -> None:
    gen = GenLayout.for_world(train.world_size, tp=gen_tp)
    plan = plan_reshard(train, gen, specs)
    _check_ranks(plan, specs, range(train.world_size))
    sends = sorted((t.param, t.src, t.dst, t.box) for r in plan.sends for t in plan.sends[r])
    recvs = sorted((t.param, t.src, t.dst, t.box) for r in plan.recvs for t in plan.recvs[r])
    assert sends == recvs
    if plan.assignment.gather_is_closed:
        # one all-gather per micro-DP group: no transfer leaves its gather group
        g_of = plan.assignment.gen_tp_rank
        assert all(g_of[s] == g_of[d] for _, s, d, _ in sends)
    # planning one rank alone yields exactly that rank's part of the full plan
    for r in {0, train.world_size - 1, train.world_size // 2}:
        solo = plan_reshard(train, gen, specs, only_rank=r)
        key = lambda ts: sorted((t.param, t.src, t.dst, t.box) for t in ts)  # noqa: E731
        assert key(solo.recvs[r]) == key(plan.recvs[r])
        assert key(solo.sends[r]) == key(plan.sends[r])


@pytest.mark.parametrize("tp,pp,dp,gen_tp", [
    (2, 2, 1, 1), (2, 1, 2, 1), (4, 1, 1, 2), (2, 2, 2, 2), (1, 2, 2, 1), (1, 1, 4, 1),
    (2, 2, 2, 1), (4, 2, 1, 2), (1, 4, 2, 1), (8, 1, 1, 4), (2, 1, 4, 2),
    (1, 2, 4, 2), (2, 2, 2, 4), (1, 1, 8, 8),  # gen_tp a multiple of tp: sources outside the gather group
])
def test_plan_exact_cover_world_8(tp, pp, dp, gen_tp):
    _check_full(TrainLayout(tp=tp, pp=pp, dp=dp), gen_tp, TINY)


@pytest.mark.parametrize("tp,pp,dp,gen_tp", [(4, 2, 2, 2), (2, 4, 4, 1), (8, 2, 2, 4), (4, 4, 4, 4), (2, 2, 16, 2)])
def test_plan_exact_cover_16_to_64(tp, pp, dp, gen_tp):
    _check_full(TrainLayout(tp=tp, pp=pp, dp=dp), gen_tp, _wide_specs(8))


ODD = param_specs(ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=18, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=1), itemsize=2)


@pytest.mark.parametrize("tp,pp,dp,gen_tp", [
    (1, 1, 6, 2), (2, 1, 3, 1), (1, 3, 2, 2), (1, 1, 8, 1), (2, 1, 4, 2), (1, 2, 6, 1), (2, 3, 2, 2),
])
def test_plan_uneven_and_empty_fsdp_chunks(tp, pp, dp, gen_tp):
    """k_proj has 2 rows, vocab 100: torch.chunk leaves short and empty shards on the last dp ranks."""
    _check_full(TrainLayout(tp=tp, pp=pp, dp=dp), gen_tp, ODD)


@pytest.mark.parametrize("tp,pp,dp,gen_tp", [(8, 8, 4, 4), (16, 16, 4, 8)])
def test_plan_large_worlds(tp, pp, dp, gen_tp):
    """256 and 1024 ranks: volume and lower bound on every rank, element-exact cover on a sample."""
    train = TrainLayout(tp=tp, pp=pp, dp=dp)
    gen = GenLayout.for_world(train.world_size, tp=gen_tp)
    specs = _wide_specs(16)
    plan = plan_reshard(train, gen, specs)
    for r in range(train.world_size):
        assert plan.bytes_received(r) == plan.lower_bound_bytes(r)
        assert all(plan.assignment.gen_tp_rank[t.src] == plan.assignment.gen_tp_rank[r] for t in plan.recvs[r])
    _check_ranks(plan, specs, random.Random(0).sample(range(train.world_size), 24))


def test_identity_layout_moves_nothing():
    for tp in (1, 2, 4):
        plan = plan_reshard(TrainLayout(tp=tp), GenLayout(tp=tp), TINY)
        assert all(not plan.recvs[r] and not plan.sends[r] for r in range(tp))
        assert all(plan.lower_bound_bytes(r) == 0 for r in range(tp))


def test_generation_groups_follow_hybridflow_stride():
    asg = assign_generation_ranks(TrainLayout(tp=4, pp=1, dp=2), GenLayout(tp=2, dp=4))
    # training TP group [0,1,2,3] -> generation TP groups take every other rank
    assert asg.gen_tp_groups[:2] == [[0, 2], [1, 3]]
    assert asg.gather_groups == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert asg.gather_is_closed


def test_layout_errors_name_the_fix():
    with pytest.raises(TopologyError, match=r"must equal the training"):
        plan_reshard(TrainLayout(tp=2, pp=2), GenLayout(tp=2, dp=1), TINY)
    with pytest.raises(TopologyError, match=r"gen_tp\(3\) must divide training tp\(2\)"):
        assign_generation_ranks(TrainLayout(tp=2, dp=3), GenLayout(tp=3, dp=2))
    with pytest.raises(TopologyError, match=r"gen_tp\(8\) must divide the actor world size \(4\)"):
        GenLayout.for_world(4, tp=8)


@pytest.mark.parametrize("bucket_bytes", [1 << 12, 1 << 14, 1 << 30])
def test_buckets_cover_every_row_once_within_budget(bucket_bytes):
    plan = plan_reshard(TrainLayout(tp=2, pp=2), GenLayout(tp=1, dp=4), TINY, only_rank=0)
    buckets = plan_buckets(plan, bucket_bytes=bucket_bytes)
    rows: dict[int, list[tuple[int, int]]] = {}
    for b in buckets:
        cost = 0
        for s in b:
            rows.setdefault(s.param, []).append((s.start, s.stop))
            spec = plan.specs[s.param]
            row_bytes = spec.numel // spec.shape[0] * spec.itemsize
            cost += (s.stop - s.start) * row_bytes
        assert cost <= bucket_bytes // 2
    for pi, spec in enumerate(plan.specs):
        spans = rows[pi]
        assert spans[0][0] == 0 and spans[-1][1] == spec.shape[0]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    if bucket_bytes >= 1 << 30:
        assert len(buckets) == 1
    with pytest.raises(ValueError, match=r"bucket_bytes\(512\) is too small.*use bucket_bytes >= \d+"):
        plan_buckets(plan, bucket_bytes=512)


def test_tied_head_is_planned_under_both_names():
    specs = param_specs(preset_config("tiny", tie_word_embeddings=True), itemsize=4)
    names = [s.name for s in specs]
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    _check_full(TrainLayout(tp=2, pp=2, dp=1), 1, specs)


def test_qwen3_qk_norms_are_planned_replicated():
    specs = param_specs(preset_config("tiny-qwen3"), itemsize=4)
    norms = [s for s in specs if s.name.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 2 * 4 and all(s.shape == (32,) for s in norms)
    assert next(s for s in specs if s.name.endswith("0.self_attn.q_proj.weight")).shape == (4 * 32, 64)
    _check_full(TrainLayout(tp=2, pp=2, dp=2), 2, specs)


@pytest.mark.parametrize("tp,pp,dp,gen_tp", [(2, 2, 2, 1), (2, 2, 2, 2), (1, 1, 8, 1), (1, 2, 4, 4), (4, 1, 2, 2)])
def test_every_rank_stages_at_most_half_a_bucket(tp, pp, dp, gen_tp):
    """The rank-independent bucket cost really bounds what each rank packs and receives per bucket."""
    from parallel.reshard_exec import _group_members, _schedule

    train = TrainLayout(tp=tp, pp=pp, dp=dp)
    plan = plan_reshard(train, GenLayout.for_world(train.world_size, tp=gen_tp), TINY)
    bucket = 1 << 15
    for r in range(train.world_size):
        copies = len(_group_members(plan, r)) - 1
        for method_copies in (1, max(copies, 1)):
            for ops in _schedule(plan, r, bucket, method_copies):
                sent = {} if method_copies == 1 else []
                for op in ops:
                    if op.send and method_copies == 1:
                        sent[(op.param, op.box)] = box_numel(op.box)  # p2p packs a distinct piece once
                    elif op.send:
                        sent.append(box_numel(op.box))  # all-to-all packs one copy per peer
                recv = sum(box_numel(op.box) for op in ops if not op.send)
                total = (sum(sent.values()) if method_copies == 1 else sum(sent)) + recv
                assert total * 4 <= bucket // 2
