"""ppo/algos/core_algos.py against naive per-element Python loops."""

from __future__ import annotations

import math

import pytest
import torch

from ppo.algos import core_algos as ca
from ppo.algos.policy_losses import compute_policy_loss


def _batch(b=5, t=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lens[:, None]).float()
    return g, mask


def _naive_gae(r, v, m, gamma, lam):
    b, t = len(r), len(r[0])
    adv = [[0.0] * t for _ in range(b)]
    for i in range(b):
        idx = [j for j in range(t) if m[i][j] > 0]  # the response tokens, padding skipped
        gae = 0.0
        for k in reversed(range(len(idx))):
            j = idx[k]
            nv = v[i][idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = r[i][j] + gamma * nv - v[i][j]
            gae = delta + gamma * lam * gae
            adv[i][j] = gae
    ret = [[(adv[i][j] + v[i][j]) * m[i][j] for j in range(t)] for i in range(b)]
    return adv, ret


def _naive_whiten(x, m):
    vals = [x[i][j] for i in range(len(x)) for j in range(len(x[0])) if m[i][j] > 0]
    mean = sum(vals) / len(vals)
    var = sum((a - mean) ** 2 for a in vals) / (len(vals) - 1)
    return [[(x[i][j] - mean) / math.sqrt(var + 1e-8) * m[i][j] for j in range(len(x[0]))] for i in range(len(x))]


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_naive_loop(gamma, lam):
    g, mask = _batch(6, 9, seed=1)
    # a hole in the middle of one response: masked tokens must be skipped, not treated as the end
    mask[0] = torch.tensor([1, 1, 0, 0, 1, 1, 1, 0, 0], dtype=torch.float32)
    r = torch.randn(mask.shape, generator=g)
    v = torch.randn(mask.shape, generator=g)
    adv, ret = ca.compute_gae(r, v, mask, gamma=gamma, lam=lam, whiten_advantages=False)
    na, nr = _naive_gae(r.tolist(), v.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(na), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, torch.tensor(nr), rtol=1e-5, atol=1e-5)
    adv_w, ret_w = ca.compute_gae(r, v, mask, gamma=gamma, lam=lam)
    torch.testing.assert_close(adv_w, torch.tensor(_naive_whiten(na, mask.tolist())), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ret_w, ret)


def test_gae_padding_values_do_not_leak():
    g, mask = _batch(4, 8, seed=2)
    r, v = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    v2 = torch.where(mask > 0, v, torch.full_like(v, 1e3))
    r2 = torch.where(mask > 0, r, torch.full_like(r, -7.0))
    a1, t1 = ca.compute_gae(r, v, mask, gamma=0.99, lam=0.9)
    a2, t2 = ca.compute_gae(r2, v2, mask, gamma=0.99, lam=0.9)
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(t1, t2)
    assert (a1[mask == 0] == 0).all()


def test_whiten_and_shift_mean():
    g, mask = _batch(5, 6, seed=3)
    x = torch.randn(mask.shape, generator=g) * 3 + 2
    w = ca.whiten(x, mask)
    torch.testing.assert_close(w * mask, torch.tensor(_naive_whiten(x.tolist(), mask.tolist())), rtol=1e-5, atol=1e-5)
    assert abs(ca.masked_mean(w, mask).item()) < 1e-5
    ws = ca.whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(ca.masked_mean(ws, mask), ca.masked_mean(x, mask), rtol=1e-5, atol=1e-5)


def _naive_agg(x, m, mode):
    b, t = len(x), len(x[0])
    if mode == "token-mean":
        n = sum(m[i][j] for i in range(b) for j in range(t))
        return sum(x[i][j] * m[i][j] for i in range(b) for j in range(t)) / n
    if mode == "seq-mean-token-sum":
        return sum(sum(x[i][j] * m[i][j] for j in range(t)) for i in range(b)) / b
    if mode == "seq-mean-token-mean":
        return sum(sum(x[i][j] * m[i][j] for j in range(t)) / max(sum(m[i]), 1) for i in range(b)) / b
    return sum(x[i][j] * m[i][j] for i in range(b) for j in range(t)) / t / b


@pytest.mark.parametrize("mode", ca.AGG_MODES)
def test_agg_loss_modes(mode):
    g, mask = _batch(5, 6, seed=4)
    x = torch.randn(mask.shape, generator=g)
    got = ca.agg_loss(x, mask, mode)
    assert got.item() == pytest.approx(_naive_agg(x.tolist(), mask.tolist(), mode), rel=1e-5)


@pytest.mark.parametrize("mode", ca.AGG_MODES)
def test_agg_loss_global_denominator_sums_over_micro_batches(mode):
    g, mask = _batch(6, 5, seed=5)
    x = torch.randn(mask.shape, generator=g)
    full = ca.agg_loss(x, mask, mode)
    denom = mask.sum().item() if mode == "token-mean" else 6
    parts = [ca.agg_loss(x[s], mask[s], mode, denom=denom, max_len=5) for s in (slice(0, 1), slice(1, 4), slice(4, 6))]
    torch.testing.assert_close(sum(parts), full)


def test_agg_loss_unknown_mode():
    with pytest.raises(ValueError, match="token-mean"):
        ca.agg_loss(torch.zeros(2, 2), torch.ones(2, 2), "mean")


def _naive_policy_loss(lp, olp, adv, m, cl, ch, c):
    losses, clipped_n, lower_n, n = [], 0, 0, 0
    for i in range(len(lp)):
        for j in range(len(lp[0])):
            if not m[i][j]:
                continue
            ratio = math.exp(lp[i][j] - olp[i][j])
            a = adv[i][j]
            l1, l2 = -a * ratio, -a * min(max(ratio, 1 - cl), 1 + ch)
            loss = max(l1, l2)
            clipped_n += l2 > l1
            if c is not None and a < 0:
                lower_n += loss > -a * c
                loss = min(loss, -a * c)
            losses.append(loss)
            n += 1
    return sum(losses) / n, clipped_n / n, lower_n / n


@pytest.mark.parametrize("cl,ch,c", [(0.2, 0.2, 3.0), (0.2, 0.28, None), (0.1, 0.3, 1.5)])
def test_policy_loss_matches_naive_loop(cl, ch, c):
    g, mask = _batch(6, 8, seed=6)
    old = -torch.rand(mask.shape, generator=g) * 3
    lp = old + torch.randn(mask.shape, generator=g) * 0.8  # ratios well outside the clip range
    adv = torch.randn(mask.shape, generator=g) * 2
    loss, met = ca.policy_loss(lp, old, adv, mask, clip_low=cl, clip_high=ch, dual_clip_c=c)
    nl, ncf, nlow = _naive_policy_loss(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), cl, ch, c)
    assert loss.item() == pytest.approx(nl, rel=1e-5)
    assert met["clipfrac"] == pytest.approx(ncf)
    assert met["clipfrac_lower"] == pytest.approx(nlow)
    assert 0 < met["clipfrac"] < 1
    assert met["approx_kl"] == pytest.approx(ca.masked_mean(old - lp, mask).item(), rel=1e-5)


