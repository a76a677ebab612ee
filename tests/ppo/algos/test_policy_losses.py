"""ppo/algos/policy_losses.py: GSPO against a per-sequence loop (values over Python floats, gradients
through autograd); the policy objective composes the chosen loss with the rollout correction."""

from __future__ import annotations

import math

import pytest
import torch

from ppo.algos import core_algos as ca
from ppo.algos.core_algos import PolicyLossSettings
from ppo.algos.policy_losses import compute_policy_objective, gspo_policy_loss
from ppo.algos.rollout_correction import compute_rollout_correction


def _batch(seed=0, b=6, t=8):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([8, 3, 5, 1, 7, 4])[:b]
    mask = (torch.arange(t)[None] < lens[:, None]).float()
    old = -torch.rand(b, t, generator=g) * 3
    lp = old + torch.randn(b, t, generator=g) * 0.3
    adv = torch.randn(b, generator=g)[:, None].expand(b, t) * mask  # GRPO: one advantage per sequence
    return lp, old, adv, mask


def _naive_loss(lp, old, adv, mask, cl, ch, mode, c=None):
    """Per sequence: s_i = exp(mean_t(lp - old)); loss_it = max(-A s, -A clip(s)) (dual clip:
    min(that, -A c) where A < 0); then `mode`."""
    b, t = len(mask), len(mask[0])
    per_seq, tokens, clipped, n = [], [], 0, 0
    for i in range(b):
        idx = [j for j in range(t) if mask[i][j] > 0]
        s = math.exp(sum(lp[i][j] - old[i][j] for j in idx) / len(idx))
        losses = []
        for j in idx:
            a = adv[i][j]
            l1, l2 = -a * s, -a * min(max(s, 1 - cl), 1 + ch)
            loss = max(l1, l2)
            if c is not None and a < 0:
                loss = min(loss, -a * c)
            losses.append(loss)
            clipped += l2 > l1
            n += 1
        per_seq.append(losses)
        tokens += losses
    if mode == "seq-mean-token-mean":
        return sum(sum(x) / len(x) for x in per_seq) / b, clipped / n
    return sum(tokens) / len(tokens), clipped / n  # token-mean


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("cl,ch,c", [(3e-4, 4e-4, None), (0.05, 0.1, None), (0.05, 0.1, 1.01)])
def test_gspo_loss_matches_per_sequence_loop(mode, cl, ch, c):
    lp, old, adv, mask = _batch()
    loss, met = gspo_policy_loss(lp, old, adv, mask, clip_low=cl, clip_high=ch, dual_clip_c=c, agg=mode)
    want, clipfrac = _naive_loss(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), cl, ch, mode, c)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert met["clipfrac"] == pytest.approx(clipfrac)
    seq = [math.exp(sum(lp[i, j].item() - old[i, j].item() for j in range(8) if mask[i, j]) / mask[i].sum().item())
           for i in range(6)]
    assert met["ratio_mean"] == pytest.approx(sum(seq) / 6, rel=1e-5)
    assert met["ratio_max"] == pytest.approx(max(seq), rel=1e-5)
    assert met["ratio_min"] == pytest.approx(min(seq), rel=1e-5)


def test_gspo_gradient_equals_sequence_level_objective():
    """The per-token form has the gradient of the sequence-level objective (GSPO eq. 5/7)."""
    lp, old, adv, mask = _batch(seed=1)
    cl, ch = 0.02, 0.03
    x = lp.clone().requires_grad_()
    loss, met = gspo_policy_loss(x, old, adv, mask, clip_low=cl, clip_high=ch, agg="seq-mean-token-mean")
    loss.backward()
    y = lp.clone().requires_grad_()
    total = 0.0
    for i in range(6):  # naive: one scalar ratio per sequence, clipped as a whole
        on = mask[i] > 0
        s = (y[i][on] - old[i][on]).mean().exp()
        a = adv[i][on][0]
        total = total + torch.maximum(-a * s, -a * s.clamp(1 - cl, 1 + ch))
    (total / 6).backward()
    assert 0 < met["clipfrac"] < 1  # both clipped and unclipped sequences in the batch
    torch.testing.assert_close(x.grad, y.grad)


