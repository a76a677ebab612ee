"""The Triton decode-attention kernel, run by Triton's CPU interpreter (TRITON_INTERPRET=1) in a child
process (the variable must be set before triton is imported, and must not leak into other tests): one per module
for all its snippets (tests/triton_interp.py)."""

import pytest

from tests.triton_interp import run_interpreted

pytest.importorskip("triton")


@pytest.mark.parametrize("block_n", [16, 64])
def test_kernel_equals_sdpa_over_the_live_positions_and_writes_the_new_kv(block_n):
    run_interpreted(f"""
        import torch, torch.nn.functional as F
        from rollout.triton_attention import attend
        torch.manual_seed(0)
        layers, slots, hkv, slot_len, d = 3, 6, 2, 150, 16
        config = dict(BLOCK_N={block_n}, num_warps=4, num_stages=2)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            for g in (1, 2, 3):  # MHA, GQA, a group that is not a power of two
                cache = torch.randn(layers, 2, slots, hkv, slot_len, d).to(dtype)
                b = 5
                q = torch.randn(b, hkv * g, 1, d).to(dtype)
                k, v = (torch.randn(b, hkv, 1, d).to(dtype) for _ in range(2))
                pos = torch.tensor([0, 1, 63, 64, 149])  # empty history, tile edges, the last position
                want = cache.clone()
                for r in range(b):
                    want[1, 0, r, :, pos[r]], want[1, 1, r, :, pos[r]] = k[r, :, 0], v[r, :, 0]
                out = attend(cache, 1, pos, q, k, v, config=config)
                assert torch.equal(cache, want), "only (layer 1, row r, position pos[r]) may change"
                for r in range(b):
                    kk, vv = (want[1, i, r, :, : pos[r] + 1].float()[None] for i in (0, 1))
                    ref = F.scaled_dot_product_attention(q[r: r + 1].float(), kk, vv, enable_gqa=g > 1)
                    err = (out[r: r + 1].float() - ref).abs().max().item()
                    assert err < tol, (dtype, g, r, err)
        print("ok")
    """)


@pytest.mark.parametrize("compiled,fused", [(False, True), (True, True), (False, False)],
                         ids=["eager", "compiled", "unfused-projections"])
def test_engine_with_triton_decode_matches_naive_greedy_and_trainer_logprobs(compiled, fused):
    # the engine passes q/k un-rotated and the kernel applies RoPE; compiled: through Dynamo/Inductor too
    out = run_interpreted(f"""
        import torch
        from rollout import NativeEngine, SamplingParams
        from tests.rollout.test_engine import PROMPTS, config, naive_greedy, peaked_model, trainer_logprobs
        model = peaked_model(layers=2)  # layer 1 reads at a non-zero cache offset
        engine = NativeEngine.from_model(model, config=config(decode_attention="triton", compile={compiled},
                                                               fuse_projections={fused}))
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = engine.generate(PROMPTS[:3], greedy)
        assert [c.token_ids for c in outs] == [naive_greedy(model, q, 8) for q in PROMPTS[:3]]
        sampled = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=3, ignore_eos=True)
        for c in engine.generate(PROMPTS[:2], sampled):
            ref = trainer_logprobs(model, c.prompt_ids, c.token_ids, 1.0)
            assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= 1e-5
        assert getattr(engine.runner._decode, "error", None) is None
        print("ok")
    """)
    assert "ok" in out


