"""HFEngine (the benchmark baseline) agrees with NativeEngine on greedy decoding and log-probs."""

import pytest
import torch

from bench.hf_engine import HFEngine
from models import build_model, preset_config
from rollout import NativeEngine, RolloutConfig, SamplingParams

PROMPTS = [[1, 17, 33, 9, 250], [1, 4], [1, 100, 200, 300, 400, 500, 7]]


@pytest.fixture(scope="module")
def model():
    m = build_model(preset_config("tiny"), seed=3)
    with torch.no_grad():
        m.lm_head.weight.mul_(20.0)
    return m


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_hf_greedy_matches_native(model, cache):
    p = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    native = NativeEngine.from_model(model, config=RolloutConfig(max_model_len=64, kv_cache_tokens=256,
                                                                 max_num_seqs=4)).generate(PROMPTS, p)
    hf = HFEngine.from_model(model, cache_implementation=cache).generate(PROMPTS, p)
    for a, b in zip(native, hf):
        assert a.token_ids == b.token_ids and b.finish_reason == "length"
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_hf_sampling_stop_and_errors(model):
    engine = HFEngine.from_model(model)
    free = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    stop = free.token_ids[3]
    outs = engine.generate([PROMPTS[0], [], PROMPTS[1]],
                           [SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop]),
                            SamplingParams(), SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=0,
                                                             ignore_eos=True)])
    assert outs[0].finish_reason == "stop" and outs[0].token_ids[-1] == stop
    assert outs[0].token_ids == free.token_ids[: free.token_ids.index(stop) + 1]
    assert outs[1].finish_reason == "error"
    assert [c.sample_index for c in outs[2:]] == [0, 1, 2] and all(len(c.token_ids) == 6 for c in outs[2:])
