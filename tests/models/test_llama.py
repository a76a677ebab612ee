"""Llama trunk: packed rows (positions restarting at 0) equal one-by-one forwards; RoPE kept in fp32."""

import pytest
import torch

from models import DocumentAttention, LlamaForValue, build_model, preset_config
from models.document_attention import document_ids_from_positions
from models.document_layout import DocumentLayout


def _packed(lengths, *, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 512, (1, n), generator=gen) for n in lengths]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return [s.to(device) for s in seqs], torch.cat(seqs, dim=1).to(device), pos.to(device)


def test_document_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])
    assert document_ids_from_positions(pos).tolist() == [[1, 1, 1, 2, 2, 3, 4, 4], [1] * 8]


def test_packed_equals_one_by_one_with_grads():
    torch.manual_seed(0)
    model = build_model("tiny", seed=1)
    seqs, packed, pos = _packed([5, 11, 7])
    out = model(packed, pos, attn=DocumentAttention(pos))
    ref = torch.cat([model(s) for s in seqs], dim=1)
    assert (out - ref).abs().max() <= 1e-5
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), list(model.parameters()))
    ref_grads = torch.autograd.grad((ref * g).sum(), list(model.parameters()))
    for a, b in zip(grads, ref_grads):  # fp32 sums over different reduction orders: relative check
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_packed_two_rows_and_critic():
    critic = LlamaForValue(preset_config("tiny"))
    torch.nn.init.normal_(critic.score.weight, std=0.1)
    seqs_a, row_a, pos_a = _packed([4, 9], seed=2)
    seqs_b, row_b, pos_b = _packed([13], seed=3)
    ids, pos = torch.cat([row_a, row_b]), torch.cat([pos_a, pos_b])
    with torch.no_grad():
        values = critic(ids, pos, attn=DocumentAttention(pos))
        ref = torch.cat([torch.cat([critic(s) for s in seqs_a], dim=1), critic(seqs_b[0])])
    assert values.shape == (2, 13) and (values - ref).abs().max() <= 1e-5


def test_varlen_backend_needs_cuda():
    with pytest.raises(ValueError, match="needs CUDA"):
        DocumentAttention(torch.arange(4)[None], backend="varlen")


def _assert_varlen_matches_mask(model, ids, pos):
    _assert_backend_matches_mask(model, ids, pos, "varlen")


def _assert_backend_matches_mask(model, ids, pos, backend):
    """Outputs and gradients of a fused backend match the masked-SDPA backend (half precision)."""
    outs, grads = {}, {}
    # a unit-scale upstream gradient: mean(out^2) gave ~1e-6 gradients, fp16 subnormals, where a
    # relative comparison measures rounding of denormals rather than the attention kernel
    g = torch.randn(ids.shape[0], ids.shape[1], model.config.vocab_size, device="cuda",
                    generator=torch.Generator(device="cuda").manual_seed(0))
    for name in (backend, "mask"):
        out = model(ids, pos, attn=DocumentAttention(pos, backend=name))
        grads[name] = torch.autograd.grad((out.float() * g).sum(), list(model.parameters()))
        outs[name] = out.float()
    assert (outs[backend] - outs["mask"]).abs().max() <= 0.05
    for a, b in zip(grads[backend], grads["mask"]):
        assert (a.float() - b.float()).norm() <= 0.05 * b.float().norm() + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_equals_mask_on_gpu(dtype):
    model = build_model("tiny", dtype=dtype, device="cuda", seed=4)
    seqs, packed, pos = _packed([37, 5, 100, 64, 50], device="cuda")  # 256 tokens, uneven documents
    _assert_varlen_matches_mask(model, packed, pos)
    auto = DocumentAttention(pos)
    assert auto.layout is not None and not auto.continues  # the varlen path's layout is built


def test_rope_frequencies_stay_fp32():
    model = build_model("tiny", dtype=torch.bfloat16)
    exact = model.model.inv_freq.clone()
    assert exact.dtype == torch.float32
    model.model.inv_freq = exact.to(torch.bfloat16)  # what a caller "matching the model dtype" might do
    assert model.model.inv_freq.dtype == torch.float32 and torch.equal(model.model.inv_freq, exact)
    model.to(torch.float16)
    assert torch.equal(model.model.inv_freq, exact)


