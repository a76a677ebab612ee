"""The fused log-prob kernels (models/triton_logprobs.py) against models/logprobs.py's torch path and a
float64 reference, run by Triton's CPU interpreter (TRITON_INTERPRET=1) in a child process (the variable
must be set before triton is imported, and must not leak into other tests)."""

import pytest

from tests.triton_interp import run_interpreted

pytest.importorskip("triton")


def test_kernels_are_as_exact_as_the_torch_path_forward_and_backward():
    out = run_interpreted("""
        import torch
        from models import logprobs, triton_logprobs
        assert triton_logprobs.available(torch.device("cpu"))
        torch.manual_seed(0)
        n, h, v, chunk = 23, 16, 77, 8  # tiles of 32: two whole and a partial one; a partial last chunk

        def float64_reference(hidden, weight, targets, temperature, g_lp, g_ent):
            hd, wd = (x.detach().double().requires_grad_() for x in (hidden, weight))
            logp_all = torch.log_softmax((hd @ wd.t()).to(weight.dtype).double() / temperature, -1)
            lp = logp_all.gather(1, targets[:, None])[:, 0]
            ent = -(logp_all.exp() * logp_all).sum(-1)
            loss = (lp * g_lp.double()).sum() + ((ent * g_ent.double()).sum() if g_ent is not None else 0)
            return (lp, ent, *torch.autograd.grad(loss, (hd, wd)))

        checked = 0
        for dtype in (torch.float32, torch.bfloat16):
            for temperature in (1.0, 0.7):
                for with_entropy in (False, True):
                    hidden = (torch.randn(n, h) * 2).to(dtype).requires_grad_()  # logits up to ~60
                    weight = torch.randn(v, h).to(dtype).requires_grad_()
                    targets = torch.randint(0, v, (n,))
                    targets[0], targets[1] = 0, v - 1  # the first and last vocab ids
                    g_lp, g_ent = torch.randn(n), torch.randn(n) if with_entropy else None
                    results = []
                    for fused in (True, False):
                        lp, ent = logprobs.compute_token_logprobs(hidden, weight, targets, temperature=temperature,
                                                                  chunk_size=chunk, with_entropy=with_entropy,
                                                                  fused=fused)
                        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0)
                        results.append((lp, ent, *torch.autograd.grad(loss, (hidden, weight))))
                    ref = float64_reference(hidden, weight, targets, temperature, g_lp, g_ent)
                    for i, name in enumerate(("logp", "entropy", "grad_hidden", "grad_weight")):
                        if name == "entropy" and not with_entropy:
                            continue
                        fused_err, torch_err = ((r[i].double() - ref[i]).abs().max().item() for r in results)
                        assert results[0][i].dtype == results[1][i].dtype
                        # no less exact than the torch path (fp32 statistics over the same rounded logits;
                        # the gradients are rounded to the weight dtype by both)
                        bound = 1.5 * torch_err + (1e-6 if dtype == torch.float32 else 1e-2) * ref[i].abs().max()
                        assert fused_err <= bound, (dtype, temperature, with_entropy, name, fused_err, torch_err)
                    checked += 1
        print("checked", checked)
    """)
    assert "checked 8" in out


def test_stats_of_extreme_logits_and_shape_errors():
    run_interpreted("""
        import math, torch
        from models.triton_logprobs import logit_grad_, token_stats
        # one huge logit per row, a -1e4 floor elsewhere, and a vocab narrower than one tile
        z = torch.full((3, 40), -1e4)
        z[0, 5], z[1, 39], z[2, 0] = 80.0, 3.0, -2.0
        z[2, 1:] = -2.0  # row 2 uniform: entropy log(40)
        targets = torch.tensor([5, 0, 7])
        lp, lse, ent = token_stats(z, targets, 1.0, with_entropy=True)
        ref = torch.log_softmax(z, -1)
        torch.testing.assert_close(lp, ref[torch.arange(3), targets], atol=1e-4, rtol=0)
        torch.testing.assert_close(lse, torch.logsumexp(z, -1), atol=1e-4, rtol=0)
        torch.testing.assert_close(ent[2], torch.tensor(math.log(40)), atol=1e-5, rtol=0)
        assert abs(ent[0]) < 1e-5
        g = logit_grad_(z.clone(), targets, lse, torch.ones(3), 1.0)
        torch.testing.assert_close(g, torch.nn.functional.one_hot(targets, 40).float() - ref.exp(), atol=1e-6,
                                   rtol=0)
        # the gradient of a sum arrives as a stride-0 expand: every row reads its own (broadcast) value
        g = logit_grad_(z.clone(), targets, lse, torch.ones(()).expand(3), 1.0, entropy=ent,
                        g_entropy=torch.full((), 0.1).expand(3))
        want = logit_grad_(z.clone(), targets, lse, torch.ones(3), 1.0, entropy=ent, g_entropy=torch.full((3,), 0.1))
        assert torch.equal(g, want)
        for bad in (z.t(), z[:, None]):
            try:
                token_stats(bad, targets, 1.0, with_entropy=False)
            except ValueError as e:
                assert "unit stride" in str(e)
            else:
                raise AssertionError("a strided z was accepted")
        print("ok")
    """)


def test_kept_logits_give_the_recomputing_backward_bit_for_bit():
    # keep_logits: the backward reads the forward's logits instead of recomputing them; the same GEMM on the same
    # inputs, so every output and gradient is equal, across chunks (a partial last one) and with entropy
    run_interpreted("""
        import torch
        from models import logprobs
        torch.manual_seed(0)
        n, h, v = 23, 16, 77
        for dtype in (torch.float32, torch.bfloat16):
            hidden = torch.randn(n, h).to(dtype).requires_grad_()
            weight = torch.randn(v, h).to(dtype).requires_grad_()
            targets = torch.randint(0, v, (n,))
            g_lp, g_ent = torch.randn(n), torch.randn(n)
            results = []
            for keep in (True, False):
                lp, ent = logprobs.compute_token_logprobs(hidden, weight, targets, chunk_size=8, with_entropy=True,
                                                          fused=True, keep_logits=keep)
                results.append((lp, ent, *torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(),
                                                              (hidden, weight))))
            for a, b in zip(*results):
                assert torch.equal(a, b), dtype
        # the default keeps nothing off CUDA (nor without a backward to follow)
        assert not logprobs._logits_fit(hidden, weight)
        print("ok")
    """)