def test_compiled_shared_prompt_decode_compiles_once_across_widths_and_lone_groups():
    # the shared-prompt tables reach the compiled decode as arguments: a new members width (groups of 5, 3 or 9
    # rows: tiles of 8, 4, 16) or a step whose rows share one prompt (one table entry used) must not recompile;
    # it did, once per width, in measured recipe steps on an H100 (its rows' groups shrink as rows end). The
    # unshared graph (no groups) is the one other graph. Tokens equal an engine that shares nothing.
    out = run_interpreted("""
        import torch
        from torch._dynamo.utils import counters
        from rollout import NativeEngine, SamplingParams
        from tests.rollout.test_engine import PROMPTS, config, peaked_model
        model = peaked_model(layers=2)
        shared = NativeEngine.from_model(model, config=config(decode_attention="triton", compile=True))
        plain = NativeEngine.from_model(model, config=config(decode_attention="triton", share_prompt_kv=False))
        graphs = []
        for k, n in ((3, 5), (3, 1), (1, 2), (2, 3), (2, 9), (5, 4)):
            p = SamplingParams(temperature=1.0, max_tokens=4, n=n, seed=n, ignore_eos=True)
            got = shared.generate(PROMPTS[:k], p)
            assert [c.token_ids for c in got] == [c.token_ids for c in plain.generate(PROMPTS[:k], p)], (k, n)
            graphs.append(counters["stats"]["unique_graphs"])
        assert graphs[2:] == [graphs[1]] * 4, graphs  # prefill + shared decode, then the unshared decode only
        assert shared.runner._decode.error is None
        print("ok", graphs)
    """)
    assert "ok" in out


def test_prefill_write_kernel_equals_the_indexed_copy():
    run_interpreted("""
        import torch
        from rollout.triton_attention import write_prefill
        torch.manual_seed(0)
        cache = torch.randn(2, 2, 7, 3, 80, 16)
        want = cache.clone()
        qkv = torch.randn(4, 3 * 3, 70, 16)  # k and v as strided views of one tensor, like the fused QKV
        k, v = qkv[:, 3:6], qkv[:, 6:]
        slots, rows = torch.tensor([5, 0, 2, 6]), torch.tensor([1, 1, 3, 0])  # n samples share a row
        want[1, 0, slots, :, :70], want[1, 1, slots, :, :70] = k[rows], v[rows]
        write_prefill(cache, 1, slots, rows, k, v)
        assert torch.equal(cache, want)
        print("ok")
    """)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, dict(BLOCK_N=32, num_warps=4, num_stages=3),
                                    dict(BLOCK_N=128, num_warps=8, num_stages=2)], ids=["default", "n32", "n128"])
