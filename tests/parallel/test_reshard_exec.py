"""Reshard executor in real gloo worlds: generation shards equal full-model slices bit for bit.

Training shards are cut from a full tiny-model state dict by the layout rules (TP table, pp
stage, torch.chunk over dp), independently of the planner, so a wrong plan cannot hide.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_world

# (tp, pp, dp, gen_tp) per world size; several layouts share one world (spawning is the slow part)
# (tp, pp, dp, gen_tp, bucket bytes, generation dtype or None = training dtype)
BIG = 1 << 28
CASES_4 = [(2, 2, 1, 1, 16384, None), (2, 2, 1, 1, BIG, None), (2, 1, 2, 1, BIG, None), (4, 1, 1, 2, 16384, None),
           (1, 2, 2, 1, BIG, None), (1, 1, 4, 1, 16384, None), (1, 2, 2, 2, 16384, None), (4, 1, 1, 4, BIG, None),
           (2, 2, 1, 1, 16384, torch.bfloat16), (4, 1, 1, 4, BIG, torch.bfloat16)]
CASES_8 = [(2, 2, 2, 2, 16384, None), (2, 2, 2, 1, BIG, None), (1, 2, 4, 4, 16384, None)]
# uneven FSDP chunks and empty shards: k_proj has 2 rows, vocab 100, intermediate 18
ODD = dict(vocab_size=100, hidden_size=8, intermediate_size=18, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=1)
CASES_8_ODD = [(1, 1, 8, 1, BIG, None), (1, 2, 4, 2, 4096, None), (2, 1, 4, 2, BIG, None)]
# Qwen3: per-head q/k norms (replicated under TP, FSDP-chunked) travel too; head_dim 16 x 4 heads != hidden 32,
# tied embeddings
QWEN3 = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
CASES_4_QWEN3 = [(2, 1, 2, 1, 4096, None)]  # norms gathered from FSDP chunks of TP replicas


def _slice_training(full: dict, tp: int, pp: int, dp: int, rank: int, num_layers: int) -> dict:
    from parallel.dims import ParallelDims
    from parallel.sharding import pp_stage_of, tp_slices

    pp_idx, dp_idx, tp_idx = ParallelDims(tp=tp, pp=pp, dp=dp).coords(rank)
    out = {}
    for name, t in full.items():
        if pp_stage_of(name, num_layers=num_layers, pp=pp) != pp_idx:
            continue
        local = t[tp_slices(name, tuple(t.shape), rank=tp_idx, world=tp)]
        chunks = local.chunk(dp, dim=0)  # FSDP2: dim 0 of the TP-local tensor, torch.chunk semantics
        out[name] = (chunks[dp_idx] if dp_idx < len(chunks) else local[:0]).clone()
    return out


def _body(rank, world, suites, device="cpu"):
    """suites: [(ModelConfig overrides or None for the tiny preset, cases)]. device "cuda": NCCL groups."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    return [r for overrides, cases in suites for r in _cases(rank, world, cases, overrides, device)]


def _cases(rank, world, cases, model_overrides, device):
    import torch.distributed as dist

    from models import ModelConfig, build_model
    from parallel.reshard import GenLayout, TrainLayout, param_specs, plan_reshard
    from parallel.reshard_exec import METHODS, ReshardStats, build_reshard_groups, execute_reshard
    from parallel.sharding import tp_slices

    model = build_model(ModelConfig(**model_overrides) if model_overrides else "tiny", seed=0)
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    full = {k: v.detach().to(dev) for k, v in model.state_dict().items()}
    nl = model.config.num_hidden_layers
    results = []
    for tp, pp, dp, gen_tp, bucket, gen_dtype in cases:
        train = TrainLayout(tp=tp, pp=pp, dp=dp)
        gen = GenLayout.for_world(world, tp=gen_tp)
        groups = build_reshard_groups((train, gen), list(range(world)), backend="nccl" if device == "cuda" else None)
        dtype = gen_dtype or torch.float32
        specs = param_specs(model.config, itemsize=torch.empty(0, dtype=dtype).element_size())
        plan = plan_reshard(train, gen, specs, only_rank=rank)
        shards = _slice_training(full, tp, pp, dp, rank, nl)
        before = {k: v.clone() for k, v in shards.items()}
        for method in METHODS:  # also: a second transition through the same groups and plan
            stats = ReshardStats()
            out = execute_reshard(plan, shards, groups=groups, bucket_bytes=bucket, dtype=gen_dtype, stats=stats,
                                  method=method)
            if device == "cuda":
                torch.cuda.synchronize()
            g = groups.gen_tp_rank
            assert set(out) == set(full)
            for name, t in full.items():
                want = t[tp_slices(name, tuple(t.shape), rank=g, world=gen_tp)].to(dtype)
                assert out[name].dtype == dtype
                assert torch.equal(out[name], want), f"{(tp, pp, dp, gen_tp)} {method} rank {rank}: {name} differs"
            # the training shards are untouched: going back is dropping the generation copy
            assert all(torch.equal(shards[k], before[k]) for k in shards)
            assert stats.bytes_received == plan.bytes_received(rank) == plan.lower_bound_bytes(rank)
            assert stats.staging_bytes == 0 and stats.peak_staging_bytes <= bucket
            if (tp, pp, dp) == (gen_tp, 1, 1) and gen_dtype is None:
                # identity layout: the training tensors themselves, not copies
                assert all(out[k].data_ptr() == shards[k].data_ptr() for k in shards)
                assert stats.gen_alloc_bytes == 0 and stats.bytes_received == 0
            results.append((tp, pp, dp, gen_tp, bucket, stats.buckets, stats.peak_staging_bytes, method))
            del out
        dist.barrier()
    return results


@pytest.mark.distributed
def test_reshard_world_4_bit_exact():
    res = run_world(_body, 4, ([(None, CASES_4), (QWEN3, CASES_4_QWEN3)],))
    # a small bucket really splits the transition into many buckets and stages column blocks
    small = [r for r in res[0] if r[:5] == (2, 2, 1, 1, 16384)]
    assert {r[7] for r in small} == {"alltoall", "p2p"} and all(r[5] > 10 and r[6] > 0 for r in small)


@pytest.mark.distributed
def test_reshard_world_8_bit_exact():
    run_world(_body, 8, ([(None, CASES_8), (ODD, CASES_8_ODD)],))


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_reshard_nccl_world_4_bit_exact():
    cases = [(2, 2, 1, 1, 1 << 16, None), (2, 1, 2, 1, BIG, None), (4, 1, 1, 2, 1 << 14, None),
             (1, 2, 2, 2, BIG, None), (2, 2, 1, 1, 1 << 16, torch.bfloat16), (4, 1, 1, 4, BIG, None)]
    run_world(_body, 4, ([(None, cases)], "cuda"))
