"""The Triton unfiltered-sampling kernel against rollout.sampler.sample(filtered=False), run by Triton's CPU
interpreter (TRITON_INTERPRET=1) in a child process (the variable must be set before triton is imported, and
must not leak into other tests); plus a GPU check at the engine's real shape."""

import textwrap

import pytest
import torch

from tests.triton_interp import run_interpreted as _run_interpreted

pytest.importorskip("triton")


# shared by the child processes and the GPU test: sample() with no filtering, and a float64 acceptance check.
# The kernel sums in another order than torch's cumsum, so a draw may differ from sample()'s when u falls within
# rounding of a CDF boundary; `check` requires both to be exact float64 inverse-CDF draws up to EPS, and almost
# all (>= 99%) draws to be identical.
HELPERS = """
import torch
from rollout.sampler import sample

EPS = 1e-5


def reference(logits, temp, u):
    b = logits.shape[0]
    return sample(logits, temperature=temp, top_k=torch.zeros(b, dtype=torch.long, device=logits.device),
                  top_p=torch.ones(b, device=logits.device), uniforms=u, filtered=False)


def valid_draw(logits, temp, u, tok):
    # cdf64[tok - 1] <= u <= cdf64[tok] up to EPS, with the float64 CDF of x = logits.float() / T; greedy: argmax
    x = logits.float().double()
    t = torch.where(temp > 0, temp, torch.ones_like(temp)).double()
    cdf = torch.softmax(x / t[:, None], -1).cumsum(-1)
    hi = cdf.gather(1, tok[:, None])[:, 0]
    lo = torch.where(tok > 0, cdf.gather(1, (tok - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(hi))
    ud = u.double()
    ok = (lo - EPS <= ud) & (ud <= hi + EPS) & (hi > lo)  # hi > lo: never a token of zero probability
    return torch.where(temp > 0, ok, tok == logits.float().argmax(-1))


def check(logits, temp, u, tok, lp, lp_tol, min_same=0.99):
    rt, rl = reference(logits, temp, u)
    greedy = temp <= 0
    assert torch.equal(tok[greedy], rt[greedy]), "greedy tokens are the first argmax"
    assert valid_draw(logits, temp, u, tok).all(), (tok, rt)
    assert valid_draw(logits, temp, u, rt).all()  # the check itself accepts sample()'s draws
    same = (tok == rt).float().mean().item()
    assert same >= min_same, same
    # the logprob of the kernel's token, by the torch formula (also where the token differs)
    t = torch.where(greedy, torch.ones_like(temp), temp)
    want = torch.log_softmax(logits.float() / t[:, None], -1).gather(1, tok[:, None])[:, 0]
    err = (lp - want).abs().max().item()
    assert err <= lp_tol, err
    return same
"""


def run_interpreted(code: str) -> str:
    return _run_interpreted(HELPERS + textwrap.dedent(code))


def test_kernel_matches_unfiltered_sample_on_random_rows():
    out = run_interpreted("""
        from rollout.triton_sampling import available, sample_unfiltered
        assert available(torch.device("cpu"))  # the interpreter runs CPU tensors
        torch.manual_seed(0)
        lo_u, hi_u = 0.5 / (1 << 24), 1 - 0.5 / (1 << 24)  # the extreme uniforms uniform_from_counter makes
        for dtype, lp_tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-3)):
            for vocab, rows in ((1000, 32), (3001, 16)):  # 4 and 12 tiles of 256, the last one partial
                logits = (torch.randn(rows, vocab) * 4).to(dtype)
                temp = torch.tensor([0.0, 0.7, 1.0, 1.3]).repeat(rows // 4)
                u = torch.rand(rows).clamp(lo_u, hi_u)
                tok, lp = sample_unfiltered(logits, temp, u)
                assert tok.dtype == torch.int64 and lp.dtype == torch.float32 and tok.shape == lp.shape == (rows,)
                same = check(logits, temp, u, tok, lp, lp_tol)
                # u at its extremes sits within fp32 rounding of the CDF's ends: valid draws, maybe not sample()'s
                u = torch.tensor([lo_u, hi_u]).repeat(rows // 2)
                tok, lp = sample_unfiltered(logits, temp, u)
                check(logits, temp, u, tok, lp, lp_tol, min_same=0.0)
                print(dtype, vocab, same)
        print("ok")
    """)
    assert "ok" in out