def _naive_actor_loss(lp, olp, adv, ent, ref, m, s):
    """Per-sequence loops: seq-mean-token-mean of surrogate - c_e * entropy + c_kl * k3(pi || ref)."""
    total = 0.0
    for i in range(len(lp)):
        toks = []
        for j in range(len(lp[0])):
            if not m[i][j]:
                continue
            ratio = math.exp(lp[i][j] - olp[i][j])
            a = adv[i][j]
            pg = max(-a * ratio, -a * min(max(ratio, 1 - s.clip_low), 1 + s.clip_high))
            if a < 0:
                pg = min(pg, -a * s.dual_clip_c)
            d = lp[i][j] - ref[i][j]
            toks.append(pg - s.entropy_coef * ent[i][j] + s.kl_loss_coef * (math.exp(-d) - 1 + d))
        total += sum(toks) / len(toks)
    return total / len(lp)


def test_composed_policy_loss_matches_naive_loop():
    s = ca.PolicyLossSettings(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, agg="seq-mean-token-mean",
                              entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3")
    g, mask = _batch(5, 6, seed=21)
    old = -torch.rand(mask.shape, generator=g) * 3
    lp = (old + torch.randn(mask.shape, generator=g) * 0.5).requires_grad_()
    ref = old + torch.randn(mask.shape, generator=g) * 0.3
    adv, ent = torch.randn(mask.shape, generator=g), torch.rand(mask.shape, generator=g) * 2
    loss, met = compute_policy_loss(lp, old_logp=old, advantages=adv, mask=mask, settings=s, entropy=ent,
                                       ref_logp=ref)
    want = _naive_actor_loss(lp.tolist(), old.tolist(), adv.tolist(), ent.tolist(), ref.tolist(), mask.tolist(), s)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert met["entropy"] == pytest.approx(float((ent * mask).sum() / mask.sum()), rel=1e-5)
    assert met["pg_loss"] != pytest.approx(loss.item()) and "kl_loss" in met
    loss.backward()  # differentiable in logp only
    assert lp.grad is not None and torch.isfinite(lp.grad).all()


def test_composed_policy_loss_asks_for_what_it_needs():
    g, mask = _batch(3, 4, seed=22)
    lp, adv = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    plain = ca.PolicyLossSettings()
    assert not plain.needs_entropy and not plain.needs_ref
    loss, met = compute_policy_loss(lp, old_logp=lp, advantages=adv, mask=mask, settings=plain)
    assert loss.item() == pytest.approx(met["pg_loss"]) and "entropy" not in met and "kl_loss" not in met
    with pytest.raises(ValueError, match="entropy"):
        compute_policy_loss(lp, old_logp=lp, advantages=adv, mask=mask,
                               settings=ca.PolicyLossSettings(entropy_coef=0.1))
    with pytest.raises(ValueError, match="ref_logp"):
        compute_policy_loss(lp, old_logp=lp, advantages=adv, mask=mask,
                               settings=ca.PolicyLossSettings(use_kl_loss=True, kl_loss_coef=0.1))
    # an entropy passed without a coefficient is a metric only: the loss is unchanged
    with_ent, met = compute_policy_loss(lp, old_logp=lp, advantages=adv, mask=mask, settings=plain,
                                           entropy=torch.ones_like(lp))
    assert with_ent.item() == loss.item() and met["entropy"] == 1.0


def test_policy_loss_on_policy_gradient_is_minus_advantage():
    # ratio == 1: d loss / d logp = -A / N per token (the REINFORCE gradient), no clipping
    g, mask = _batch(4, 5, seed=7)
    lp = (-torch.rand(mask.shape, generator=g)).requires_grad_()
    adv = torch.randn(mask.shape, generator=g)
    loss, met = ca.policy_loss(lp, lp.detach(), adv, mask)
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv * mask / mask.sum())
    assert met["clipfrac"] == 0 and met["ratio_mean"] == pytest.approx(1.0)