def _old_varlen_signature(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's varlen_attn signature (no window_size, no enable_gqa)."""


def _torch211_varlen_signature(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                               window_size=(-1, -1)):
    """torch 2.11's varlen_attn signature (window_size, no enable_gqa; the flash kernel takes GQA heads itself)."""


def _install_reference_varlen(monkeypatch, api: str, calls: list | None = None) -> None:
    """Replace varlen_attn with a CPU stand-in (SDPA per segment, causal aligned bottom-right when a
    segment has more keys than queries) whose arguments must also bind to the real varlen_attn signature
    (today's; 2.10's, where GQA heads are expanded by hand and causality is is_causal=True; or 2.11's, whose
    kernel takes fewer K/V heads without a keyword). `calls` receives each call's (query heads, K/V heads)."""
    import inspect

    import torch.nn.attention.varlen as varlen_mod
    import torch.nn.functional as F

    real_sig = inspect.signature({"current": varlen_mod.varlen_attn, "torch2.10": _old_varlen_signature,
                                  "torch2.11": _torch211_varlen_signature}[api])

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        real_sig.bind(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
        causal = kw.get("window_size") == (-1, 0) or kw.get("is_causal") is True
        assert causal and cu_q.dtype == torch.int32 and q.dim() == 3
        gqa = kw.get("enable_gqa", api == "torch2.11" and q.shape[1] != k.shape[1])
        assert gqa or q.shape[1] == k.shape[1]
        if calls is not None:
            calls.append((q.shape[1], k.shape[1]))
        outs = []
        for (s, e), (ks, ke) in zip(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()),
                                    zip(cu_k[:-1].tolist(), cu_k[1:].tolist())):
            n, m = e - s, ke - ks  # bottom-right causal: query i sees keys [0, m - n + i]
            assert n <= max_q and m <= max_k
            mask = torch.ones(n, m, dtype=torch.bool).tril(m - n)
            qs, kk, vv = q[s:e].transpose(0, 1)[None], k[ks:ke].transpose(0, 1)[None], v[ks:ke].transpose(0, 1)[None]
            outs.append(F.scaled_dot_product_attention(qs, kk, vv, attn_mask=mask, enable_gqa=gqa)[0].transpose(0, 1))
        return torch.cat(outs)

    fake_varlen.__signature__ = real_sig
    monkeypatch.setattr(varlen_mod, "varlen_attn", fake_varlen)


@pytest.mark.parametrize("api", ["current", "torch2.10"])
def test_varlen_layout_with_reference_kernel(monkeypatch, api):
    """The flatten / cu_seqlens / unflatten around varlen_attn, with a CPU stand-in kernel."""
    _install_reference_varlen(monkeypatch, api)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 0, 1]])
    layout = DocumentLayout.from_positions(pos)
    assert layout.cu_seqlens.tolist() == [0, 3, 7, 8, 14, 16] and layout.max_len == 6 and not layout.continues
    attn = DocumentAttention(pos, backend="mask")
    attn.layout = layout
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 8, 16, generator=gen) for h in (4, 2, 2))
    torch.testing.assert_close(attn._varlen_attention(q, k, v), attn(0, q, k, v), rtol=0, atol=1e-6)


