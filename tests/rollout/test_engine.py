"""NativeEngine on CPU (tiny preset, fp32) against the training forward and naive loops."""

import copy
import itertools

import pytest
import torch

from models import build_model, preset_config
from rollout import NativeEngine, RolloutConfig, SamplingParams
from rollout.scheduler import length_bucket

PROMPTS = [[1, 17, 33, 9, 250], [1, 4], [1, 100, 200, 300, 400, 500, 7, 8, 9], [3] * 20, [1, 2, 3]]


def peaked_model(seed=0, scale=20.0, layers=None):
    """Random tiny model with a scaled lm_head (peaked distributions make sampling tests meaningful) and norm
    weights away from 1 (the engine folds them into its projections: rollout/folded_norms.py). layers: fewer
    than the preset's 4 (the Triton interpreter's tests run each layer's kernel programs in Python)."""
    model = build_model(preset_config("tiny", **({} if layers is None else {"num_hidden_layers": layers})), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
    return model


def config(**kw):
    base = dict(max_model_len=96, block_size=16, kv_cache_tokens=96 * 16, max_num_seqs=16, max_num_batched_tokens=256)
    return RolloutConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return peaked_model()


def trainer_logprobs(model, prompt, tokens, temperature):
    """log_softmax(model(full_ids) / T) gathered at the generated tokens (T = 1 when greedy)."""
    ids = torch.tensor([prompt + tokens], device=model.lm_head.weight.device)
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1: -1].float()
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, dim=-1).gather(1, ids[0, len(prompt):, None])[:, 0].cpu()


def naive_greedy(model, prompt, steps):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_logprobs_equal_trainer_forward(model):
    params = [SamplingParams(temperature=0.7, top_k=30, top_p=0.9, max_tokens=24, seed=1, ignore_eos=True),
              SamplingParams(temperature=1.3, max_tokens=17, n=3, seed=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.5, max_tokens=12, seed=4, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)]
    outs = NativeEngine.from_model(model, config=config()).generate(PROMPTS, params)
    assert len(outs) == 7
    for c in outs:
        p = params[c.prompt_index]
        assert len(c.token_ids) == p.max_tokens and c.finish_reason == "length"
        ref = trainer_logprobs(model, c.prompt_ids, c.token_ids, p.temperature)
        assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("fuse", [True, False])
def test_greedy_equals_naive_loop(model, fuse):
    outs = NativeEngine.from_model(model, config=config(fuse_projections=fuse)).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True))
    for c in outs:
        assert c.token_ids == naive_greedy(model, c.prompt_ids, 15)


def test_small_cache_queues_and_compacts_with_identical_outputs(model):
    prompts = [[1, i + 3, 2 * i + 5] for i in range(9)]
    # unequal lengths leave holes in the slots while others still run -> compaction moves
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 5 * (i % 3), ignore_eos=True) for i in range(9)]
    big = NativeEngine.from_model(model, config=config()).generate(prompts, params)
    small_engine = NativeEngine.from_model(model, config=config(kv_cache_tokens=96 * 3, max_num_seqs=8,
                                                                max_num_batched_tokens=5))
    small = small_engine.generate(prompts, params)
    assert [c.token_ids for c in small] == [c.token_ids for c in big]
    assert all(abs(a - b) <= 1e-5 for cs, cb in zip(small, big) for a, b in zip(cs.logprobs, cb.logprobs))
    assert small_engine.runner.num_slots == 3
    assert small_engine.stats["prefill_steps"] >= 9  # budget of 5 tokens: one 3-token prompt per prefill
    # sequences finishing out of order in the tail leave holes: moving KV between slots must be exact
    assert small_engine.stats["slot_moves"] >= 1