def test_policy_loss_rejects_bad_dual_clip():
    with pytest.raises(ValueError, match="dual_clip_c"):
        ca.policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), dual_clip_c=0.5)


def test_value_loss_matches_naive_loop():
    g, mask = _batch(5, 6, seed=8)
    v, old, ret = (torch.randn(mask.shape, generator=g) for _ in range(3))
    loss, met = ca.value_loss(v, old, ret, mask, clip=0.2)
    tot, n, cf = 0.0, 0, 0
    for i in range(5):
        for j in range(6):
            if mask[i, j]:
                vc = old[i, j].item() + min(max(v[i, j].item() - old[i, j].item(), -0.2), 0.2)
                l1, l2 = (v[i, j].item() - ret[i, j].item()) ** 2, (vc - ret[i, j].item()) ** 2
                tot += max(l1, l2)
                cf += l2 > l1
                n += 1
    assert loss.item() == pytest.approx(0.5 * tot / n, rel=1e-5)
    assert met["vf_clipfrac"] == pytest.approx(cf / n)
    plain, _ = ca.value_loss(v, old, ret, mask, clip=None)
    assert plain.item() == pytest.approx(0.5 * ca.masked_mean((v - ret) ** 2, mask).item(), rel=1e-5)


def test_kl_estimators():
    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    for kind, f in {
        "k1": lambda a, b: a - b,
        "k2": lambda a, b: 0.5 * (a - b) ** 2,
        "k3": lambda a, b: math.exp(b - a) - 1 - (b - a),
        "low_var_kl": lambda a, b: math.exp(b - a) - 1 - (b - a),
    }.items():
        got = ca.kl_estimate(lp, ref, kind=kind)
        want = [f(a, b) for a, b in zip(lp[0].tolist(), ref[0].tolist())]
        torch.testing.assert_close(got[0], torch.tensor(want), msg=kind)
    assert ca.kl_estimate(torch.tensor([0.0]), torch.tensor([-50.0]), kind="low_var_kl").item() == 10.0
    with pytest.raises(ValueError, match="low_var_kl"):
        ca.kl_estimate(lp, ref, kind="k4")