@pytest.mark.parametrize("native", [True, False])
def test_varlen_takes_gqa_heads_as_they_are_where_the_kernel_does(monkeypatch, native):
    """torch 2.11's varlen_attn has no enable_gqa, but its flash kernel takes fewer K/V heads: where the GPU probe
    ("varlen_gqa", forced here) accepted that, K and V reach it unexpanded; outputs and q/k/v gradients equal the
    mask path's either way, shared-prompt continuations included."""
    calls = []
    _install_reference_varlen(monkeypatch, "torch2.11", calls)
    _, _, pos = _shared_prompt_rows(prompt_len=6, response_lens=(5, 3, 7))
    pos = torch.cat([pos, torch.arange(pos.shape[1])[None]])
    attn = DocumentAttention(pos, backend="mask")
    attn.layout, attn.gqa_native = DocumentLayout.from_positions(pos), native
    gen = torch.Generator().manual_seed(2)
    qkv = [torch.randn(2, h, pos.shape[1], 16, generator=gen, dtype=torch.float64, requires_grad=True)
           for h in (4, 2, 2)]
    out, ref = attn._varlen_attention(*qkv), attn(0, *qkv)
    assert calls == [(4, 2 if native else 4)]
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, qkv, g), torch.autograd.grad(ref, qkv, g)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    attn.gqa_native = None  # undecided: the probe's answer, which off CUDA is no
    attn._varlen_attention(*qkv)
    assert calls[-1] == (4, 4)


