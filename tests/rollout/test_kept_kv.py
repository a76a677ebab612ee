"""Kept KV across an agent's turns (NativeEngine.add_request(..., sessions=)): a finished sample parks its slot,
the next turn (its tokens plus new ones) prefills only the new tokens; the same tokens and log-probs as
re-prefilling the whole context, parked slots evicted (and re-prefilled) when a waiting sequence needs room."""

import random

import torch

from rollout import NativeEngine, SamplingParams
from tests.rollout.test_engine import PROMPTS, config, naive_greedy, trainer_logprobs
from tests.rollout.test_engine_steps import model

OBS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def run_turns(engine, prompts, *, keep: bool, turns=3, completions: list | None = None):
    """Every prompt runs `turns` turns (observation tokens between them), all in flight together, with turn
    lengths that differ (others decode while a session is parked: padding rows overwrite its slot's position 0,
    which the engine restores); returns per prompt its context and per-turn log-probs (and appends every turn's
    completion to `completions`)."""
    ctx = {i: list(p) for i, p in enumerate(prompts)}
    lps = {i: [] for i in ctx}
    turn = dict.fromkeys(ctx, 0)
    reqs = {}

    def add(i):
        p = SamplingParams(temperature=1.0, max_tokens=2 + 3 * ((i + turn[i]) % 3), seed=100 * i + turn[i],
                           ignore_eos=True)
        reqs[engine.add_request(ctx[i], p, sessions=[("t", i)] if keep else None)] = i

    for i in ctx:
        add(i)
    tools: dict[int, int] = {}  # prompt -> engine steps its "tool" still runs (the session stays parked)
    while engine.has_unfinished() or tools:
        for i in [i for i, left in tools.items() if left == 0]:
            del tools[i]
            add(i)
        tools = {i: left - 1 for i, left in tools.items()}
        for c in engine.step():
            i = reqs.pop(c.prompt_index)
            if completions is not None:
                completions.append(c)
            ctx[i] += c.token_ids
            lps[i].append(c.logprobs)
            turn[i] += 1
            if turn[i] < turns:
                ctx[i] += OBS[(i + turn[i]) % len(OBS)]
                tools[i] = 1 + i % 3
            elif keep:
                engine.release_session(("t", i))
    return ctx, lps


def test_kept_kv_matches_re_prefill_and_prefills_only_new_tokens():
    prompts = PROMPTS[:4]
    ref_engine = NativeEngine.from_model(model(), config=config(max_num_seqs=8, min_admit_fraction=0.0))
    ref_ctx, ref_lps = run_turns(ref_engine, prompts, keep=False)
    engine = NativeEngine.from_model(model(), config=config(max_num_seqs=8, min_admit_fraction=0.0))
    ctx, lps = run_turns(engine, prompts, keep=True)
    assert ctx == ref_ctx
    for i in ctx:
        assert [len(t) for t in lps[i]] == [len(t) for t in ref_lps[i]]
        torch.testing.assert_close(torch.tensor(sum(lps[i], [])), torch.tensor(sum(ref_lps[i], [])), atol=1e-5, rtol=0)
    # the trainer's log-probs of every sampled token, across turns, given the whole context
    for i, p in enumerate(prompts):
        full = ctx[i][len(p):]
        sampled = trainer_logprobs(model(), p, full, 1.0)
        at, got = 0, []
        for t, turn_lps in enumerate(lps[i]):
            got.append(sampled[at: at + len(turn_lps)])
            at += len(turn_lps) + (len(OBS[(i + t + 1) % len(OBS)]) if t < 2 else 0)
        torch.testing.assert_close(torch.cat(got), torch.tensor(sum(lps[i], [])), atol=1e-5, rtol=0)
    # re-prefill runs every context again; kept KV only the first prompt, each sampled token once and the
    # observations: per later turn, the previous turn's last token (never run) and the observation
    later = sum(len(OBS[(i + t) % len(OBS)]) + 1 for i in range(len(prompts)) for t in (1, 2))
    assert engine.stats["prefill_tokens"] == sum(map(len, prompts)) + later
    assert ref_engine.stats["prefill_tokens"] > engine.stats["prefill_tokens"]
    assert engine.stats["kv_reused_tokens"] == ref_engine.stats["prefill_tokens"] - engine.stats["prefill_tokens"]
    assert engine.stats["kv_evictions"] == engine.stats["kv_misses"] == 0
    assert not engine.has_unfinished() and engine._sched is None  # every session released: the engine is idle