def test_k3_is_unbiased_kl_on_samples():
    # E_{x~p}[k1] and E_{x~p}[k3] both equal KL(p||q) for a categorical
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g), 0)
    q = torch.softmax(torch.randn(6, generator=g), 0)
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    true = (p * (p / q).log()).sum().item()
    for kind in ("k1", "k3"):
        est = ca.kl_estimate(p.log()[x], q.log()[x], kind=kind).mean().item()
        assert est == pytest.approx(true, abs=0.01), kind


def test_kl_controllers_and_state_dict():
    fixed = ca.FixedKLController(0.1)
    fixed.update(5.0, 10)
    assert fixed.value == 0.1
    ada = ca.AdaptiveKLController(0.2, target_kl=1.0, horizon=100)
    value = 0.2
    for kl in (3.0, 1.1, 0.5, 0.0):  # naive Ziegler update
        ada.update(kl, 10)
        value *= 1 + min(max(kl / 1.0 - 1, -0.2), 0.2) * 10 / 100
        assert ada.value == pytest.approx(value)
    other = ca.AdaptiveKLController(1.0, target_kl=2.0, horizon=5)
    other.load_state_dict(ada.state_dict())
    assert (other.value, other.target, other.horizon) == (ada.value, 1.0, 100)
    with pytest.raises(ValueError, match="target_kl"):
        ca.AdaptiveKLController(0.1, target_kl=0, horizon=10)


def test_apply_kl_penalty():
    g, mask = _batch(4, 5, seed=9)
    r = ca.scores_to_token_rewards(torch.tensor([1.0, 0.0, 2.0, -1.0]), mask)
    lp, ref = -torch.rand(mask.shape, generator=g), -torch.rand(mask.shape, generator=g)
    out, met = ca.apply_kl_penalty(r, lp, ref, mask, kl_coef=0.05, kind="k1")
    torch.testing.assert_close(out, r - 0.05 * (lp - ref) * mask)
    per_seq = [sum((lp[i, j] - ref[i, j]).item() for j in range(5) if mask[i, j]) / mask[i].sum().item()
               for i in range(4)]
    assert met["kl"] == pytest.approx(sum(per_seq) / 4, rel=1e-5)
    assert met["kl_coef"] == 0.05


def test_scores_to_token_rewards():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    out = ca.scores_to_token_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    want = torch.zeros(4, 4)
    want[0, 2], want[1, 0], want[3, 3] = 1.0, 2.0, 4.0
    torch.testing.assert_close(out, want)


def _groups():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 2.0, -1.0, 3.0])
    gids = ["a", "a", "a", "b", "b", "c", "c", "d"]  # "d" is a singleton
    return scores, gids


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_naive_loop(norm):
    scores, gids = _groups()
    _, mask = _batch(8, 4, seed=10)
    adv, ret = ca.compute_grpo_advantages(scores, gids, mask, norm_by_std=norm, eps=1e-6)
    want = []
    for i, gi in enumerate(gids):
        grp = [scores[j].item() for j in range(8) if gids[j] == gi]
        if len(grp) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(grp) / len(grp)
            std = math.sqrt(sum((s - mean) ** 2 for s in grp) / (len(grp) - 1))
        want.append((scores[i].item() - mean) / (std + 1e-6) if norm else scores[i].item() - mean)
    torch.testing.assert_close(adv, torch.tensor(want)[:, None] * mask)
    torch.testing.assert_close(ret, adv)
    # tensor group ids give the same answer as string ids
    tid = torch.tensor([ord(x) for x in gids])
    torch.testing.assert_close(ca.compute_grpo_advantages(scores, tid, mask, norm_by_std=norm)[0], adv)


def test_rloo_matches_naive_loop():
    scores, gids = _groups()
    mask = torch.ones(8, 3)
    adv, _ = ca.compute_rloo_advantages(scores, gids, mask)
    want = []
    for i, gi in enumerate(gids):
        others = [scores[j].item() for j in range(8) if gids[j] == gi and j != i]
        want.append(scores[i].item() - (sum(others) / len(others) if others else 0.0))
    torch.testing.assert_close(adv[:, 0], torch.tensor(want))