def test_seeded_sampling_reproducible_and_batch_independent(model):
    p = SamplingParams(temperature=1.0, max_tokens=16, n=4, seed=123, ignore_eos=True)
    engine = NativeEngine.from_model(model, config=config())
    alone = engine.generate([PROMPTS[0]], p)
    again = engine.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]],
                            [SamplingParams(temperature=1.0, max_tokens=9, n=2), p, SamplingParams(temperature=0)])
    mine = [c for c in again if c.prompt_index == 1]
    assert [c.token_ids for c in alone] == [c.token_ids for c in mine]
    assert [c.sample_index for c in alone] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in alone}) == 4  # the n samples differ from each other
    other = engine.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_tokens=16, n=4, seed=124,
                                                         ignore_eos=True))
    assert [c.token_ids for c in other] != [c.token_ids for c in alone]


def test_unseeded_requests_reproducible_from_engine_seed(model):
    p = SamplingParams(temperature=1.0, max_tokens=10, n=2, ignore_eos=True)
    a = NativeEngine.from_model(model, config=config(seed=5)).generate(PROMPTS[:2], p)
    b = NativeEngine.from_model(model, config=config(seed=5)).generate(PROMPTS[:2], p)
    c = NativeEngine.from_model(model, config=config(seed=6)).generate(PROMPTS[:2], p)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_top_k_one_equals_greedy(model):
    engine = NativeEngine.from_model(model, config=config())
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    topk1 = engine.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_tokens=12, seed=9,
                                                    ignore_eos=True))
    assert [c.token_ids for c in topk1] == [c.token_ids for c in greedy]


def test_bad_requests_fail_alone(model):
    engine = NativeEngine.from_model(model, config=config())
    ok = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    cases = [([], ok, "empty prompt"),
             ([1] * 96, ok, "max_model_len"),
             ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
             ([1, 2], SamplingParams(top_p=0.0), "top_p"),
             ([1, 2], SamplingParams(top_p=1.5), "top_p"),
             ([1, 2], SamplingParams(n=0), "n=0"),
             ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
             ([1, 100000], ok, "outside the vocabulary")]
    prompts = [PROMPTS[0]] + [c[0] for c in cases] + [PROMPTS[1]]
    params = [ok] + [c[1] for c in cases] + [ok]
    outs = engine.generate(prompts, params)
    assert len(outs) == len(prompts)
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 5
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 5
    for c, (_, _, needle) in zip(outs[1:-1], cases):
        assert c.finish_reason == "error" and c.token_ids == [] and needle in c.error, c.error


def test_stop_tokens_and_eos(model):
    engine = NativeEngine.from_model(model, config=config())
    free = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    c = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at]))[0]
    assert c.finish_reason == "stop" and c.token_ids == free.token_ids[: first + 1]
    eos_engine = NativeEngine.from_model(model, config=config(), eos_token_ids=[stop_at])
    c = eos_engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert c.finish_reason == "stop" and c.token_ids == free.token_ids[: first + 1]
    c = eos_engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert c.token_ids == free.token_ids


def test_max_model_len_finishes_with_length(model):
    engine = NativeEngine.from_model(model, config=config(max_model_len=24))
    c = engine.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))[0]
    assert c.finish_reason == "length" and len(c.prompt_ids) + len(c.token_ids) == 24
    assert c.token_ids == naive_greedy(model, PROMPTS[3], 4)


def test_sleep_wake_and_update_weights(model):
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = NativeEngine(model.config, config=config())
    with pytest.raises(RuntimeError, match="not loaded"):
        engine.generate(PROMPTS, p)
    engine.update_weights(model.state_dict().items())
    before = engine.generate(PROMPTS, p)
    engine.sleep()
    assert engine.runner.cache is None and all(t.numel() == 0 for t in engine.runner.params.values())
    with pytest.raises(RuntimeError, match="sleeping"):
        engine.generate(PROMPTS, p)
    engine.wake_up()
    with pytest.raises(RuntimeError, match="not loaded"):  # the mirror of the trainer's weights was dropped
        engine.generate(PROMPTS, p)
    engine.update_weights(model.state_dict().items())
    assert [c.token_ids for c in engine.generate(PROMPTS, p)] == [c.token_ids for c in before]
    other = peaked_model(seed=1)
    engine.update_weights(other.state_dict().items())
    changed = engine.generate(PROMPTS, p)
    assert [c.token_ids for c in changed] != [c.token_ids for c in before]
    assert [c.token_ids for c in changed] == [naive_greedy(other, q, 8) for q in PROMPTS]
    with pytest.raises(ValueError, match="shard"):
        engine.update_weights([("model.norm.weight", torch.ones(3))])