def _shared_prompt_rows(prompt_len=6, response_lens=(5, 3, 7), seed=5, device="cpu"):
    """One prompt, several responses: the full sequences, and the shared packing (prompt once; later
    responses continue at position prompt_len)."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 512, (prompt_len,), generator=gen)
    resps = [torch.randint(0, 512, (n,), generator=gen) for n in response_lens]
    full = [torch.cat([prompt, r])[None].to(device) for r in resps]
    ids = torch.cat([prompt, *resps])[None]
    pos = torch.cat([torch.arange(prompt_len + response_lens[0])]
                    + [torch.arange(prompt_len, prompt_len + n) for n in response_lens[1:]])[None]
    return full, ids.to(device), pos.to(device)


def test_shared_prompt_continuations_equal_full_sequences_with_grads():
    torch.manual_seed(0)
    model = build_model("tiny", seed=1)
    full, ids, pos = _shared_prompt_rows()
    attn = DocumentAttention(pos)
    assert attn.continues
    out = model(ids, pos, attn=attn)  # [1, 6 + 5 + 3 + 7, V]
    refs = [model(f)[0] for f in full]
    # the root holds prompt + response 0; response k > 0 sits after it, its tokens at their own offsets
    torch.testing.assert_close(out[0, :11], refs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0, 11:14], refs[1][6:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0, 14:21], refs[2][6:], rtol=1e-5, atol=1e-5)
    # gradients: the prompt's share from every response reaches the one prompt copy
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), list(model.parameters()))
    ref_loss = (refs[0] * g[0, :11]).sum() + (refs[1][6:] * g[0, 11:14]).sum() + (refs[2][6:] * g[0, 14:21]).sum()
    for a, b in zip(grads, torch.autograd.grad(ref_loss, list(model.parameters()))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_prefix_key_index_and_rows_without_a_root():
    pos = torch.tensor([[0, 1, 2, 3, 2, 3, 0, 1], [4, 5, 6, 0, 1, 1, 2, 2]])
    lay = DocumentLayout.from_positions(pos)
    index, cu, max_k = lay.key_index, lay.cu_seqlens_k, lay.max_k
    assert lay.continues and lay.cu_seqlens.tolist() == [0, 4, 6, 8, 11, 13, 15, 16]
    # row 0: root [0..3], continuation at 2 sees root tokens 0, 1 then itself, then a new root;
    # row 1: starts mid-sequence (no root: plain), root [11, 12], continuation [13, 14] from position 1
    # sees token 11, continuation [15] from position 2 sees tokens 11, 12
    assert index.tolist() == [0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 11, 13, 14, 11, 12, 15]
    assert cu.tolist() == [0, 4, 8, 10, 13, 15, 18, 21] and max_k == 4
    # the mask path agrees: continuation queries see their root's first s tokens
    mask = DocumentAttention(pos, backend="mask").mask[:, 0]
    assert mask[0, 4].tolist() == [True, True, False, False, True, False, False, False]
    assert mask[1, 0].tolist() == [True] + [False] * 7 and mask[1, 5].tolist() == [False] * 3 + [True, False, True,
                                                                                                 False, False]
    assert mask[1, 7].tolist() == [False] * 3 + [True, True, False, False, True]


@pytest.mark.gpu
def test_shared_prompt_varlen_equals_mask_on_gpu():
    model = build_model("tiny", dtype=torch.bfloat16, device="cuda", seed=4)
    _, ids, pos = _shared_prompt_rows(prompt_len=40, response_lens=(30, 64, 17, 50), device="cuda")
    _assert_varlen_matches_mask(model, ids, pos)
    assert DocumentAttention(pos).continues  # (and the probe accepted bottom-right causal varlen)


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True])
def test_varlen_gqa_heads_unexpanded_equal_expanded_on_gpu(shared):
    # the flash kernel's own GQA (K/V heads unexpanded) against K/V expanded by hand: outputs and q/k/v gradients;
    # the probe accepts it on this GPU
    from models.document_attention import _fused_ok

    _, _, pos = _shared_prompt_rows(prompt_len=40, response_lens=(30, 64, 17, 50), device="cuda")
    if not shared:
        pos = torch.cat([torch.arange(80), torch.arange(101)])[None].cuda()
    gen = torch.Generator(device="cuda").manual_seed(3)
    qkv = [torch.randn(1, h, pos.shape[1], 128, device="cuda", dtype=torch.bfloat16, generator=gen,
                       requires_grad=True) for h in (16, 8, 8)]
    g = torch.randn(1, 16, pos.shape[1], 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    results = []
    for native in (True, False):
        attn = DocumentAttention(pos, backend="varlen")
        attn.gqa_native = native
        out = attn(0, *qkv)
        results.append((out, *torch.autograd.grad(out, qkv, g)))
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=0)
    assert _fused_ok("varlen_gqa", pos.device, torch.bfloat16, prefix=shared)


def _naive_prefix_keys(pos: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """Segment bounds, key index and key bounds by walking the segments (the layout's definition)."""
    b, t = pos.shape
    flat = pos.reshape(-1).tolist()
    bounds = [i for i in range(b * t) if i % t == 0 or flat[i] <= flat[i - 1]] + [b * t]
    index, cu_k, root = [], [0], None
    for a, e in zip(bounds[:-1], bounds[1:]):
        if a % t == 0:
            root = None
        if flat[a] == 0 or root is None:
            root = a if flat[a] == 0 else None
            index += list(range(a, e))
        else:
            index += list(range(root, root + flat[a])) + list(range(a, e))
        cu_k.append(len(index))
    return bounds, index, cu_k


def _random_prefix_rows(gen, b, t):
    """[b, t] position rows of runs that restart at 0 or continue from a random earlier position."""
    pos = torch.zeros(b, t, dtype=torch.long)
    for r in range(b):
        at = 0
        while at < t:
            n = int(torch.randint(1, 9, (1,), generator=gen))
            s0 = int(torch.randint(0, 6, (1,), generator=gen)) * int(torch.rand(1, generator=gen) < 0.6)
            pos[r, at:at + n] = torch.arange(s0, s0 + n)[: t - at]
            at += n
    return pos


def test_host_layout_equals_walking_the_segments_on_random_rows():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        b, t = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 40, (1,), generator=gen))
        pos = _random_prefix_rows(gen, b, t)
        lay = DocumentLayout.from_positions(pos)
        bounds, index, cu_k = _naive_prefix_keys(pos)
        assert lay.cu_seqlens.tolist() == bounds
        cont = bool(((pos[:, 1:] <= pos[:, :-1]) & (pos[:, 1:] > 0)).any())
        assert lay.continues == cont
        if cont:
            assert lay.key_index.tolist() == index and lay.cu_seqlens_k.tolist() == cu_k
            assert lay.max_k == max(b2 - a2 for a2, b2 in zip(cu_k[:-1], cu_k[1:]))


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_gather_keys_equals_index_select_with_grads(backend):
    """gather_keys' atomic-free backward (own copy + fp32 sum of the prompt's extra copies) equals the
    gradient of x[key_index] on random layouts, eager and traced by torch.compile (fwd and bwd graphs)."""
    from models.document_layout import gather_keys

    gen = torch.Generator().manual_seed(3)
    fn = gather_keys if backend is None else torch.compile(gather_keys, backend=backend, dynamic=True)
    checked = 0
    for _ in range(40):
        pos = _random_prefix_rows(gen, int(torch.randint(1, 4, (1,), generator=gen)),
                                  int(torch.randint(2, 40, (1,), generator=gen)))
        lay = DocumentLayout.from_positions(pos)
        if not lay.continues:
            continue
        x = torch.randn(pos.numel(), 2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
        g = torch.randn(lay.key_index.numel(), 2, 3, generator=gen, dtype=torch.float64)
        out = fn(x, lay)
        ref = x.index_select(0, lay.key_index)
        assert torch.equal(out, ref)
        (got,) = torch.autograd.grad(out, x, g)
        (want,) = torch.autograd.grad(ref, x, g)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        checked += 1
    assert checked > 10


def test_gather_keys_backward_sums_the_prompt_in_fp32():
    """bf16 rows: the prompt token seen by many continuations gets its gradient summed in fp32 and
    rounded once (index_add would round after every copy)."""
    from models.document_layout import gather_keys

    pos = torch.tensor([[0, 1] + [1] * 64])  # a root of 2 tokens, 64 one-token continuations seeing token 0
    lay = DocumentLayout.from_positions(pos)
    assert lay.prefix_rows.tolist() == [0] and lay.prefix_copies.shape == (1, 64)
    x = torch.zeros(pos.numel(), 1, dtype=torch.bfloat16, requires_grad=True)
    g = torch.full((lay.key_index.numel(), 1), 1 + 2 ** -7, dtype=torch.bfloat16)  # exact in bf16
    (got,) = torch.autograd.grad(gather_keys(x, lay), x, g)
    assert got[0].item() == torch.tensor(65 * (1 + 2 ** -7), dtype=torch.bfloat16).item()
    assert torch.equal(got[1:], g[:1].expand(pos.numel() - 1, 1))


@pytest.mark.parametrize("api", ["current", "torch2.10"])
def test_varlen_shared_prompt_layout_with_reference_kernel(monkeypatch, api):
    """Continuation segments through _varlen_attention (gathered keys, GQA expanded after the gather on
    2.10) with a CPU stand-in kernel: outputs and q/k/v gradients equal the mask path's."""
    _install_reference_varlen(monkeypatch, api)
    _, _, pos = _shared_prompt_rows(prompt_len=6, response_lens=(5, 3, 7))
    pos = torch.cat([pos, torch.arange(pos.shape[1])[None]])  # and a plain row
    attn = DocumentAttention(pos, backend="mask")
    attn.layout = DocumentLayout.from_positions(pos)
    assert attn.layout.continues
    gen = torch.Generator().manual_seed(1)
    qkv = [torch.randn(2, h, pos.shape[1], 16, generator=gen, dtype=torch.float64, requires_grad=True)
           for h in (4, 2, 2)]
    out, ref = attn._varlen_attention(*qkv), attn(0, *qkv)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, qkv, g), torch.autograd.grad(ref, qkv, g)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _well_formed_prefix_rows(gen, b, t):
    """[b, t] rows of roots (from 0) and continuations of the row's last root (from s <= its length)."""
    pos = torch.zeros(b, t, dtype=torch.long)
    for r in range(b):
        at, root_len = 0, 0
        while at < t:
            n = int(torch.randint(1, 9, (1,), generator=gen))
            s0 = 0
            if root_len and torch.rand(1, generator=gen) < 0.6:
                s0 = int(torch.randint(1, root_len + 1, (1,), generator=gen))
            pos[r, at:at + n] = torch.arange(s0, s0 + n)[: t - at]
            root_len = min(n, t - at) if s0 == 0 else root_len
            at += n
    return pos