def test_compiled_kernels_on_cuda_equal_sdpa(config):
    import torch
    import torch.nn.functional as F

    from rollout.triton_attention import attend, write_prefill

    torch.manual_seed(0)
    b, hkv, g, d, slot_len = 37, 8, 2, 128, 300
    cache = torch.randn(2, 2, b + 1, hkv, slot_len + 1, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(b, hkv * g, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    pos = torch.randint(0, slot_len, (b,), device="cuda")
    out = attend(cache, 1, pos, q, k, v, slot_len, config=config).float()
    for r in range(b):
        assert torch.equal(cache[1, 0, r, :, pos[r]], k[r, :, 0]) and torch.equal(cache[1, 1, r, :, pos[r]], v[r, :, 0])
        kk, vv = (cache[1, i, r, :, : pos[r] + 1].float()[None] for i in (0, 1))
        ref = F.scaled_dot_product_attention(q[r: r + 1].float(), kk, vv, enable_gqa=True)
        assert (out[r: r + 1] - ref).abs().max().item() < 2e-2
    # RoPE inside the kernel at long-context positions equals the model's rotation outside it
    from models.llama import apply_rotary, rotary_cos_sin

    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    big = torch.randint(0, 32768, (b,), device="cuda")
    cos, sin = rotary_cos_sin(inv_freq, big[:, None], torch.bfloat16)
    ref_cache, cache2 = cache.clone(), cache.clone()
    small = torch.randint(0, slot_len, (b,), device="cuda")  # attend a short history, rotate as at `big`
    want = attend(ref_cache, 0, small, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, slot_len,
                  config=config).float()
    got = attend(cache2, 0, small, q, k, v, slot_len, cos[:, 0, 0], sin[:, 0, 0], config=config).float()
    assert (got - want).abs().max().item() < 2e-2
    # the rotated k: fp32 math rounded once vs three bf16 roundings outside, so within one bf16 ulp
    assert torch.allclose(cache2.float(), ref_cache.float(), rtol=1e-2, atol=1e-2)
    kp, vp = (torch.randn(5, hkv, 130, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots, rows = torch.tensor([3, 9, 0], device="cuda"), torch.tensor([4, 4, 1], device="cuda")
    want = cache.clone()
    want[0, 0, slots, :, :130], want[0, 1, slots, :, :130] = kp[rows], vp[rows]
    write_prefill(cache, 0, slots, rows, kp, vp)
    assert torch.equal(cache, want)


def test_kernel_applies_rope_to_q_and_the_new_k_like_the_model():
    run_interpreted("""
        import torch, torch.nn.functional as F
        from models.llama import apply_rotary, rotary_cos_sin
        from rollout.triton_attention import attend
        torch.manual_seed(0)
        layers, slots, hkv, g, slot_len, d = 2, 5, 2, 2, 90, 16
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            cache = torch.randn(layers, 2, slots, hkv, slot_len, d).to(dtype)
            b = 4
            q = torch.randn(b, hkv * g, 1, d).to(dtype)
            k, v = (torch.randn(b, hkv, 1, d).to(dtype) for _ in range(2))
            pos = torch.tensor([0, 7, 64, 89])
            cos, sin = rotary_cos_sin(inv_freq, pos[:, None], dtype)  # [B, 1, 1, D]
            qr, kr = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            want = cache.clone()
            out_ref = attend(want, 1, pos, qr, kr, v, slot_len)  # rotated outside: the reference
            out = attend(cache, 1, pos, q, k, v, slot_len, cos[:, 0, 0], sin[:, 0, 0])
            assert torch.allclose(cache.float(), want.float(), rtol=tol, atol=tol), "the cache holds the rotated k"
            assert (out.float() - out_ref.float()).abs().max().item() <= tol, dtype
        print("ok")
    """)


@pytest.mark.parametrize("block_n", [16, 64])
def test_shared_prompt_groups_read_once_equal_every_row_reading_its_own_slot(block_n):
    # a group's rows hold identical prompt K/V (one prefill row); each table entry's prompt program reads it from
    # the first member's slot only. Poison the other members' prompt copies: the result must not change.
    run_interpreted(f"""
        import torch, torch.nn.functional as F
        from models.llama import rotary_cos_sin
        from rollout.shared_prefix import shared_prefix_tables
        from rollout.triton_attention import attend
        torch.manual_seed(0)
        layers, hkv, slot_len, d, b = 2, 2, 120, 16, 9
        config = dict(BLOCK_N={block_n}, num_warps=4, num_stages=2)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        # rows 0-3 and 8 share a 37-token prompt (split into two table entries of at most 4 rows: [0, 1] and
        # [2, 3, 8]), 5 and 7 a 64-token one, 4 shares nothing, 6 is alone in its group
        groups = [(37, [0, 1, 2, 3, 8]), (64, [5, 7]), (20, [6])]
        pos = torch.tensor([37, 50, 90, 41, 3, 64, 30, 100, 119])
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            for g in (1, 2, 3):
                cache = torch.randn(layers, 2, b + 1, hkv, slot_len + 1, d).to(dtype)
                for plen, rows in groups:
                    for r in rows[1:]:
                        cache[:, :, r, :, :plen] = cache[:, :, rows[0], :, :plen]
                q = torch.randn(b, hkv * g, 1, d).to(dtype)
                k, v = (torch.randn(b, hkv, 1, d).to(dtype) for _ in range(2))
                cos, sin = rotary_cos_sin(inv_freq, pos[:, None], dtype)
                cos, sin = cos[:, 0, 0], sin[:, 0, 0]
                want_cache = cache.clone()
                want = attend(want_cache, 1, pos, q, k, v, slot_len, cos, sin, config=config)
                tables = shared_prefix_tables(groups, rows=b, members_per_entry=4)
                read = set(tables[2][:, 0].tolist())  # the one slot each table entry reads
                poisoned = cache.clone()
                for plen, rows in groups[:2]:
                    poisoned[1, :, [r for r in rows if r not in read], :, :plen] = float("nan")
                counts = torch.zeros(tables[2].shape[0], hkv, dtype=torch.int32)
                got = attend(poisoned, 1, pos, q, k, v, slot_len, cos, sin, prefix=tables, counts=counts,
                             config=config)
                err = (got.float() - want.float()).abs().max().item()
                assert err < tol, (dtype, g, err)
                # the last program of each entry re-arms its counter: the next launch merges again
                assert not counts.any()
                again = attend(poisoned, 1, pos, q, k, v, slot_len, cos, sin, prefix=tables, counts=counts,
                               config=config)
                assert torch.equal(again, got)
                # the new tokens' K/V are written as without sharing
                idx = torch.arange(b)
                assert torch.equal(poisoned[1, :, idx, :, pos], want_cache[1, :, idx, :, pos])
                # and both equal SDPA over each row's own history
                for r in range(b):
                    kk, vv = (want_cache[1, i, r, :, : pos[r] + 1].float()[None] for i in (0, 1))
                    from models.llama import apply_rotary
                    qr = apply_rotary(q[r: r + 1].float(), cos[r].float(), sin[r].float())
                    ref = F.scaled_dot_product_attention(qr, kk, vv, enable_gqa=g > 1)
                    assert (want[r: r + 1].float() - ref).abs().max().item() < tol * 5, (dtype, g, r)
        print("ok")
    """)


def test_engine_sharing_prompt_kv_equals_every_row_reading_its_own_and_the_trainer():
    # 3 prompts x 4 samples in 8 slots: prompt 0 (2 tokens) frees its slots for prompt 2, then prompt 1's
    # group is compacted from slots 4-7 to 0-3 while decoding: the shared groups change and move
    out = run_interpreted("""
        import torch
        from rollout import NativeEngine, SamplingParams
        from tests.rollout.test_engine import PROMPTS, config, peaked_model, trainer_logprobs
        model = peaked_model(layers=2)  # layer 1 reads at a non-zero cache offset
        params = [SamplingParams(temperature=1.0, max_tokens=t, n=4, seed=5 + t, ignore_eos=True) for t in (2, 9, 5)]
        runs, shared = {}, []
        for share in (True, False):
            engine = NativeEngine.from_model(model, config=config(decode_attention="triton", share_prompt_kv=share,
                                                                   max_num_seqs=8, kv_cache_tokens=96 * 8))
            record = engine.runner.set_shared_prompts
            engine.runner.set_shared_prompts = lambda g, record=record: (shared.append(g) if share and g else None,
                                                                         record(g))
            runs[share] = engine.generate(PROMPTS[:3], params)
            assert engine.stats["slot_moves"] == 4, engine.stats
        slots = [sorted(s) for g in shared for _, s in g]
        assert [0, 1, 2, 3] in slots and [4, 5, 6, 7] in slots, slots
        assert [c.token_ids for c in runs[True]] == [c.token_ids for c in runs[False]]
        for a, b in zip(runs[True], runs[False]):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
            ref = trainer_logprobs(model, a.prompt_ids, a.token_ids, 1.0)
            assert (ref - torch.tensor(a.logprobs)).abs().max().item() <= 1e-5
        print("ok")
    """)
    assert "ok" in out


def test_steps_that_may_not_capture_replay_a_graph_of_more_rows_at_a_wider_prompt_table():
    # beside training nothing is captured: a decode step replays the graph of more rows at its member-table width
    # or a wider one (stand-ins here: 8 rows, unshared or the widest table); the wider table is written for the
    # current groups first, and every token and log-prob equals the eager engine's as groups shrink and move
    out = run_interpreted("""
        import itertools
        import torch
        from rollout import NativeEngine, SamplingParams
        from rollout.scheduler import length_bucket
        from tests.rollout.test_engine import PROMPTS, GraphStandIn, config, peaked_model
        model = peaked_model(layers=2)
        params = [SamplingParams(temperature=1.0, max_tokens=t, n=4, seed=5 + t, ignore_eos=True) for t in (2, 9, 5)]
        kw = dict(decode_attention="triton", max_num_seqs=8, kv_cache_tokens=96 * 8)
        eager = NativeEngine.from_model(model, config=config(**kw)).generate(PROMPTS[:3], params)
        engine = NativeEngine.from_model(model, config=config(**kw))
        runner = engine.runner
        runner.use_graphs, runner.may_capture = True, False
        widest = max(runner.prefix_tables)
        kv_lens = {runner._graph_kv_len(8, length_bucket(n, granule=16, cap=runner.slot_len))
                   for n in range(1, runner.slot_len + 1)}
        for kv, width in itertools.product(kv_lens, (0, widest)):
            runner.graphs[(8, kv, False, width)] = GraphStandIn(runner, (8, kv, False), width)
        out = engine.generate(PROMPTS[:3], params)
        seen = [(g.width, now) for g in runner.graphs.values() for now in g.seen]
        assert len(seen) == engine.stats["decode_steps"] and (widest, 4) in seen, seen  # groups of 4: width 4
        for a, b in zip(eager, out, strict=True):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
        print("ok")
    """)
    assert "ok" in out


@pytest.mark.gpu
def test_shared_prompt_kernels_on_cuda_equal_unshared_and_the_engine_agrees():
    import torch

    from rollout import NativeEngine, RolloutConfig, SamplingParams
    from rollout.shared_prefix import shared_prefix_tables
    from rollout.triton_attention import attend

    torch.manual_seed(0)
    b, hkv, g, d, slot_len, plen = 64, 8, 2, 64, 400, 128  # llama-1b heads, GRPO groups of 8
    cache = torch.randn(2, 2, b + 1, hkv, slot_len + 1, d, device="cuda", dtype=torch.bfloat16)
    groups = [(plen, list(range(i, i + 8))) for i in range(0, b, 8)]
    for _, rows in groups:
        cache[:, :, rows[1:], :, :plen] = cache[:, :, rows[:1], :, :plen]
    q = torch.randn(b, hkv * g, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    pos = torch.randint(plen, slot_len, (b,), device="cuda")
    tables = tuple(t.cuda() for t in shared_prefix_tables(groups, rows=b, members_per_entry=16))
    want = attend(cache.clone(), 1, pos, q, k, v, slot_len).float()
    got = attend(cache, 1, pos, q, k, v, slot_len, prefix=tables).float()
    assert (got - want).abs().max().item() < 2e-2
    # the engine (CUDA graphs, torch.compile) with and without sharing, fp32: same tokens, same log-probs
    from models import build_model, preset_config

    model = build_model(preset_config("tiny"), seed=0).cuda()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    prompts = [torch.randint(3, 200, (n,)).tolist() for n in (40, 17, 64, 9)]
    params = SamplingParams(temperature=1.0, max_tokens=24, n=8, seed=1, ignore_eos=True)
    outs = {}
    for share in (True, False):
        engine = NativeEngine.from_model(model, config=RolloutConfig(
            max_model_len=96, max_num_seqs=32, kv_cache_tokens=96 * 32, decode_attention="triton", compile=True,
            share_prompt_kv=share))
        outs[share] = engine.generate(prompts, params)
        assert engine.runner.graph_error is None and getattr(engine.runner._decode, "error", None) is None
    assert [c.token_ids for c in outs[True]] == [c.token_ids for c in outs[False]]
    for a in outs[True]:
        with torch.no_grad():
            logits = model(torch.tensor([a.prompt_ids + a.token_ids], device="cuda"))[0, len(a.prompt_ids) - 1: -1]
        ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(a.token_ids, device="cuda")[:, None])
        assert (ref[:, 0].cpu() - torch.tensor(a.logprobs)).abs().max().item() <= 1e-4


def test_fp8_cache_kernels_equal_the_torch_fallback_shared_and_unshared():
    # rollout.kv_cache_dtype=fp8: the prefill write and the decode store quantize each (token, head) row over its
    # own absolute maximum, the decode kernel dequantizes on load; the torch paths (write_prefill_kv/write_kv and
    # DecodeAttention's bmm) are the reference, and the shared-prompt launch equals the unshared one
    run_interpreted("""
        import torch
        from rollout.kv_cache import FP8, DecodeAttention, KVCache, write_prefill_kv
        from rollout.shared_prefix import shared_prefix_tables
        from rollout.triton_attention import attend, write_prefill
        torch.manual_seed(0)
        layers, hkv, slot_len, d, b, g = 2, 2, 100, 16, 6, 2
        kv = dict(num_layers=layers, num_slots=b, num_kv_heads=hkv, slot_len=slot_len, head_dim=d, device="cpu")
        cache, ref = KVCache(dtype=FP8, **kv), KVCache(dtype=FP8, **kv)
        assert cache.scales.shape == (layers, 2, b + 1, hkv, slot_len + 1)
        kp, vp = (3.0 * torch.randn(2, hkv, 40, d) for _ in range(2))  # two prompts of 40 tokens
        slots, rows = torch.tensor([0, 1, 2, 3, 4, 5]), torch.tensor([0, 0, 0, 1, 1, 1])
        write_prefill(cache.data, 1, slots, rows, kp, vp, cache.scales)
        write_prefill_kv(ref.data, ref.scales, 1, slots, rows, kp, vp)
        deq, want = ((c.data[1, :, :b, :, :40].float() * c.scales[1, :, :b, :, :40, None]) for c in (cache, ref))
        assert (deq - want).abs().max().item() <= 1e-6 * want.abs().max().item() + 1e-6
        original = torch.stack([kp[rows], vp[rows]]).transpose(0, 1).transpose(0, 1)  # [2, b, hkv, 40, d]
        assert ((deq - original).abs() <= original.abs().amax(-1, keepdim=True) / 16 + 1e-6).all()  # e4m3: 3 bits
        q = torch.randn(b, hkv * g, 1, d)
        k, v = (torch.randn(b, hkv, 1, d) for _ in range(2))
        pos = torch.tensor([40, 41, 70, 40, 55, 99])
        want_out = DecodeAttention(ref.data, positions=pos, kv_index=torch.arange(slot_len), mode="bmm",
                                   scales=ref.scales)(1, q, k, v)
        for shared in (False, True):
            c = KVCache(dtype=FP8, **kv)
            c.data.copy_(cache.data), c.scales.copy_(cache.scales)
            tables = shared_prefix_tables([(40, [0, 1, 2]), (40, [3, 4, 5])], rows=b, members_per_entry=4) \\
                if shared else None
            out = attend(c.data, 1, pos, q, k, v, slot_len, prefix=tables, scales=c.scales,
                         config=dict(BLOCK_N=16, num_warps=4, num_stages=2))
            assert (out - want_out).abs().max().item() < 1e-4, (shared, (out - want_out).abs().max().item())
            # the new tokens were stored quantized at their positions, like write_kv's
            idx = torch.arange(b)
            got_new = c.data[1, :, idx, :, pos].float() * c.scales[1, :, idx, :, pos][..., None]
            want_new = ref.data[1, :, idx, :, pos].float() * ref.scales[1, :, idx, :, pos][..., None]
            assert (got_new - want_new).abs().max().item() < 1e-6
        print("ok")
    """)


def test_engine_with_fp8_kv_cache_stays_close_to_the_full_precision_engine():
    # end to end: the triton decode (under the interpreter) and the torch fallback store and read the same fp8
    # cache (same tokens, log-probs within fp32 noise); against the full-precision engine the first tokens agree and
    # their log-probs differ by e4m3's rounding (later ones may branch: this model's distributions are peaked)
    out = run_interpreted("""
        import torch
        from rollout import NativeEngine, SamplingParams
        from tests.rollout.test_engine import PROMPTS, config, peaked_model
        model = peaked_model(layers=2)
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        runs = {}
        for name, kw in (("full", {}), ("fp8-triton", dict(kv_cache_dtype="fp8", decode_attention="triton")),
                         ("fp8-torch", dict(kv_cache_dtype="fp8", decode_attention="bmm"))):
            engine = NativeEngine.from_model(model, config=config(**kw))
            runs[name] = engine.generate(PROMPTS[:3], greedy)
        fp8, torch_fp8, full = runs["fp8-triton"], runs["fp8-torch"], runs["full"]
        assert [c.token_ids for c in fp8] == [c.token_ids for c in torch_fp8]
        assert max(abs(x - y) for a, b in zip(fp8, torch_fp8) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        assert [c.token_ids[:4] for c in fp8] == [c.token_ids[:4] for c in full]
        diff = max(abs(x - y) for a, b in zip(fp8, full) for x, y in zip(a.logprobs[:4], b.logprobs[:4]))
        assert 0 < diff < 0.1, diff  # quantized (not a silently full-precision cache), and close
        print("ok")
    """)
    assert "ok" in out


def test_fp8_cache_tiles_meet_bf16_queries_in_fp16_on_tensor_cores():
    # bf16 queries over an fp8 cache take the tensor-core branch (fp16 dots: e4m3 -> fp16 is one instruction per
    # two values on sm_89+, -> bf16 two more), which the interpreter runs too: the torch fallback's output within
    # one bf16 ulp, shared prompts and not
    run_interpreted("""
        import torch
        from rollout.kv_cache import FP8, DecodeAttention, KVCache
        from rollout.shared_prefix import shared_prefix_tables
        from rollout.triton_attention import attend, write_prefill
        torch.manual_seed(1)
        hkv, slot_len, d, b, g = 2, 100, 16, 6, 2
        kv = dict(num_layers=2, num_slots=b, num_kv_heads=hkv, slot_len=slot_len, head_dim=d, device="cpu")
        kp, vp = (3.0 * torch.randn(2, hkv, 40, d) for _ in range(2))
        slots, rows = torch.tensor([0, 1, 2, 3, 4, 5]), torch.tensor([0, 0, 0, 1, 1, 1])
        q = torch.randn(b, hkv * g, 1, d, dtype=torch.bfloat16)
        k, v = (torch.randn(b, hkv, 1, d, dtype=torch.bfloat16) for _ in range(2))
        pos = torch.tensor([40, 41, 70, 40, 55, 99])
        for shared in (False, True):
            cache, ref = KVCache(dtype=FP8, **kv), KVCache(dtype=FP8, **kv)
            for c in (cache, ref):
                write_prefill(c.data, 1, slots, rows, kp, vp, c.scales)
            want = DecodeAttention(ref.data, positions=pos, kv_index=torch.arange(slot_len), mode="bmm",
                                   scales=ref.scales)(1, q.float(), k.float(), v.float())
            tables = shared_prefix_tables([(40, [0, 1, 2]), (40, [3, 4, 5])], rows=b, members_per_entry=4) \\
                if shared else None
            out = attend(cache.data, 1, pos, q, k, v, slot_len, prefix=tables, scales=cache.scales,
                         config=dict(BLOCK_N=16, num_warps=4, num_stages=2))
            assert out.dtype == torch.bfloat16
            ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-3))) - 7)  # bf16's spacing at each value
            assert ((out.float() - want).abs() <= ulp + 1e-3).all(), (shared, (out.float() - want).abs().max())
        print("ok")
    """)


@pytest.mark.gpu
@pytest.mark.parametrize("b", [32, 256])  # 32-position tiles below 256 rows, 64 from there (tile_config)
def test_fp8_cache_kernels_on_cuda_equal_the_torch_fallback(b):
    """The compiled kernels (hardware fp8 casts, tiles converted in registers) against write_prefill_kv / write_kv +
    the bmm path, bf16 queries, shared prompts and not."""
    import torch

    from rollout.kv_cache import FP8, DecodeAttention, KVCache
    from rollout.shared_prefix import shared_prefix_tables
    from rollout.triton_attention import attend, write_prefill

    torch.manual_seed(0)
    hkv, g, d, slot_len, plen = 8, 2, 128, 300, 100
    kv = dict(num_layers=2, num_slots=b, num_kv_heads=hkv, slot_len=slot_len, head_dim=d, device="cuda")
    cache, ref = KVCache(dtype=FP8, **kv), KVCache(dtype=FP8, **kv)
    kp, vp = (torch.randn(b // 8, hkv, plen, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots, rows = torch.arange(b, device="cuda"), torch.arange(b, device="cuda") // 8
    write_prefill(cache.data, 1, slots, rows, kp, vp, cache.scales)
    _torch_prefill(ref, slots, rows, kp, vp)
    deq = (cache.data[1, :, :b, :, :plen].float() * cache.scales[1, :, :b, :, :plen, None])
    want = (ref.data[1, :, :b, :, :plen].float() * ref.scales[1, :, :b, :, :plen, None])
    # the same rounding (RTNE); Triton's fp32 division may differ from torch's by an ulp, flipping a rare tie
    assert (deq != want).float().mean().item() < 1e-3
    assert (deq - want).abs().max().item() <= want.abs().max().item() / 16
    q = torch.randn(b, hkv * g, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    pos = torch.randint(plen, slot_len, (b,), device="cuda")
    want_out = DecodeAttention(ref.data, positions=pos, kv_index=torch.arange(slot_len, device="cuda"), mode="bmm",
                               scales=ref.scales)(1, q, k, v).float()
    tables = tuple(t.cuda() for t in shared_prefix_tables([(plen, list(range(i, i + 8))) for i in range(0, b, 8)],
                                                          rows=b, members_per_entry=16))
    for prefix in (None, tables):
        c = KVCache(dtype=FP8, **kv)
        c.data.copy_(cache.data), c.scales.copy_(cache.scales)
        out = attend(c.data, 1, pos, q, k, v, slot_len, prefix=prefix, scales=c.scales).float()
        assert (out - want_out).abs().max().item() < 2e-2


def _torch_prefill(cache, slots, rows, k, v):
    """write_prefill_kv's torch path (the op picks the Triton kernel on CUDA)."""
    import torch

    from rollout.kv_cache import quantize_rows

    t = k.shape[2]
    for i, x in enumerate((k, v)):
        values, scales = quantize_rows(x[rows])
        cache.data.view(torch.uint8)[1, i, slots, :, :t] = values.view(torch.uint8)
        cache.scales[1, i, slots, :, :t] = scales


def test_register_caps_by_launch_and_cache_dtype():
    from rollout.triton_attention import tile_config

    # shared launches are capped (the prompt programs would get 255 registers), as is every unshared launch of
    # >= 256 rows: bf16 at 96, fp8 at 128 (its shared launch ran 4% faster there on an H100); small unshared launches
    # uncapped. fp8 tiles take bf16's sizes and stages (their 32-bit words pipeline as bf16's rows do)
    assert tile_config(640, 601, shared=True, fp8=True) == {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2,
                                                            "maxnreg": 128}
    assert tile_config(640, 601, shared=True) == {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "maxnreg": 96}
    assert tile_config(256, 385, fp8=True) == {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "maxnreg": 128}
    assert tile_config(32, 161, fp8=True) == {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3}
    assert tile_config(32, 161) == {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3}