def test_gspo_on_policy_ratio_is_one_and_weights_apply():
    lp, _, adv, mask = _batch(seed=2)
    x = lp.clone().requires_grad_()
    w = torch.rand(mask.shape, generator=torch.Generator().manual_seed(4))
    loss, met = gspo_policy_loss(x, lp, adv, mask, agg="token-mean", token_weights=w)
    loss.backward()
    assert met["ratio_mean"] == pytest.approx(1.0) and met["clipfrac"] == 0
    torch.testing.assert_close(x.grad, -adv * w * mask / mask.sum())


def test_gspo_micro_batches_sum_to_full_batch():
    lp, old, adv, mask = _batch(seed=3)
    full, _ = gspo_policy_loss(lp, old, adv, mask, agg="seq-mean-token-sum-norm", max_len=8)
    parts = [gspo_policy_loss(lp[s, :w], old[s, :w], adv[s, :w], mask[s, :w], agg="seq-mean-token-sum-norm",
                              denom=6, max_len=8)[0] for s, w in ((slice(0, 2), 8), (slice(2, 6), 7))]
    torch.testing.assert_close(sum(parts), full)


@pytest.mark.parametrize("kind", ["vanilla", "gspo"])
@pytest.mark.parametrize("correction", ["none", "tis", "tis+seq_mask"])
def test_policy_objective_composes_loss_and_correction(kind, correction):
    lp, old, adv, mask = _batch(seed=5)
    rollout = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(6)) * 0.4
    cfg = PolicyLossSettings(kind=kind, clip_low=0.1, clip_high=0.2, dual_clip_c=3.0, agg="token-mean",
                           rollout_correction=correction, rollout_is_cap=1.5, rollout_mask_threshold=1.1)
    x = lp.clone().requires_grad_()
    loss, met = compute_policy_objective(x, old, adv, mask, cfg=cfg, rollout_logp=rollout)
    w, rc = compute_rollout_correction(old, rollout, mask, mode=correction, is_cap=1.5, seq_mask_threshold=1.1)
    fn = gspo_policy_loss if kind == "gspo" else ca.policy_loss
    want, want_m = fn(lp, old, adv, mask, clip_low=0.1, clip_high=0.2, dual_clip_c=3.0, agg="token-mean",
                      token_weights=None if correction == "none" else w)
    torch.testing.assert_close(loss, want)
    assert met == {**{f"rollout_corr/{k}": v for k, v in rc.items()}, **want_m}
    if correction != "none":  # the weights changed the loss
        plain, _ = fn(lp, old, adv, mask, clip_low=0.1, clip_high=0.2, dual_clip_c=3.0, agg="token-mean")
        assert abs(plain.item() - loss.item()) > 1e-4
    # without behaviour log-probs: no correction and no rollout_corr metrics
    bare, met2 = compute_policy_objective(lp, old, adv, mask, cfg=cfg)
    assert not any(k.startswith("rollout_corr/") for k in met2)
    with pytest.raises(ValueError, match="gspo"):
        compute_policy_objective(lp, old, adv, mask, cfg=PolicyLossSettings(kind="ppo"))


@pytest.mark.parametrize("mode", ca.AGG_MODES)
def test_agg_count_makes_micro_batch_losses_sum_to_the_full_batch(mode):
    lp, old, adv, mask = _batch(seed=7)
    cfg = PolicyLossSettings(agg=mode, max_len=8)
    full, _ = compute_policy_objective(lp, old, adv, mask, cfg=cfg)
    parts = [slice(0, 1), slice(1, 4), slice(4, 6)]
    denom = float(sum(ca.agg_count(mask[s], mode) for s in parts))
    total = sum(compute_policy_objective(lp[s], old[s], adv[s], mask[s], cfg=cfg, denom=denom)[0] for s in parts)
    torch.testing.assert_close(total, full)


@pytest.mark.gpu
def test_policy_objective_on_cuda_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (make test-gpu on the GPU machine)")
    lp, old, adv, mask = _batch(seed=8)
    rollout = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(9))
    for kind in ("vanilla", "gspo"):
        cfg = PolicyLossSettings(kind=kind, agg="seq-mean-token-sum-norm", max_len=8, rollout_correction="tis+seq_mask",
                               rollout_is_cap=1.5, rollout_mask_threshold=1.1)
        cpu, cpu_m = compute_policy_objective(lp, old, adv, mask, cfg=cfg, rollout_logp=rollout)
        gpu, gpu_m = compute_policy_objective(lp.cuda(), old.cuda(), adv.cuda(), mask.cuda(), cfg=cfg,
                                              rollout_logp=rollout.cuda())
        torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-5, atol=1e-6)
        for k, v in cpu_m.items():
            assert gpu_m[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