def test_sleep_without_freeing_keeps_buffers_and_takes_new_weights_in_place(model):
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = NativeEngine(model.config, config=config(free_memory_on_sleep=False))
    engine.update_weights(model.state_dict().items())
    before = engine.generate(PROMPTS, p)
    cache, weight = engine.runner.cache.data.data_ptr(), engine.runner.params["lm_head.weight"].data_ptr()
    engine.sleep()
    with pytest.raises(RuntimeError, match="sleeping"):
        engine.generate(PROMPTS, p)
    engine.wake_up()
    other = peaked_model(seed=1)
    engine.update_weights(other.state_dict().items())
    changed = engine.generate(PROMPTS, p)
    assert [c.token_ids for c in changed] != [c.token_ids for c in before]
    assert [c.token_ids for c in changed] == [naive_greedy(other, q, 8) for q in PROMPTS]
    # nothing was re-allocated, so captured CUDA graphs (which hold these pointers) stay valid
    assert engine.runner.cache.data.data_ptr() == cache
    assert engine.runner.params["lm_head.weight"].data_ptr() == weight


def test_new_weight_storage_drops_the_graphs_and_their_pool(model):
    """Weights that replace an aliased tensor's storage invalidate every captured graph; their pool goes with them,
    since capturing into a pool whose graphs are all gone trips CUDA's caching allocator (seen on an H100)."""
    engine = NativeEngine.from_model(copy.deepcopy(model), config=config(free_memory_on_sleep=False))
    runner = engine.runner
    runner.graphs[(8, 64, False, 0)], runner.graph_pool = object(), object()  # as a capture leaves them
    engine.update_weights(model.state_dict().items())  # aliased -> own storage
    assert runner.graphs == {} and runner.graph_pool is None
    engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    pool = runner.graph_pool = object()
    engine.update_weights(peaked_model(seed=1).state_dict().items())  # copied in place: the graphs stay valid
    assert runner.graph_pool is pool


class GraphStandIn:
    """A captured decode graph's stand-in on the CPU: a replay runs the step it was captured for, reading the
    shared-prompt member table of the width it was captured at; `seen`: the runner's width at each replay."""

    def __init__(self, runner, step, width):
        self.runner, self.step, self.width, self.seen = runner, step, width, []

    def replay(self):
        now, self.runner._prefix_width = self.runner._prefix_width, self.width
        self.seen.append(now)
        try:
            self.runner._decode_step(*self.step)
        finally:
            self.runner._prefix_width = now


