"""ppo/batch/step_batch.py: the step's typed batch and its micro-batch rows, the reference's log-probs behind one
handle (host rows, a pending pass, rows left on the device), and the advantage stage that builds the batch."""

from __future__ import annotations

import pytest
import torch

from ppo.algos import core_algos as algos
from ppo.batch.experience import Experience, Sample
from ppo.batch.step_batch import DeviceRows, ReferenceLogprobs, StepBatch, compute_step_batch
from ppo.settings import AdvantageSettings


def _exp(lengths: list[int]) -> Experience:
    return Experience([Sample(uid=i, prompt_index=i // 2, prompt_ids=[1, 2], response_ids=[3] * n,
                              behaviour_logprobs=[-0.25] * n, finish_reason="stop") for i, n in enumerate(lengths)])


def _batch(exp: Experience) -> StepBatch:
    g = torch.Generator().manual_seed(0)
    mask = exp.response_mask()
    return StepBatch(mask=mask, scores=torch.randn(len(exp.samples), generator=g),
                     advantages=torch.randn(mask.shape, generator=g) * mask,
                     old_logp=-torch.rand(mask.shape, generator=g) * mask)


def test_a_batch_carries_only_its_fields_and_its_rows_are_a_batch_too():
    exp = _exp([3, 1, 2, 4])
    b = _batch(exp)
    assert list(b.tensors()) == ["mask", "scores", "advantages", "old_logp"]
    mb = [3, 0]
    rows = b.rows(mb, torch.device("cpu"))
    assert isinstance(rows, StepBatch) and rows.ref_logp is None and rows.values is None
    for name, value in rows.tensors().items():
        assert torch.equal(value, getattr(b, name)[mb]), name
    # the loss's view: cut to the micro-batch's longest response, contiguous
    part = StepBatch(mask=rows.mask, advantages=rows.advantages).narrow(2, torch.device("cpu"))
    assert list(part.tensors()) == ["mask", "advantages"]
    assert part.mask.shape == (2, 2) and part.advantages.is_contiguous()
    assert torch.equal(part.advantages, b.advantages[mb][:, :2])


def test_device_rows_are_taken_per_micro_batch_beside_the_host_rows():
    exp = _exp([3, 1, 2, 4])
    b = _batch(exp)
    ref = -torch.rand(b.mask.shape, generator=torch.Generator().manual_seed(1)) * b.mask
    # a scoring pass's outputs: micro-batches [0, 1] and [2, 3], each as wide as its longest response
    b.ref_logp = DeviceRows(exp, [([0, 1], ref[[0, 1], :3].clone()), ([2, 3], ref[[2, 3], :4].clone())])
    own = b.rows([2, 3], torch.device("cpu"))
    assert torch.equal(own.ref_logp, ref[[2, 3]])
    mixed = b.rows([1, 2], torch.device("cpu"))  # another plan: gathered and padded to its longest response
    assert mixed.ref_logp.shape == (2, 2) and torch.equal(mixed.ref_logp, ref[[1, 2], :2])
    assert torch.equal(mixed.old_logp, b.old_logp[[1, 2]])  # the host rows come along, full width
    with pytest.raises(RuntimeError, match="other ranks"):
        DeviceRows(exp, [([0, 1], ref[[0, 1], :3])]).take([2])


def test_reference_logprobs_one_handle_three_ways():
    rows = torch.randn(2, 3)
    computed = ReferenceLogprobs(rows)
    assert computed.host is rows and computed.get() is rows
    calls = []
    pending = ReferenceLogprobs(wait=lambda: calls.append(1) or rows)
    assert pending.host is None and calls == []  # nothing waits until get()
    assert pending.get() is rows and pending.get() is rows and calls == [1]  # the wait (a collective) runs once
    on_device = ReferenceLogprobs(DeviceRows(_exp([3, 3]), [([0, 1], rows)]))
    assert on_device.host is None and isinstance(on_device.get(), DeviceRows)  # the update reads them in place
    assert ReferenceLogprobs().get() is None and ReferenceLogprobs().host is None  # no reference


def test_the_reference_rows_drive_the_kl_metric_and_penalty():
    exp = _exp([3, 1, 2, 4])
    mask = exp.response_mask()
    g = torch.Generator().manual_seed(2)
    old, ref = (-torch.rand(mask.shape, generator=g) * mask for _ in range(2))
    merged = {"score": {i: torch.tensor(float(i % 2)) for i in range(4)},
              "old_logp": {s.uid: old[i, :len(s.response_ids)] for i, s in enumerate(exp.samples)},
              "values": {s.uid: torch.zeros(len(s.response_ids)) for s in exp.samples}}
    a = AdvantageSettings(name="ppo", use_kl_penalty=True)
    b, m, kl_seen = compute_step_batch(exp, merged, a=a, n=2, max_response_length=4, kl_coef=0.1,
                                       old_logp="recompute", ref_logp=ref)
    assert b.ref_logp is ref and torch.equal(b.old_logp, old)
    want = float(algos.masked_mean(algos.kl_estimate(old, ref, kind="k1"), mask.float()))
    assert m["actor/kl"] == pytest.approx(want) and kl_seen is not None and m["actor/kl_coef"] == 0.1
    assert b.values is not None and b.returns is not None and b.advantages.shape == mask.shape
    # without the reference's rows before the advantages (deferred): no KL metric, no penalty
    b, m, kl_seen = compute_step_batch(exp, merged, a=a, n=2, max_response_length=4, kl_coef=0.1,
                                       old_logp="recompute")
    assert b.ref_logp is None and "actor/kl" not in m and kl_seen is None
    assert m["rollout/logprob_diff_max"] >= 0 and b.rollout_logp is not None


def test_rollout_correction_metrics_split_by_the_tokens_version_gap():
    from ppo.batch.step_batch import staleness_split

    train = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    rollout = torch.tensor([[-1.0, -2.5, -3.0], [-2.0, -1.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    gaps = torch.tensor([[0.0, 1.0, 1.0], [0.0, 2.0, 0.0]])
    m = staleness_split(train, rollout, mask, gaps)
    assert {k.split("/")[1] for k in m} == {"staleness_0", "staleness_1", "staleness_2"}  # the padding's 0 is not one
    assert m["rollout_corr/staleness_0/logprob_diff_max"] == pytest.approx(1.0)  # tokens (0,0) and (1,0)
    assert m["rollout_corr/staleness_1/kl"] == pytest.approx((-0.5 + 0.0) / 2)  # mean(rollout - train)
    assert m["rollout_corr/staleness_2/ratio_mean"] == pytest.approx(1.0)