def test_parked_slots_are_evicted_for_waiting_requests_and_re_prefilled():
    # 2 slots: a parked session must give its slot to a waiting request; its next turn then re-prefills
    engine = NativeEngine.from_model(model(), config=config(max_num_seqs=2, min_admit_fraction=0.0))
    p = lambda seed: SamplingParams(temperature=1.0, max_tokens=4, seed=seed, ignore_eos=True)  # noqa: E731
    first = engine.add_request(PROMPTS[0], p(1), sessions=["a"])
    other = engine.add_request(PROMPTS[1], p(2), sessions=["b"])
    done = {}
    while engine.has_unfinished():
        done.update({c.prompt_index: c for c in engine.step()})
    assert engine.stats["kv_evictions"] == 0 and len(engine._sched.parked) == 2  # both parked, no free slot
    blocker = engine.add_request(PROMPTS[2], p(3))  # needs a slot: "a" (parked first) is evicted
    while engine.has_unfinished():
        done.update({c.prompt_index: c for c in engine.step()})
    assert engine.stats["kv_evictions"] == 1 and len(done[blocker].token_ids) == 4
    ctx_a = PROMPTS[0] + done[first].token_ids + [5, 6]
    ctx_b = PROMPTS[1] + done[other].token_ids + [5, 6]
    before = engine.stats["prefill_tokens"]
    ra = engine.add_request(ctx_a, p(4), sessions=["a"])  # evicted: re-prefills its whole context
    rb = engine.add_request(ctx_b, p(5), sessions=["b"])  # still parked: only the 3 new tokens
    while engine.has_unfinished():
        done.update({c.prompt_index: c for c in engine.step()})
    assert engine.stats["kv_misses"] == 1
    assert engine.stats["prefill_tokens"] - before == len(ctx_a) + 3
    for rid, ctx in ((ra, ctx_a), (rb, ctx_b)):
        torch.testing.assert_close(torch.tensor(done[rid].logprobs), trainer_logprobs(
            model(), ctx, done[rid].token_ids, 1.0), atol=1e-5, rtol=0)
    # a prompt that does not extend the session's tokens re-prefills (and frees the stale slot)
    engine.add_request(PROMPTS[3], p(6), sessions=["b"])
    while engine.has_unfinished():
        engine.step()
    assert engine.stats["kv_misses"] == 2
    for key in ("a", "b"):
        engine.release_session(key)
    assert engine._sched is None


def test_an_fp8_cache_keeps_quantized_kv_across_turns():
    # the continuation writes its new K/V quantized (e4m3 + row scales) and attends to the quantized earlier turns,
    # where a re-prefill attends to the whole context in full precision: close, not equal
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    second = {}
    for keep in (True, False):
        engine = NativeEngine.from_model(model(), config=config(kv_cache_dtype="fp8", decode_attention="bmm"))
        engine.add_request(PROMPTS[2], greedy, sessions=["s"] if keep else None)
        (first,) = [c for _ in range(10) for c in engine.step()]
        engine.add_request(PROMPTS[2] + first.token_ids + [5, 6], greedy, sessions=["s"] if keep else None)
        (second[keep],) = [c for _ in range(10) for c in engine.step()]
        assert engine.stats["kv_reused_tokens"] == (len(PROMPTS[2]) + 3 if keep else 0)
    assert second[True].token_ids[:2] == second[False].token_ids[:2]
    assert 0 < abs(second[True].logprobs[0] - second[False].logprobs[0]) < 0.1


def staggered_turns(engine, n: int, *, turns=3, lengths=(3, 16)):
    """n trajectories of `turns` turns of random lengths in `lengths` (so turns end at scattered steps), each next
    turn added right after the last (a tool of no delay); per trajectory its context and log-probs."""
    rng = random.Random(0)
    ctx = {i: list(PROMPTS[i % len(PROMPTS)]) + [20 + i] for i in range(n)}
    lps, turn, reqs = {i: [] for i in ctx}, dict.fromkeys(ctx, 0), {}
    size = {(i, t): rng.randint(*lengths) for i in ctx for t in range(turns)}

    def add(i):
        p = SamplingParams(temperature=1.0, max_tokens=size[i, turn[i]], seed=100 * i + turn[i], ignore_eos=True)
        reqs[engine.add_request(ctx[i], p, sessions=[("t", i)])] = i

    for i in ctx:
        add(i)
    while engine.has_unfinished():
        for c in engine.step():
            i = reqs.pop(c.prompt_index)
            ctx[i] += c.token_ids
            lps[i] += c.logprobs
            turn[i] += 1
            if turn[i] < turns:
                ctx[i] += OBS[i % len(OBS)]
                add(i)
            else:
                engine.release_session(("t", i))
    return ctx, lps