def test_padded_vocab_strided_rows_ties_and_peaked_rows():
    run_interpreted("""
        from rollout.triton_sampling import sample_unfiltered
        torch.manual_seed(1)
        rows, vocab = 12, 700
        # a [rows, vocab] view of a wider buffer (row stride != vocab); -inf (masked) logits fill the second
        # 256-tile and the last 150 entries (vocab padding)
        buf = torch.randn(rows, vocab + 37) * 2
        buf[:, 256:512] = float("-inf")
        buf[:, vocab - 150: vocab] = float("-inf")
        logits = buf[:, :vocab]
        temp = torch.tensor([0.0, 1.0, 0.7]).repeat(rows // 3)
        u = torch.linspace(1e-7, 1 - 1e-7, rows)
        tok, lp = sample_unfiltered(logits, temp, u)
        check(logits, temp, u, tok, lp, 1e-5)
        assert torch.isfinite(logits.gather(1, tok[:, None])).all(), "a -inf logit is never drawn, even for u ~ 1"
        sub = sample_unfiltered(logits[3:8], temp[3:8], u[3:8])  # a row's draw ignores the batch around it
        assert torch.equal(sub[0], tok[3:8]) and torch.equal(sub[1], lp[3:8])
        # u at the mass of the first tile: the draw is its last token or the first one after the masked tile
        p = torch.softmax(logits.double(), -1)
        u = (p[:, :256].sum(-1) * (1 + torch.tensor([-1e-6, 1e-6]).repeat(rows // 2))).float()
        tok, lp = sample_unfiltered(logits, torch.ones(rows), u)
        check(logits, torch.ones(rows), u, tok, lp, 1e-5, min_same=0.0)
        assert tok.tolist() == [255, 512] * (rows // 2), tok

        # greedy ties: the first index of the max, also when the tie spans tiles
        tied = torch.zeros(2, vocab)
        tied[:, [300, 45, 40, 600]] = 5.0
        tok, lp = sample_unfiltered(tied, torch.zeros(2), torch.full((2,), 0.5))
        assert tok.tolist() == [40, 40], tok
        assert (lp - torch.log_softmax(tied, -1)[:, 40]).abs().max() <= 1e-6

        # one logit far above the rest wins for every u, wherever it is
        peaked = torch.randn(8, vocab)
        where = torch.tensor([0, 1, 255, 256, 257, 511, 600, vocab - 1])
        peaked[torch.arange(8), where] += 60.0
        for uu in (1e-7, 0.5, 1 - 1e-7):
            tok, lp = sample_unfiltered(peaked, torch.tensor([1.0, 1.3] * 4), torch.full((8,), uu))
            assert torch.equal(tok, where), (uu, tok)
            assert lp.abs().max() < 1e-4  # log p ~ 0
        print("ok")
    """)


def test_decode_tail_equals_the_draw_then_the_rows_advance():
    """decode_tail (the engine's step after its forward, one kernel) equals sample_unfiltered on the gathered
    uniforms followed by the rows' advance written as torch ops (what it replaced), bit for bit; rows past B and
    meta_i's other rows are untouched."""
    run_interpreted("""
        from rollout.sampler import uniform_from_counter
        from rollout.triton_sampling import decode_tail, sample_unfiltered
        torch.manual_seed(2)
        slots, slot_len, vocab, b = 24, 40, 700, 20
        logits = (torch.randn(b, vocab + 5) * 3)[:, :vocab].to(torch.bfloat16)  # strided rows
        meta_i = torch.zeros(5, slots, dtype=torch.int64)
        meta_i[0] = torch.randint(0, vocab, (slots,))
        meta_i[1] = torch.randint(0, slot_len, (slots,))
        meta_i[1, :3] = slot_len - 1  # at the end of the slot: the advance clamps
        meta_i[2] = torch.randint(0, 2**40, (slots,))
        meta_i[4] = torch.randint(0, 2, (slots,))
        meta_f = torch.rand(2, slots) + 0.3
        meta_f[0, 5] = 0.0  # a greedy row
        u_table = uniform_from_counter(meta_i[2][:, None], torch.arange(slot_len + 1)[None, :])
        u_table = torch.cat([u_table, torch.full((1, slot_len + 1), 0.5)])  # [slots + 1, slot_len + 1]
        out = torch.full((2 * slots,), -7.0, dtype=torch.float64)

        ids, pos, active = (meta_i[r, :b].clone() for r in (0, 1, 4))
        u = u_table[:b].gather(1, (pos + 1)[:, None])[:, 0]
        tok, lp = sample_unfiltered(logits, meta_f[0, :b], u)
        want_i = meta_i.clone()
        want_i[0, :b] = torch.where(active > 0, tok, torch.zeros_like(tok))
        want_i[1, :b] = torch.clamp(pos + active, max=slot_len - 1)
        want_out = out.clone()
        want_out[:b], want_out[b: 2 * b] = tok.double(), lp.double()

        decode_tail(logits, meta_i, meta_f[0], u_table, out, max_position=slot_len - 1)
        assert torch.equal(meta_i, want_i), (meta_i, want_i)
        assert torch.equal(out, want_out), (out - want_out).abs().max()
        assert (want_i[1, :b] != pos).any() and (want_i[0, :b] == 0).any()  # the case exercises both branches
        decode_tail(logits[:0], meta_i, meta_f[0], u_table, out, max_position=slot_len - 1)  # B = 0: a no-op
        assert torch.equal(meta_i, want_i)
        print("ok")
    """)