def _naive_copies(pos: torch.Tensor) -> dict[str, list]:
    """The own positions and the prompt tokens' extra copies, in key and in dense positions, by walking
    each segment's keys (_naive_prefix_keys): a segment's keys before its own tokens are copies."""
    bounds, index, cu_k = _naive_prefix_keys(pos)
    width = max(b - a for a, b in zip(cu_k[:-1], cu_k[1:]))
    dense, own, dense_own, copies = [], [0] * pos.numel(), [0] * pos.numel(), {}
    for i in range(len(bounds) - 1):
        keys = index[cu_k[i]:cu_k[i + 1]]
        pre = len(keys) - (bounds[i + 1] - bounds[i])
        dense.append(keys + [0] * (width - len(keys)))
        for col, tok in enumerate(keys):
            if col < pre:  # in continuation order: segments are walked in order
                copies.setdefault(tok, []).append((cu_k[i] + col, i * width + col))
            else:
                own[tok], dense_own[tok] = cu_k[i] + col, i * width + col
    rows = sorted(copies)
    c = max((len(v) for v in copies.values()), default=1)
    pad = [copies[r] + [(-1, -1)] * (c - len(copies[r])) for r in rows]
    return {"own_index": own, "prefix_rows": rows, "prefix_copies": [[k for k, _ in v] for v in pad],
            "dense_index": dense, "dense_own": dense_own, "dense_prefix_rows": rows,
            "dense_prefix_copies": [[d for _, d in v] for v in pad], "width": c}


