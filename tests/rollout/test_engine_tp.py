"""TP=2 decoding in a real gloo world equals TP=1: same greedy and seeded-sampled tokens, log-probs <= 1e-5."""

import pytest
import torch

from models import build_model, preset_config
from parallel.sharding import tp_slices
from rollout import NativeEngine, RolloutConfig, SamplingParams

PROMPTS = [[1, 17, 33, 9, 250], [1, 4], [1, 100, 200, 300, 400, 500, 7, 8, 9]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=1.0, max_tokens=10, n=2, seed=7, ignore_eos=True),
          SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=9, seed=3, ignore_eos=True)]


def _model():
    model = build_model(preset_config("tiny"), seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked distributions, so sampling is not near-uniform
    return model


def _config():
    return RolloutConfig(max_model_len=64, kv_cache_tokens=64 * 4, max_num_seqs=4, max_num_batched_tokens=32)


def _tp_body(rank, world_size):
    import torch.distributed as dist

    model = _model()
    engine = NativeEngine(model.config, config=_config(), tp_group=dist.group.WORLD)
    engine.update_weights((n, t[tp_slices(n, tuple(t.shape), rank=rank, world=world_size)])
                          for n, t in model.state_dict().items())
    outs = engine.generate(PROMPTS, PARAMS)
    return [(c.token_ids, c.logprobs) for c in outs]


@pytest.mark.distributed
def test_tp2_equals_tp1():
    from tests.dist_utils import run_world

    torch.set_num_threads(1)
    ref = NativeEngine.from_model(_model(), config=_config()).generate(PROMPTS, PARAMS)
    results = run_world(_tp_body, 2)
    assert results[0] == results[1], "TP ranks disagree"
    for c, (tokens, logprobs) in zip(ref, results[0]):
        assert tokens == c.token_ids
        assert max(abs(a - b) for a, b in zip(logprobs, c.logprobs)) <= 1e-5