def test_custom_op_registration():
    """Schema, fake (meta) kernel and autograd registration are consistent, as torch.compile relies on."""
    run_interpreted("""
        from rollout.triton_sampling import sample_unfiltered
        logits = torch.randn(4, 300)
        args = (logits, torch.tensor([0.0, 1.0, 0.5, 2.0]), torch.tensor([0.1, 0.5, 0.9, 0.3]))
        torch.library.opcheck(sample_unfiltered, args, test_utils=("test_schema", "test_faketensor"))
        with torch._subclasses.FakeTensorMode():
            tok, lp = sample_unfiltered(torch.empty(4, 300), torch.empty(4), torch.empty(4))
        assert tok.shape == lp.shape == (4,) and tok.dtype == torch.int64 and lp.dtype == torch.float32
        empty = sample_unfiltered(torch.empty(0, 300), torch.empty(0), torch.empty(0))
        assert [t.shape for t in empty] == [(0,), (0,)]
        print("ok")
    """)


@pytest.mark.gpu
def test_kernel_on_gpu_at_decode_shape_and_under_cuda_graph():
    ns = {}
    exec(HELPERS, ns)
    from rollout.triton_sampling import available, sample_unfiltered

    dev = torch.device("cuda")
    assert available(dev)
    torch.manual_seed(0)
    rows, vocab = 256, 32000
    for dtype, lp_tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-3)):
        logits = (torch.randn(rows, vocab, device=dev) * 4).to(dtype)
        temp = torch.tensor([0.0, 0.7, 1.0, 1.3], device=dev).repeat(rows // 4)
        u = torch.rand(rows, device=dev).clamp(1e-7, 1 - 1e-7)
        tok, lp = sample_unfiltered(logits, temp, u)
        ns["check"](logits, temp, u, tok, lp, lp_tol)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_tok, g_lp = sample_unfiltered(logits, temp, u)
        graph.replay()
        assert torch.equal(g_tok, tok) and torch.equal(g_lp, lp)

    # decode_tail, captured as the engine does: the same draw from the uniform at each row's next position
    from rollout.triton_sampling import decode_tail

    slots, slot_len = rows + 8, 300
    meta_i = torch.zeros(5, slots, dtype=torch.int64, device=dev)
    meta_i[1] = torch.randint(0, slot_len - 1, (slots,), device=dev)
    meta_i[4] = 1
    u_table = torch.rand(slots + 1, slot_len + 1, device=dev).clamp(1e-7, 1 - 1e-7)
    out = torch.zeros(2 * slots, dtype=torch.float64, device=dev)
    u = u_table[:rows].gather(1, (meta_i[1, :rows] + 1)[:, None])[:, 0]
    tok, lp = sample_unfiltered(logits, temp, u)
    pos = meta_i[1].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_tail(logits, meta_i, temp, u_table, out, max_position=slot_len - 1)
    meta_i[1] = pos  # capture ran nothing; the replay runs the step once
    graph.replay()
    assert torch.equal(out[:rows], tok.double()) and torch.equal(out[rows: 2 * rows], lp.double())
    assert torch.equal(meta_i[0, :rows], tok) and torch.equal(meta_i[1, :rows], pos[:rows] + 1)