def test_host_layout_copies_and_dense_view_equal_walking_the_keys():
    """own_index, the prompt copies (sorted tokens, copies in continuation order, -1 padded) and the dense
    view equal the walk, on rows of well-formed GRPO groups (host_layout's sort-free path) and on any rows."""
    gen = torch.Generator().manual_seed(5)
    for rows_of in (_well_formed_prefix_rows, _random_prefix_rows) * 150:
        b, t = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 40, (1,), generator=gen))
        pos = rows_of(gen, b, t)
        lay, want = DocumentLayout.from_positions(pos), _naive_copies(pos)
        names = ["dense_index", "dense_own", "dense_prefix_rows", "dense_prefix_copies"]
        if lay.continues:
            names += ["own_index", "prefix_rows", "prefix_copies"]
        for name in names:
            got = getattr(lay, name)
            assert got.dtype == torch.int64 and got.tolist() == want[name], name
        assert lay.dense_prefix_copies.shape[1] == want["width"]


def test_dense_view_equals_mask_with_grads_on_random_rows():
    """The dense view (each segment a padded row of its keys, causal top-left, own positions picked):
    outputs and q/k/v gradients equal the mask path's on random rows of roots and continuations."""
    gen = torch.Generator().manual_seed(7)
    for _ in range(30):
        pos = _well_formed_prefix_rows(gen, int(torch.randint(1, 4, (1,), generator=gen)),
                                       int(torch.randint(2, 30, (1,), generator=gen)))
        qkv = [torch.randn(pos.shape[0], h, pos.shape[1], 8, generator=gen, dtype=torch.float64,
                           requires_grad=True) for h in (4, 2, 2)]
        dense = DocumentAttention(pos, backend="dense")
        out, ref = dense(0, *qkv), DocumentAttention(pos, backend="mask")(0, *qkv)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        for a, b in zip(torch.autograd.grad(out, qkv, g), torch.autograd.grad(ref, qkv, g)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_cpu_auto_takes_the_dense_view_for_rows_of_short_documents():
    """Off CUDA, auto with the packer's layout: a row of many short documents (a supervised warm-up's packed
    demonstrations) runs the dense view, equal to the mask in outputs and gradients; one long document keeps the
    mask (its dense view is no smaller); without a layout the mask as before."""
    from ppo.batch.packing import pack

    gen = torch.Generator().manual_seed(3)
    short = pack([torch.randint(1, 50, (int(n),), generator=gen) for n in torch.randint(3, 9, (12,), generator=gen)],
                 pad_id=0)
    long = pack([torch.randint(1, 50, (40,), generator=gen)], pad_id=0)
    assert DocumentAttention(short.position_ids, layout=short.layout).cpu_dense
    assert not DocumentAttention(long.position_ids, layout=long.layout).cpu_dense
    assert not DocumentAttention(short.position_ids).cpu_dense
    t = short.position_ids.shape[1]
    qkv = [torch.randn(1, h, t, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)]
    out = DocumentAttention(short.position_ids, layout=short.layout)(0, *qkv)
    ref = DocumentAttention(short.position_ids, backend="mask")(0, *qkv)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, qkv, g), torch.autograd.grad(ref, qkv, g)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_dense_view_of_shared_prompts_and_its_waste():
    """A prompt of 4 with responses of 3, 2, 3 (the first in the root): rows [prompt + own keys], the
    own positions, the prompt's extra copies, and the waste = padded causal pairs / the own pairs."""
    _, _, pos = _shared_prompt_rows(prompt_len=4, response_lens=(3, 2, 3))
    lay = DocumentLayout.from_positions(pos)
    assert lay.dense_index.tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 7, 8, 0], [0, 1, 2, 3, 9, 10, 11]]
    assert lay.dense_own.tolist() == [0, 1, 2, 3, 4, 5, 6, 11, 12, 18, 19, 20]
    assert lay.dense_prefix_rows.tolist() == [0, 1, 2, 3]
    assert lay.dense_prefix_copies.tolist() == [[7, 14], [8, 15], [9, 16], [10, 17]]
    own_pairs = 7 * 8 / 2 + (2 * 4 + 3) + (3 * 4 + 6)  # the root causal; each continuation: prompt + causal
    assert lay.dense_waste == pytest.approx(3 * 7 * 8 / 2 / own_pairs)
    plain = DocumentLayout.from_positions(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]]))  # no continuations
    assert plain.dense_index.tolist() == [[0, 1, 2, 0], [3, 4, 5, 6], [7, 0, 0, 0]]
    assert plain.dense_own.tolist() == [0, 1, 2, 4, 5, 6, 7, 8] and plain.dense_prefix_rows.numel() == 0