def test_steps_that_may_not_capture_replay_the_graph_of_more_rows(model):
    """Beside training nothing is captured; a step of a shape without a graph replays the captured graph of more rows
    (the rest padding rows) and samples what an eager step samples (filtered sampling, shared prompts, rows ending)."""
    params = [SamplingParams(temperature=0.7, top_k=30, top_p=0.9, max_tokens=24, seed=1, ignore_eos=True),
              SamplingParams(temperature=1.3, max_tokens=17, n=3, seed=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)]
    eager = NativeEngine.from_model(copy.deepcopy(model), config=config()).generate(PROMPTS[:4], params)
    engine = NativeEngine.from_model(copy.deepcopy(model), config=config())
    runner = engine.runner
    runner.use_graphs, runner.may_capture = True, False
    widths = {0, *(runner.prefix_tables or {})}
    kv_lens = {length_bucket(n, granule=16, cap=runner.slot_len) for n in range(1, runner.slot_len + 1)}
    for kv, filtered, width in itertools.product(kv_lens, (False, True), widths):  # 16 rows: every slot
        runner.graphs[(16, kv, filtered, width)] = GraphStandIn(runner, (16, kv, filtered), width)
    graphs = dict(runner.graphs)
    out = engine.generate(PROMPTS[:4], params)
    assert runner.graphs == graphs  # nothing captured
    assert sum(len(g.seen) for g in graphs.values()) == engine.stats["decode_steps"] > 20
    for a, b in zip(eager, out, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_an_engine_made_resident_while_asleep_reallocates_once_then_keeps_its_buffers(model):
    """rollout.free_memory_on_sleep unset: the first step frees on sleep, then the run may keep the engine resident
    (ppo.roles.generation.settle_residency): the next wake_up allocates again, later sleeps free nothing."""
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = NativeEngine(model.config, config=config())
    engine.update_weights(model.state_dict().items())
    before = engine.generate(PROMPTS, p)
    assert engine.runner.absent_weight_bytes() == 0
    engine.sleep()
    assert engine.runner.cache is None
    # what the KV sizing at the next wake keeps free for the weights that come back after it (CUDA)
    item = next(iter(engine.runner.params.values())).element_size()
    assert engine.runner.absent_weight_bytes() == sum(p.numel() * item for p in model.parameters())
    engine.config.free_memory_on_sleep = False
    engine.wake_up()
    assert engine.runner.cache is not None
    engine.update_weights(model.state_dict().items())
    assert [c.token_ids for c in engine.generate(PROMPTS, p)] == [c.token_ids for c in before]
    cache = engine.runner.cache.data.data_ptr()
    engine.sleep()
    engine.wake_up()
    assert engine.runner.cache.data.data_ptr() == cache
    assert [c.token_ids for c in engine.generate(PROMPTS, p)] == [c.token_ids for c in before]


def test_from_model_sleep_wake_realiases(model):
    engine = NativeEngine.from_model(model, config=config())
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = engine.generate(PROMPTS[:2], p)
    assert engine.runner.params["lm_head.weight"].data_ptr() == model.lm_head.weight.data_ptr()  # no copy
    engine.sleep()
    assert model.lm_head.weight.numel() > 0  # the trainer's weights are untouched
    engine.wake_up()
    assert [c.token_ids for c in engine.generate(PROMPTS[:2], p)] == [c.token_ids for c in before]


def test_data_dependent_stops_with_pipelined_decode_and_slot_reuse(model):
    """Stops the host learns one step late (the next step is already in flight) must not leak junk tokens,
    and the freed slots are reused by waiting requests."""
    prompts = [[1, 7 * i + 3, 11 * i + 2, i + 1] for i in range(8)]
    free = [naive_greedy(model, q, 14) for q in prompts]
    stop = sorted({t for f in free for t in f[2:8]}, key=lambda t: -sum(t in f[2:8] for f in free))[:2]
    engine = NativeEngine.from_model(model, config=config(kv_cache_tokens=96 * 3, max_num_seqs=3))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=14, stop_token_ids=stop))
    stopped = 0
    for c, f in zip(outs, free):
        cut = next((k + 1 for k, t in enumerate(f) if t in stop), None)
        assert c.token_ids == f[:cut] and c.finish_reason == ("stop" if cut else "length")
        stopped += cut is not None and cut < 14
        ref = trainer_logprobs(model, c.prompt_ids, c.token_ids, 0.0)
        assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= 1e-5
    assert stopped >= 2