def test_returning_turns_share_prefills_with_the_same_tokens():
    # 16 trajectories x 2 later turns returning at scattered steps: admitted one by one (continuation_wait_steps=0,
    # the engine before waves) most returns are a prefill step of their own, which stalls every other row's decode;
    # in waves (4 waiting, or the oldest waited 4 steps) half the prefills, no more engine steps in all, and the same
    # tokens and log-probs. Each prefill leaves the device idle once (run behind the decode step in flight), and
    # nothing else does but the tail's compaction
    one_by_one = NativeEngine.from_model(model(), config=config(min_admit_fraction=0.25, continuation_wait_steps=0))
    ref_ctx, ref_lps = staggered_turns(one_by_one, 16)
    waves = NativeEngine.from_model(model(), config=config(min_admit_fraction=0.25, continuation_wait_steps=4))
    ctx, lps = staggered_turns(waves, 16)
    assert ctx == ref_ctx
    for i in ctx:
        torch.testing.assert_close(torch.tensor(lps[i]), torch.tensor(ref_lps[i]), atol=1e-5, rtol=0)
    steps = lambda e: e.stats["prefill_steps"] + e.stats["decode_steps"]  # noqa: E731
    assert waves.stats["prefill_steps"] <= one_by_one.stats["prefill_steps"] // 2, (waves.stats, one_by_one.stats)
    assert steps(waves) <= steps(one_by_one), (waves.stats, one_by_one.stats)
    assert waves.stats["prefill_tokens"] == one_by_one.stats["prefill_tokens"] and waves.stats["kv_misses"] == 0
    assert waves.stats["device_drains"] <= waves.stats["prefill_steps"] + 2, waves.stats


def test_prefill_attention_avoids_per_shape_cudnn_plans(monkeypatch):
    # every prefill step has new (rows, query length, KV length): a backend that builds a plan per shape (cuDNN SDPA,
    # PyTorch's first choice on an H200) paid ~70 ms per continuation wave. Every SDPA call of the prefills (fresh
    # and kept-KV) must run with cuDNN off, and a continuation's masked call must be one the memory-efficient kernel
    # takes: no GQA flag (grouped query heads folded into query rows), an additive mask in the query dtype built once
    # per forward (not per layer), its rows 16-aligned. The global SDPA choice is restored afterwards
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((torch.backends.cuda.cudnn_sdp_enabled(), q.shape[1] != k.shape[1] or kw.get("enable_gqa"),
                      attn_mask))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    engine = NativeEngine.from_model(model(), config=config(max_num_seqs=8, min_admit_fraction=0.0,
                                                            decode_attention="bmm"))  # decode: no SDPA call
    ctx, _ = run_turns(engine, PROMPTS[:4], keep=True)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    masked = [(gqa, m) for _, gqa, m in calls if m is not None]
    assert calls and not any(cudnn for cudnn, _, _ in calls)
    layers = engine.model_config.num_hidden_layers
    assert masked and not any(gqa for gqa, _ in masked)
    assert len({id(m) for _, m in masked}) * layers == len(masked)  # one mask per continuation forward
    for _, m in masked:
        assert m.dtype == torch.float32 and all(s % 16 == 0 for s in m.stride()[:-1])
    assert len(calls) - len(masked) == layers  # the first turn: one fresh prefill (causal, no mask)