def test_dense_attention_traces_under_compile():
    """The dense path under torch.compile (aot_eager: forward and backward graphs), as the training
    layers run it, equals eager."""
    _, _, pos = _shared_prompt_rows(prompt_len=6, response_lens=(5, 3, 7))
    attn = DocumentAttention(pos, backend="dense")
    gen = torch.Generator().manual_seed(2)
    qkv = [torch.randn(1, h, pos.shape[1], 16, generator=gen, requires_grad=True) for h in (4, 2, 2)]
    out = torch.compile(lambda *x: attn(0, *x), backend="aot_eager", dynamic=True)(*qkv)
    ref = attn(0, *qkv)
    torch.testing.assert_close(out, ref)
    g = torch.randn(out.shape, generator=gen)
    for a, b in zip(torch.autograd.grad(out, qkv, g), torch.autograd.grad(ref, qkv, g)):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_equals_mask_on_gpu_and_auto_takes_it(dtype):
    """cuDNN's fused kernel over the dense view of shared prompts equals the mask path (model outputs
    and gradients); a GRPO-like layout (equal responses) has little waste, so auto takes it for
    forward-only passes."""
    model = build_model("tiny", dtype=dtype, device="cuda", seed=4)
    _, ids, pos = _shared_prompt_rows(prompt_len=40, response_lens=(30, 64, 17, 50), device="cuda")
    _assert_backend_matches_mask(model, ids, pos, "dense")
    _, _, even = _shared_prompt_rows(prompt_len=32, response_lens=(64,) * 8, device="cuda")
    auto = DocumentAttention(even)
    assert auto.layout.dense_waste < 1.25 and auto.dense_fits
    from models.document_attention import _fused_ok

    assert _fused_ok("dense", even.device, dtype, prefix=True)
    calls = []
    auto._dense_attention = lambda *x: calls.append(1) or DocumentAttention._dense_attention(auto, *x)
    q, k, v = (torch.randn(1, h, even.shape[1], 64, device="cuda", dtype=dtype) for h in (4, 2, 2))
    auto(0, q, k, v)
    with torch.no_grad():
        auto(0, q, k, v)
    assert calls == [1]  # the no-grad call only
