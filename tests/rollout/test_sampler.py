"""rollout/sampler.py against exact distributions and naive definitions."""

import torch

from rollout.sampler import request_key, sample, uniform_from_counter


def _rows(b, **kw):
    base = dict(temperature=torch.ones(b), top_k=torch.full((b,), -1), top_p=torch.ones(b),
                keys=torch.arange(b) * 7919 + 13, positions=torch.arange(b) % 5)
    base.update(kw)
    return base


def test_uniforms_are_uniform_deterministic_and_keyed():
    keys = torch.arange(200_000)
    u = uniform_from_counter(keys, torch.zeros_like(keys))
    assert ((u > 0) & (u < 1)).all()
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    hist = torch.histc(u, bins=20, min=0, max=1) / u.numel()
    assert (hist - 0.05).abs().max() < 0.003
    assert torch.equal(u, uniform_from_counter(keys, torch.zeros_like(keys)))
    v = uniform_from_counter(keys, torch.ones_like(keys))  # next position: independent-looking stream
    assert abs(torch.corrcoef(torch.stack([u, v]))[0, 1].item()) < 0.01
    big = torch.tensor([request_key(s, i) for s in range(3) for i in range(3)])
    assert len(set(big.tolist())) == 9 and (big >= 0).all()


def test_logprob_is_unfiltered_tempered_softmax():
    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 3
    temp = torch.linspace(0.0, 2.0, 64)
    kw = _rows(64, temperature=temp, top_k=torch.full((64,), 5), top_p=torch.full((64,), 0.7))
    tok, lp = sample(logits, **kw)
    t = torch.where(temp > 0, temp, torch.ones_like(temp))
    ref = torch.log_softmax(logits / t[:, None], -1).gather(1, tok[:, None])[:, 0]
    assert torch.allclose(lp, ref, atol=1e-6)
    assert tok[0] == logits[0].argmax()  # temperature 0 -> greedy


def test_top_k_one_is_greedy_and_top_k_bounds_support():
    torch.manual_seed(1)
    logits = torch.randn(512, 40)
    tok, _ = sample(logits, **_rows(512, top_k=torch.ones(512, dtype=torch.long)))
    assert torch.equal(tok, logits.argmax(-1))
    tok, _ = sample(logits, **_rows(512, top_k=torch.full((512,), 3)))
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == tok[:, None]).any(-1).all()


def _empirical(probs_row, n, **kw):
    logits = probs_row.log().expand(n, -1).contiguous()
    tok, _ = sample(logits, **_rows(n, keys=torch.arange(n) + 1000, positions=torch.zeros(n, dtype=torch.long),
                                    **kw))
    return torch.bincount(tok, minlength=probs_row.numel()).float() / n


def test_sampling_matches_distribution_unfiltered_and_filtered():
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    n = 40_000
    tol = 4 * (0.25 / n) ** 0.5  # 4 sigma
    for filtered in (False, True):
        freq = _empirical(p, n, filtered=filtered)
        assert (freq - p).abs().max() < tol, (filtered, freq)
    # top_p=0.7 keeps {0.4, 0.25, 0.15} (mass before 0.15 is 0.65 < 0.7), renormalised
    freq = _empirical(p, n, top_p=torch.full((n,), 0.7))
    ref = torch.tensor([0.4, 0.25, 0.15, 0, 0, 0]) / 0.8
    assert (freq - ref).abs().max() < tol and freq[3:].sum() == 0
    # top_k=4 then top_p=0.9 of the renormalised 4: [0.4,.25,.15,.1]/.9 -> cum before .1 is .889 < .9: keep 4
    freq = _empirical(p, n, top_k=torch.full((n,), 4), top_p=torch.full((n,), 0.9))
    assert (freq - torch.tensor([0.4, 0.25, 0.15, 0.1, 0, 0]) / 0.9).abs().max() < tol
    # temperature 0.5 squares and renormalises the probabilities
    freq = _empirical(p, n, temperature=torch.full((n,), 0.5))
    assert (freq - p**2 / (p**2).sum()).abs().max() < tol


def test_rows_independent_of_batch():
    torch.manual_seed(2)
    logits = torch.randn(16, 100)
    kw = _rows(16, top_p=torch.full((16,), 0.9))
    tok, lp = sample(logits, **kw)
    tok5, lp5 = sample(logits[5:6], **{k: v[5:6] for k, v in kw.items()})
    assert tok5.item() == tok[5].item() and lp5.item() == lp[5].item()