def test_update_weights_never_writes_through_to_the_aliased_model(model):
    source = peaked_model(seed=4)
    before = source.lm_head.weight.clone()
    engine = NativeEngine.from_model(source, config=config())
    other = peaked_model(seed=5)
    engine.update_weights(other.state_dict().items())
    assert torch.equal(source.lm_head.weight, before)
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert [c.token_ids for c in engine.generate(PROMPTS[:2], p)] == [naive_greedy(other, q, 6) for q in PROMPTS[:2]]


def test_update_weights_share_aliases_without_copy(model):
    engine = NativeEngine(model.config, config=config())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    engine.update_weights(state.items(), share=True)
    assert engine.runner.params["model.norm.weight"].data_ptr() == state["model.norm.weight"].data_ptr()
    p = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    assert [c.token_ids for c in engine.generate(PROMPTS[:2], p)] == [naive_greedy(model, q, 5) for q in PROMPTS[:2]]


def test_decode_kernel_timing_leaves_the_live_cache_alone(model):
    engine = NativeEngine.from_model(model, config=config())
    runner = engine.runner
    before = runner.cache.data[:, :, :, :, : runner.slot_len].clone()
    kernel = runner._time_kernels(4, 32)  # what "auto" does per CUDA-graph shape (CPU: sdpa or bmm run)
    assert kernel in ("sdpa", "bmm")
    assert torch.equal(runner.cache.data[:, :, :, :, : runner.slot_len], before)
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = NativeEngine.from_model(model, config=config(decode_attention="bmm")).generate(PROMPTS[:2], p)
    assert [c.token_ids for c in outs] == [naive_greedy(model, q, 6) for q in PROMPTS[:2]]


def test_compiled_prefill_and_decode_match_naive_greedy_across_shapes(model):
    """config.compile: one dynamic-shape graph each for prefill and decode; new prompt counts and
    lengths must neither change the result nor fall back to eager."""
    from torch._dynamo.utils import counters

    engine = NativeEngine.from_model(model, config=config(compile=True))
    graphs = None
    # one prompt, and one sequence, too: sizes of 1 (which Dynamo specialises) never reach the compiled graphs
    for prompts, n in ((PROMPTS, 1), (PROMPTS[1:4], 1), ([[5, 6, 7, 8, 9, 10, 11]] * 2, 1), ([PROMPTS[2]], 1),
                       ([PROMPTS[0]], 2)):
        outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, n=n))
        assert [c.token_ids for c in outs] == [naive_greedy(model, q, 5) for q in prompts for _ in range(n)]
        graphs = counters["stats"]["unique_graphs"] if graphs is None else graphs
    assert counters["stats"]["unique_graphs"] == graphs, "a new prompt count or length recompiled"
    assert engine.runner._decode.error is None and engine.runner._prefill.error is None


def test_a_wake_up_with_fewer_slots_recompiles_nothing(model):
    """On a GPU the KV cache is sized at each wake-up from the memory free then (the first step has no optimizer
    state yet: more slots than the next); the compiled prefill and decode take the slot count as a dynamic dim.
    Each new size recompiled both, in the second step of the Qwen3 recipe on an H100."""
    import dataclasses

    from torch._dynamo.utils import counters

    engine = NativeEngine.from_model(model, config=config(compile=True, free_memory_on_sleep=True))
    p = SamplingParams(temperature=0.0, max_tokens=5, n=3, ignore_eos=True)
    graphs, slots = [], []
    for tokens in (96 * 16, 96 * 12, 96 * 9):
        engine.sleep()
        engine.runner.config = dataclasses.replace(engine.runner.config, kv_cache_tokens=tokens)
        engine.wake_up()
        outs = engine.generate(PROMPTS[:4], p)
        assert [c.token_ids for c in outs] == [naive_greedy(model, q, 5) for q in PROMPTS[:4] for _ in range(3)]
        graphs.append(counters["stats"]["unique_graphs"])
        slots.append(engine.runner.num_slots)
    assert slots == [16, 12, 9]
    assert graphs[1:] == [graphs[0]] * 2, graphs