def test_compiled_continuations_equal_eager_and_compile_once():
    # rollout.compile: the continuation prefill is one dynamic-shape graph (rows, new tokens, KV length) whose K/V
    # write mutates the cache in place; the same tokens and log-probs as the eager engine. One returning row of one
    # new token (a turn with no observation: sizes of 1, which Dynamo specialises) then reaches the same graph
    from torch._dynamo.utils import counters

    cfg = dict(max_num_seqs=8, min_admit_fraction=0.0)
    ref_ctx, ref_lps = run_turns(NativeEngine.from_model(model(), config=config(**cfg)), PROMPTS[:4], keep=True)
    engine = NativeEngine.from_model(model(), config=config(**cfg, compile=True))
    runner = engine.runner  # decode and fresh prefill eager here (their compiled graphs: test_engine.py)
    runner._decode, runner._prefill = runner._decode_fn, runner._prefill_fn
    ctx, lps = run_turns(engine, PROMPTS[:4], keep=True)
    assert ctx == ref_ctx
    for i in ctx:
        torch.testing.assert_close(torch.tensor(sum(lps[i], [])), torch.tensor(sum(ref_lps[i], [])), atol=1e-5, rtol=0)
    graphs = counters["stats"]["unique_graphs"]
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request(PROMPTS[4], greedy, sessions=["s"])
    (first,) = [c for _ in range(6) for c in engine.step()]
    reused = engine.stats["kv_reused_tokens"]
    engine.add_request(PROMPTS[4] + first.token_ids, greedy, sessions=["s"])
    (second,) = [c for _ in range(6) for c in engine.step()]
    assert engine.stats["kv_reused_tokens"] - reused == len(PROMPTS[4]) + 2  # only the last sampled token ran
    assert second.token_ids == naive_greedy(model(), PROMPTS[4] + first.token_ids, 3)
    assert counters["stats"]["unique_graphs"] == graphs, "a continuation shape recompiled"
    assert runner._continue.error is None


def bucketed_waves(runner, trunk) -> list:
    """Continuation waves run through ContinuationGraphs' bucketed static buffers over `trunk` (CPU has no CUDA
    graphs: the replay runs the trunk the graph would capture); returns the list the replayed buckets go to. Every
    wave fits a bucket here: none runs un-graphed."""
    from rollout import continuation_graphs

    graphs = continuation_graphs.ContinuationGraphs(trunk, device=runner.device, stream=None,
                                                    spare_slot=runner.num_slots, slot_len=runner.slot_len,
                                                    pool=lambda: None)
    replayed = []

    def replay(key):
        replayed.append(key)
        graphs.static[key] = (*graphs.static[key][:3], graphs._forward(key))

    graphs.replay, runner.continuations, runner._continue = replay, graphs, None
    return replayed


def test_continuation_graph_buckets_pad_without_changing_results(monkeypatch):
    # rollout/continuation_graphs.py: a returning wave runs in its bucket's static buffers (rows up to a power of two,
    # padding rows on the cache's spare slot; new tokens up to a multiple of 16; KV positions rounded up, masked;
    # 32 here so buckets stay below the 96-position slot). CPU has no CUDA graphs, so the replay here runs the
    # captured forward over those buffers (test_engine_gpu.py captures): the same tokens and log-probs as
    # un-bucketed continuations
    from rollout import continuation_graphs

    monkeypatch.setattr(continuation_graphs, "KV", 32)
    cfg = dict(min_admit_fraction=0.25, continuation_wait_steps=4)
    ref_ctx, ref_lps = staggered_turns(NativeEngine.from_model(model(), config=config(**cfg)), 16)
    engine = NativeEngine.from_model(model(), config=config(**cfg))
    replayed = bucketed_waves(engine.runner, engine.runner._continue_hidden)
    ctx, lps = staggered_turns(engine, 16)
    assert ctx == ref_ctx
    for i in ctx:
        torch.testing.assert_close(torch.tensor(lps[i]), torch.tensor(ref_lps[i]), atol=1e-5, rtol=0)
    assert all(rows >= 2 and rows & (rows - 1) == 0 and tokens == 16 and kv % 32 == 0 for rows, tokens, kv in replayed)
    assert len({rows for rows, _, _ in replayed}) > 1 and len({kv for _, _, kv in replayed}) > 1, replayed


def test_compiled_continuation_trunk_fills_every_bucket_from_one_graph(monkeypatch):
    # rollout.compile: a continuation graph captures the compiled trunk (model_runner's _continue_trunk), one
    # dynamic-shape graph for every bucket (rows, new tokens, KV positions); the same tokens and log-probs as eager
    from torch._dynamo.utils import counters

    from rollout import continuation_graphs

    monkeypatch.setattr(continuation_graphs, "KV", 32)
    cfg = dict(min_admit_fraction=0.25, continuation_wait_steps=4)
    ref_ctx, ref_lps = staggered_turns(NativeEngine.from_model(model(), config=config(**cfg)), 16)
    engine = NativeEngine.from_model(model(), config=config(**cfg, compile=True))
    runner = engine.runner
    runner._decode, runner._prefill = runner._decode_fn, runner._prefill_fn  # only the trunk compiled here
    assert runner._continue_trunk.eager == runner._continue_hidden
    replayed = bucketed_waves(runner, runner._continue_trunk)
    before = counters["stats"]["unique_graphs"]
    ctx, lps = staggered_turns(engine, 16)
    assert ctx == ref_ctx
    for i in ctx:
        torch.testing.assert_close(torch.tensor(lps[i]), torch.tensor(ref_lps[i]), atol=1e-5, rtol=0)
    assert len(set(replayed)) > 2, replayed
    assert counters["stats"]["unique_graphs"] - before == 1, "a continuation bucket recompiled the trunk"
    assert runner._continue_trunk.error is None


