"""The native engine's step API (rollout/base.py SteppingEngine): requests added while it runs, stepped,
aborted; generate() is a loop over it, so its outputs are the reference."""

import torch

from rollout import NativeEngine, SamplingParams
from tests.rollout.test_engine import PROMPTS, config, peaked_model, trainer_logprobs

MODEL = None


def model():
    global MODEL
    if MODEL is None:
        torch.manual_seed(0)
        MODEL = peaked_model()
    return MODEL


def params(seed, n=1, max_tokens=12):
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, n=n, seed=seed, ignore_eos=True)


def test_requests_added_while_running_match_generate():
    engine = NativeEngine.from_model(model(), config=config(max_num_seqs=4, min_admit_fraction=0.0))
    reference = engine.generate(PROMPTS, [params(i, n=2) for i in range(len(PROMPTS))])
    rids = {engine.add_request(PROMPTS[0], params(0, n=2)): 0}
    done, steps = {}, 0
    while engine.has_unfinished():
        if steps < len(PROMPTS) - 1:  # one more request every step while the others decode
            rids[engine.add_request(PROMPTS[steps + 1], params(steps + 1, n=2))] = steps + 1
        steps += 1
        for c in engine.step():
            done.setdefault(rids[c.prompt_index], []).append(c)
    assert sorted(done) == list(range(len(PROMPTS)))
    for ref in reference:
        got = done[ref.prompt_index][ref.sample_index]
        assert got.token_ids == ref.token_ids and got.finish_reason == "length"
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-5)


def test_a_request_is_reported_once_all_its_samples_finished():
    engine = NativeEngine.from_model(model(), config=config())
    rid = engine.add_request(PROMPTS[1], params(3, n=3))
    reports = []
    while engine.has_unfinished():
        reports.append(engine.step())
    assert [len(r) for r in reports if r] == [3]
    assert {c.prompt_index for c in reports[-1]} == {rid}


def test_abort_frees_the_slot_and_returns_the_tokens_so_far():
    engine = NativeEngine.from_model(model(), config=config(max_num_seqs=1, min_admit_fraction=0.0))
    long = engine.add_request(PROMPTS[0], params(1, max_tokens=60))
    waiting = engine.add_request(PROMPTS[2], params(2, max_tokens=5))
    for _ in range(6):
        assert engine.step() == []
    (partial,) = engine.abort(long)
    assert partial.finish_reason == "abort" and 4 <= len(partial.token_ids) < 60
    assert len(partial.logprobs) == len(partial.token_ids)
    torch.testing.assert_close(torch.tensor(partial.logprobs), trainer_logprobs(
        model(), PROMPTS[0], partial.token_ids, 1.0), atol=1e-5, rtol=0)
    assert engine.abort(long) == []  # already gone
    out = []
    while engine.has_unfinished():  # the freed slot serves the waiting request
        out += engine.step()
    assert [c.prompt_index for c in out] == [waiting] and len(out[0].token_ids) == 5
    # a continuation of the aborted sample: prompt + its tokens, which re-prefill
    (rest,) = engine.generate([PROMPTS[0] + partial.token_ids], params(9, max_tokens=3))
    torch.testing.assert_close(torch.tensor(rest.logprobs), trainer_logprobs(
        model(), PROMPTS[0] + partial.token_ids, rest.token_ids, 1.0), atol=1e-5, rtol=0)


def test_settle_leaves_no_step_in_flight_and_errors_come_back_from_step():
    engine = NativeEngine.from_model(model(), config=config())
    bad = engine.add_request([], params(0))
    good = engine.add_request(PROMPTS[1], params(4, max_tokens=8))
    first = engine.step()
    assert [(c.prompt_index, c.finish_reason) for c in first] == [(bad, "error")]
    for _ in range(3):
        engine.step()
    engine.settle()
    assert engine._pending is None
    out = []
    while engine.has_unfinished():
        out += engine.step()
    assert [c.prompt_index for c in out] == [good] and len(out[0].token_ids) == 8
    engine.sleep()  # idle: allowed