def test_reinforce_pp_matches_naive_loop():
    g, mask = _batch(5, 6, seed=11)
    r = ca.scores_to_token_rewards(torch.randn(5, generator=g), mask) + 0.1 * torch.randn(5, 6, generator=g) * mask
    adv, ret = ca.compute_reinforce_pp_advantages(r, mask, gamma=0.9)
    naive = [[0.0] * 6 for _ in range(5)]
    for i in range(5):
        for j in range(6):
            if mask[i, j]:
                naive[i][j] = sum(0.9 ** (k - j) * r[i, k].item() for k in range(j, 6) if mask[i, k])
    torch.testing.assert_close(ret, torch.tensor(naive), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(adv, torch.tensor(_naive_whiten(naive, mask.tolist())), rtol=1e-4, atol=1e-5)


def test_logprobs_from_logits():
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(2, 3, 11, generator=g)
    labels = torch.randint(0, 11, (2, 3), generator=g)
    lp = ca.logprobs_from_logits(logits, labels)
    for b in range(2):
        for t in range(3):
            p = torch.softmax(logits[b, t].double(), 0)
            assert lp[b, t].item() == pytest.approx(math.log(p[labels[b, t]].item()), rel=1e-5)


def test_loss_metrics_without_sync_are_tensors():
    g, mask = _batch(4, 5, seed=13)
    lp, old, adv = (torch.randn(mask.shape, generator=g) for _ in range(3))
    _, floats = ca.policy_loss(lp, old, adv, mask)
    _, tensors = ca.policy_loss(lp, old, adv, mask, sync_metrics=False)
    assert set(floats) == set(tensors)
    for k, v in tensors.items():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and v.item() == pytest.approx(floats[k])
    _, empty = ca.policy_loss(lp, old, adv, torch.zeros_like(mask))
    assert empty["ratio_min"] == empty["ratio_max"] == 1.0 and empty["clipfrac"] == 0.0
    _, vf = ca.value_loss(lp, old, adv, mask, sync_metrics=False)
    assert isinstance(vf["vf_clipfrac"], torch.Tensor)


@pytest.mark.gpu
def test_losses_on_cuda_match_cpu():
    g, mask = _batch(8, 16, seed=14)
    lp, old, adv, v, ov, ret = (torch.randn(mask.shape, generator=g) for _ in range(6))
    cpu_pg, cpu_m = ca.policy_loss(lp, old, adv, mask)
    gpu_pg, gpu_m = ca.policy_loss(lp.cuda(), old.cuda(), adv.cuda(), mask.cuda())
    assert gpu_pg.is_cuda and gpu_pg.item() == pytest.approx(cpu_pg.item(), rel=1e-5)
    assert gpu_m == pytest.approx(cpu_m, rel=1e-5)
    a_cpu, r_cpu = ca.compute_gae(ret, v, mask, gamma=0.99, lam=0.95)
    a_gpu, r_gpu = ca.compute_gae(ret.cuda(), v.cuda(), mask.cuda(), gamma=0.99, lam=0.95)
    torch.testing.assert_close(a_gpu.cpu(), a_cpu, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(r_gpu.cpu(), r_cpu, rtol=1e-4, atol=1e-5)
    grpo_gpu, _ = ca.compute_grpo_advantages(ret[:, 0].cuda(), torch.arange(8).cuda() // 2, mask.cuda())
    grpo_cpu, _ = ca.compute_grpo_advantages(ret[:, 0], torch.arange(8) // 2, mask)
    torch.testing.assert_close(grpo_gpu.cpu(), grpo_cpu)


def test_non_finite_padding_does_not_leak():
    # log-probs at padding can be -inf / NaN; nothing outside the mask may reach the loss or grads
    g, mask = _batch(4, 6, seed=15)
    mask[0, -1] = 0
    lp = (-torch.rand(mask.shape, generator=g)).masked_fill(mask == 0, float("nan")).requires_grad_()
    old = (-torch.rand(mask.shape, generator=g)).masked_fill(mask == 0, float("-inf"))
    adv = torch.randn(mask.shape, generator=g).masked_fill(mask == 0, float("inf"))
    loss, met = ca.policy_loss(lp, old, adv, mask)
    loss.backward()
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in met.values())
    assert torch.isfinite(lp.grad).all() and (lp.grad[mask == 0] == 0).all()
    assert torch.isfinite(ca.whiten(adv, mask)[mask > 0]).all()
    vl, _ = ca.value_loss(lp.detach(), old, adv, mask)
    assert torch.isfinite(vl)