def test_park_slots_keep_the_kv_of_more_trajectories_than_decode_slots():
    # 5 trajectories through 2 decode slots. Without park slots a waiting trajectory takes a parked one's slot, whose
    # next turn then re-prefills its whole context; with 3 park slots (one per trajectory beyond the decode slots) the
    # parked KV is copied there and back (swapped through the cache's spare slot when the returning turn's own park
    # slot is the free one): nothing evicted, only new tokens prefilled, the same tokens and log-probs
    two = dict(max_num_seqs=2, min_admit_fraction=0.0)
    ref_ctx, ref_lps = run_turns(NativeEngine.from_model(model(), config=config(**two)), PROMPTS, keep=False)
    evicting = NativeEngine.from_model(model(), config=config(**two))
    assert run_turns(evicting, PROMPTS, keep=True)[0] == ref_ctx and evicting.stats["kv_evictions"] > 0
    engine = NativeEngine.from_model(model(), config=config(**two, max_parked_seqs=3))
    runner = engine.runner
    assert (runner.num_slots, runner.park_slots, runner.cache.num_slots) == (2, 3, 5)
    moves, move_slots = [], runner.move_slots
    runner.move_slots = lambda m, lengths: (moves.extend(m), move_slots(m, lengths=lengths))
    ctx, lps = run_turns(engine, PROMPTS, keep=True)
    assert ctx == ref_ctx
    for i in ctx:
        torch.testing.assert_close(torch.tensor(sum(lps[i], [])), torch.tensor(sum(ref_lps[i], [])), atol=1e-5, rtol=0)
    assert engine.stats["kv_evictions"] == engine.stats["kv_misses"] == 0
    assert engine.stats["kv_relocations"] == len(moves) and any(dst == 5 for _, dst in moves), moves
    later = sum(len(OBS[(i + t) % len(OBS)]) + 1 for i in range(len(PROMPTS)) for t in (1, 2))
    assert engine.stats["prefill_tokens"] == sum(map(len, PROMPTS)) + later
    assert not engine.has_unfinished() and engine._sched is None


def test_fresh_rows_in_waves_run_in_the_continuation_forward_with_the_same_results():
    """RolloutConfig.fresh_rows_in_waves: single-sequence fresh rows (first turns here) run in the continuation
    forward from position 0; the turns sample the same tokens, every log-prob equals the trainer's, the prefill runs
    the same tokens, and no prompt forward runs; a row shared by n samples keeps its own prefill."""
    prompts = PROMPTS[:4]
    kw = dict(max_num_seqs=8, min_admit_fraction=0.0)
    base = NativeEngine.from_model(model(), config=config(**kw))
    ref_ctx, ref_lps = run_turns(base, prompts, keep=True)
    engine = NativeEngine.from_model(model(), config=config(**kw, fresh_rows_in_waves=True))
    ctx, lps = run_turns(engine, prompts, keep=True)
    assert ctx == ref_ctx
    for i in ctx:
        torch.testing.assert_close(torch.tensor(sum(lps[i], [])), torch.tensor(sum(ref_lps[i], [])), atol=1e-5, rtol=0)
    assert engine.stats["prefill_tokens"] == base.stats["prefill_tokens"]
    assert engine.stats["prefill_fresh_rows"] == 0 and base.stats["prefill_fresh_rows"] == len(prompts)
    assert engine.stats["prefill_continue_rows"] == base.stats["prefill_continue_rows"] + len(prompts)
    # a prompt with n = 2 samples: one row, two slots; its prefill stays a prompt forward
    engine.stats["prefill_fresh_rows"] = 0
    out = engine.generate([PROMPTS[2]], SamplingParams(temperature=1.0, max_tokens=3, n=2, seed=5))
    assert engine.stats["prefill_fresh_rows"] == 1
    for c in out:
        torch.testing.assert_close(torch.tensor(c.logprobs), trainer_logprobs(model(), PROMPTS[2], c.token_ids, 1.0),
                                   atol=1e-5, rtol=0)
