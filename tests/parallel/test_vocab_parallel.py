"""Vocab-parallel token log-probs and entropy (and their gradients) equal a naive log_softmax gather."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel.vocab_parallel import vocab_parallel_token_logprobs
from tests.dist_utils import run_world

N, H, V, TEMP = 13, 16, 40, 0.8


def _data():
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    targets = torch.randint(0, V, (N,), generator=g)
    g_logp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return hidden, weight, targets, g_logp, g_ent


def _naive(hidden, weight, targets):
    """Full [N, V] logits, log_softmax, gather: the definition."""
    ls = F.log_softmax((hidden @ weight.t()).float() / TEMP, -1)
    return ls.gather(-1, targets[:, None]).squeeze(-1), -(ls.exp() * ls).sum(-1)


def _with_grads(fn, hidden, weight, targets, g_logp, g_ent):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    logp, ent = fn(h, w, targets)
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def test_single_device_equals_naive_and_models_logprobs():
    from models.logprobs import compute_token_logprobs

    data = _data()
    ref = _with_grads(_naive, *data)
    ours = _with_grads(lambda h, w, t: vocab_parallel_token_logprobs(h, w, t, tp_group=None, temperature=TEMP,
                                                                     chunk_size=4, with_entropy=True), *data)
    theirs = _with_grads(lambda h, w, t: compute_token_logprobs(h, w, t, temperature=TEMP, chunk_size=5,
                                                                with_entropy=True), *data)
    for a, b, c in zip(ours, ref, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def test_shapes_and_errors():
    hidden, weight, targets, _, _ = _data()
    logp, ent = vocab_parallel_token_logprobs(hidden.view(1, N, H), weight, targets.view(1, N), tp_group=None)
    assert logp.shape == (1, N) and logp.dtype == torch.float32 and ent is None
    with pytest.raises(ValueError, match="does not match head weight"):
        vocab_parallel_token_logprobs(hidden, weight.t(), targets, tp_group=None)
    with pytest.raises(ValueError, match="targets"):
        vocab_parallel_token_logprobs(hidden, weight, targets[:-1], tp_group=None)


def _vp_body(rank, world):
    import torch.distributed as dist

    hidden, weight, targets, g_logp, g_ent = _data()
    rows = V // world
    local = weight[rank * rows:(rank + 1) * rows]
    fn = lambda h, w, t: vocab_parallel_token_logprobs(h, w, t, tp_group=dist.group.WORLD, vocab_start=rank * rows,
                                                       temperature=TEMP, chunk_size=6, with_entropy=True)
    return _with_grads(fn, hidden, local, targets, g_logp, g_ent)


@pytest.mark.distributed
def test_vocab_parallel_equals_naive():
    data = _data()
    logp, ent, gh, gw = _with_grads(_naive, *data)
    out = run_world(_vp_body, 2)
    rows = V // 2
    for rank, (lp, en, h_grad, w_grad) in enumerate(out):
        torch.testing.assert_close(lp, logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(en, ent, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h_grad, gh, rtol=1e-5, atol=1e-5)  # hidden grad all-reduced over the vocab split
        torch.testing.assert_close(w_grad, gw[rank * rows:(rank + 1) * rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use", ["logp", "entropy"])
def test_gradient_of_one_output_only(use):
    """The unused output gets no gradient (None): its backward terms are skipped, not zero-filled."""
    hidden, weight, targets, g_logp, g_ent = _data()
    pick = (lambda lp, en: (lp * g_logp).sum()) if use == "logp" else (lambda lp, en: (en * g_ent).sum())
    grads = []
    for fn in (_naive, lambda h, w, t: vocab_parallel_token_logprobs(h, w, t, tp_group=None, temperature=TEMP,
                                                                     chunk_size=5, with_entropy=True)):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        grads.append(torch.autograd.grad(pick(*fn(h, w, targets)), (h, w)))
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_bf16_on_cuda_matches_fp32_reference():
    """The GPU path: bf16 matmuls, fp32 softmax statistics, chunks of several thousand tokens."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 5000, 256, 32000
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * 0.05).bfloat16()
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    hid, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp, ent = vocab_parallel_token_logprobs(hid, w, targets, tp_group=None, chunk_size=2048, with_entropy=True)
    (logp.sum() + ent.sum()).backward()
    h32, w32 = hidden.float().requires_grad_(True), weight.float().requires_grad_(True)
    ls = F.log_softmax(h32 @ w32.t(), -1)
    ref_logp, ref_ent = ls.gather(-1, targets[:, None]).squeeze(-1), -(ls.exp() * ls).sum(-1)
    (ref_logp.sum() + ref_ent.sum()).backward()
    assert logp.dtype == torch.float32 and hid.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=2e-2)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=2e-2)
    torch.testing.assert_close(hid.grad.float(), h32.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad.float(), w32.grad, rtol=2e-2, atol=2e-2)
