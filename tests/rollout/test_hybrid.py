"""HybridEngine in a real 4-rank gloo world, on real TP+FSDP2 and PP+FSDP2 actors and the native engine.

Proves: the completions equal those of a single-process engine on the full weights; the training
parameters are bit-identical after the cycle; a training step after a round trip (with optimizer
offload) gives the same loss as one without it; memory records show the offload and its undo.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_world

STEPS = ["start", "release_training", "gather", "wake_up", "update_weights", "generate", "sleep", "drop_gen",
         "restore_training"]


def _engine_config(**kw):
    from rollout.base import RolloutConfig

    return RolloutConfig(max_model_len=64, max_num_seqs=8, kv_cache_tokens=512, block_size=16,
                         enable_cuda_graph=False, **kw)


def _reference(full_model, prompts, sampling):
    from rollout.engine import NativeEngine

    return NativeEngine.from_model(full_model, config=_engine_config()).generate(prompts, sampling)


def _train_step(model, opt, ids) -> float:
    import torch.nn.functional as F

    logits = model.module(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _tp_fsdp_actor(world):
    from models import build_model
    from parallel.apply import parallelize_model
    from parallel.dims import ParallelDims, build_mesh

    dims = ParallelDims(tp=2, pp=1, dp=2)
    model = parallelize_model(build_model("tiny", seed=0), mesh=build_mesh(dims, list(range(world)), device_type="cpu"),
                              dims=dims)
    return dims, model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _locals(model) -> dict:
    from parallel.reshard_exec import training_shards

    return {k: v.clone() for k, v in training_shards(model).items()}


def _body(rank, world):
    from models import build_model
    from parallel.loading import full_state_dict
    from parallel.reshard import GenLayout
    from parallel.reshard_exec import build_reshard_groups
    from rollout.base import SamplingParams
    from rollout.engine import NativeEngine
    from rollout.hybrid import HybridEngine

    gen_ids = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, 512, (4, 17), generator=gen_ids) for _ in range(3)]
    prompts = [[1, 5, 9, 22], [1, 300, 7], [1, 42]]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = {}

    # ---- real TP=2 x FSDP2 dp=2 actor; generation at gen_tp 2 and 1 ----
    dims, actor, opt = _tp_fsdp_actor(world)
    ref_dims, ref_actor, ref_opt = _tp_fsdp_actor(world)
    assert _train_step(actor, opt, batches[0]) == _train_step(ref_actor, ref_opt, batches[0])
    full = build_model("tiny", seed=0)
    full.load_state_dict(full_state_dict(actor.module))
    expected = _reference(full, prompts, greedy)
    for gen_tp in (2, 1):
        gen = GenLayout.for_world(world, tp=gen_tp)
        groups = build_reshard_groups((dims, gen), list(range(world)))
        tp_group = groups.gen_tp_group if gen_tp > 1 else None
        engine = NativeEngine(full.config, config=_engine_config(), tp_group=tp_group)
        hybrid = HybridEngine(actor, engine, train_layout=dims, gen_layout=gen, groups=groups, bucket_bytes=16 << 10,
                              offload_optimizer_while_generating=True, optimizer=opt)
        before = _locals(actor)
        res = hybrid.generate(prompts, greedy)
        got = res.completions
        assert [c.token_ids for c in got] == [c.token_ids for c in expected], f"gen_tp={gen_tp}"
        for c, e in zip(got, expected):
            assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(e.logprobs), atol=1e-4)
        after = _locals(actor)
        assert all(torch.equal(before[k], after[k]) for k in before), "training shards changed"
        recs = {r.step: r for r in hybrid.memory_log}
        assert [r.step for r in hybrid.memory_log] == STEPS
        states = sum(v.to_local().numel() * 4 for s in opt.state.values() for v in s.values() if v.dim() > 0)
        # the optimizer states leave before the generation copy arrives
        assert states > 0 and recs["start"].allocated - recs["release_training"].allocated == states
        assert recs["restore_training"].allocated == recs["start"].allocated
        assert res.reshard.bytes_received == hybrid.plan.lower_bound_bytes(rank)
        assert res.reshard_s > 0 and res.generate_s > 0
        # the result carries the cycle's figures: its peak is the memory log's, its metrics name them
        assert res.peak_bytes == max(r.peak for r in hybrid.memory_log) > 0
        assert res.metrics() == {"reshard/bytes_received": float(res.reshard.bytes_received),
                                 "reshard/peak_staging_bytes": float(res.reshard.peak_staging_bytes),
                                 "reshard/engine_bytes": float(res.engine_bytes),
                                 "mem/hybrid_peak_gb": res.peak_bytes / 1e9}
        out[f"tp_fsdp_gen{gen_tp}"] = res.reshard.bytes_received
    # a step after two round trips equals the step without them (optimizer offload/restore exact)
    for ids in batches[1:]:
        assert _train_step(actor, opt, ids) == _train_step(ref_actor, ref_opt, ids)

    # ---- PP=2 x FSDP2 dp=2 actor (PipelineRunner), generation at gen_tp 1 ----
    from parallel.apply import parallelize_model
    from parallel.dims import ParallelDims, build_mesh

    pdims = ParallelDims(tp=1, pp=2, dp=2)
    pmesh = build_mesh(pdims, list(range(world)), device_type="cpu")
    runner = parallelize_model(build_model("tiny", seed=0), mesh=pmesh, dims=pdims, n_microbatches=2)
    gen = GenLayout.for_world(world, tp=1)
    groups = build_reshard_groups((pdims, gen), list(range(world)))
    engine = NativeEngine(full.config, config=_engine_config())
    hybrid = HybridEngine(runner, engine, train_layout=pdims, gen_layout=gen, groups=groups, bucket_bytes=1 << 20,
                          offload_optimizer_while_generating=False)
    res = hybrid.generate(prompts, greedy)
    got = res.completions
    want = _reference(build_model("tiny", seed=0), prompts, greedy)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.logprobs for c in got] == [c.logprobs for c in want]  # same weights, same tp=1 numerics
    out["pp_fsdp_gen1"] = res.reshard.bytes_received

    # ---- FSDP2 over 4 ranks of a model whose k_proj has 2 rows: uneven and empty dp shards ----
    from models import ModelConfig

    odd = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=18, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1)
    fdims = ParallelDims(tp=1, pp=1, dp=4)
    fmodel = parallelize_model(build_model(odd, seed=0), mesh=build_mesh(fdims, list(range(world)), device_type="cpu"),
                               dims=fdims)
    groups = build_reshard_groups((fdims, gen), list(range(world)))
    engine = NativeEngine(odd, config=_engine_config())
    hybrid = HybridEngine(fmodel, engine, train_layout=fdims, gen_layout=gen, groups=groups, bucket_bytes=1 << 16,
                          offload_optimizer_while_generating=False)
    odd_prompts = [[1, 5, 9], [1, 77]]
    got = hybrid.generate(odd_prompts, greedy).completions
    want = _reference(build_model(odd, seed=0), odd_prompts, greedy)
    assert [(c.token_ids, c.logprobs) for c in got] == [(c.token_ids, c.logprobs) for c in want]
    return out


@pytest.mark.distributed
def test_hybrid_engine_cycle_world_4():
    res = run_world(_body, 4, ())
    assert all(r["tp_fsdp_gen1"] > r["tp_fsdp_gen2"] > 0 for r in res)


def _gpu_body(rank, world):
    from models import build_model
    from parallel.dims import ParallelDims
    from parallel.native_runner import LocalRunner
    from parallel.reshard import GenLayout
    from parallel.reshard_exec import build_reshard_groups
    from rollout.base import SamplingParams
    from rollout.engine import NativeEngine
    from rollout.hybrid import HybridEngine

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    ids = [torch.randint(3, 512, (4, 17), generator=torch.Generator().manual_seed(i)).to(dev) for i in range(3)]
    models = [LocalRunner(build_model("tiny", seed=0, device=dev)) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    assert _train_step(models[0], opts[0], ids[0]) == _train_step(models[1], opts[1], ids[0])
    dims, gen = ParallelDims(), GenLayout(tp=1, dp=1)
    groups = build_reshard_groups((dims, gen), [0])
    # one decode kernel for both engines: "auto" times the kernels per engine and may pick differently, and
    # the log-probs are compared bit for bit
    engine = NativeEngine(models[0].module.config, config=_engine_config(decode_attention="triton"), device=dev,
                          dtype=torch.bfloat16)
    hybrid = HybridEngine(models[0], engine, train_layout=dims, gen_layout=gen, groups=groups, bucket_bytes=1 << 20,
                          offload_optimizer_while_generating=True, optimizer=opts[0], gen_dtype=torch.bfloat16)
    ref = build_model("tiny", seed=0)
    ref.load_state_dict(models[0].module.state_dict())
    ref = ref.to(device=dev, dtype=torch.bfloat16)
    prompts, greedy = [[1, 5, 9, 22], [1, 300, 7]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = NativeEngine.from_model(ref, config=_engine_config(decode_attention="triton")).generate(prompts, greedy)
    got = hybrid.generate(prompts, greedy).completions
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.logprobs for c in got] == [c.logprobs for c in want]
    recs = {r.step: r for r in hybrid.memory_log}
    states = sum(v.numel() * v.element_size() for s in opts[0].state.values() for v in s.values() if v.dim() > 0)
    assert recs["start"].allocated - recs["release_training"].allocated >= states  # moved to pinned host memory
    assert recs["restore_training"].allocated == recs["start"].allocated
    for x in ids[1:]:  # CUDA reductions may reorder: equal to float rounding, not bitwise
        a, b = _train_step(models[0], opts[0], x), _train_step(models[1], opts[1], x)
        assert abs(a - b) <= 1e-6 * abs(b), (a, b)
    return [r.step for r in hybrid.memory_log]


@pytest.mark.gpu
@pytest.mark.distributed
def test_hybrid_engine_cycle_cuda():
    assert run_world(_gpu_body, 1, ())[0] == STEPS
