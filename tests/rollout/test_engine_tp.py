"""TP=2 decoding in a real gloo world equals TP=1: same greedy and seeded-sampled tokens, log-probs <= 1e-5.

Three models in one world: the tiny Llama (GQA), a Qwen2-style variant (q/k/v biases, tied embeddings) and
a Qwen3-style one (per-head q/k norms, replicated; head_dim != hidden / heads; tied embeddings).
"""

import pytest
import torch

from models import build_model, preset_config
from parallel.sharding import tp_slices
from rollout import NativeEngine, RolloutConfig, SamplingParams

PROMPTS = [[1, 17, 33, 9, 250], [1, 4], [1, 100, 200, 300, 400, 500, 7, 8, 9]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=1.0, max_tokens=10, n=2, seed=7, ignore_eos=True),
          SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=9, seed=3, ignore_eos=True)]
VARIANTS = ("llama", "qwen2", "qwen3")


def _model(variant):
    if variant == "qwen3":
        from tests.rollout.test_engine_qwen3 import qwen3_model

        return qwen3_model(tied=True, seed=11)
    cfg = preset_config("tiny") if variant == "llama" else preset_config(
        "tiny", model_type="qwen2", attention_bias=True, tie_word_embeddings=True)
    model = build_model(cfg, seed=11)
    gen = torch.Generator().manual_seed(5)  # explicit: every process must build identical weights
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        # peaked distributions, so sampling is not near-uniform (tied: through the embedding)
        (model.model.embed_tokens if cfg.tie_word_embeddings else model.lm_head).weight.mul_(20.0)
    return model


def _config():
    return RolloutConfig(max_model_len=64, kv_cache_tokens=64 * 4, max_num_seqs=4, max_num_batched_tokens=32)


def _tp_body(rank, world_size):
    import torch.distributed as dist

    out = []
    for variant in VARIANTS:
        model = _model(variant)
        engine = NativeEngine(model.config, config=_config(), tp_group=dist.group.WORLD)
        engine.update_weights((n, t[tp_slices(n, tuple(t.shape), rank=rank, world=world_size)])
                              for n, t in model.state_dict().items())
        out.append([(c.token_ids, c.logprobs) for c in engine.generate(PROMPTS, PARAMS)])
    return out


@pytest.mark.distributed
def test_tp2_equals_tp1():
    from tests.dist_utils import run_world

    torch.set_num_threads(1)
    results = run_world(_tp_body, 2)
    assert results[0] == results[1], "TP ranks disagree"
    for variant, tp2 in zip(VARIANTS, results[0]):
        ref = NativeEngine.from_model(_model(variant), config=_config()).generate(PROMPTS, PARAMS)
        for c, (tokens, logprobs) in zip(ref, tp2):
            assert tokens == c.token_ids, variant
            assert max(abs(a - b) for a, b in zip(logprobs, c.logprobs)) <= 1e-5, variant


def _tp_nccl_body(rank, world_size, compile_):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    group = dist.new_group(backend="nccl")  # the world is gloo; decoding runs over NCCL on the GPUs
    model = _model("llama")
    config = _config()
    config.compile = compile_
    engine = NativeEngine(model.config, config=config, tp_group=group, device=f"cuda:{rank}")
    engine.update_weights((n, t[tp_slices(n, tuple(t.shape), rank=rank, world=world_size)])
                          for n, t in model.state_dict().items())
    outs = [(c.token_ids, c.logprobs) for c in engine.generate(PROMPTS, PARAMS)]
    runner = engine.runner
    return outs, len(runner.graphs), runner.graph_error, getattr(runner._decode, "error", None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("compile_", [False, True], ids=["graphs", "graphs+compile"])
def test_tp2_over_nccl_with_cuda_graphs_equals_tp1(compile_):
    """The GPU path of TP decoding: all-reduce / all-gather on NCCL inside captured CUDA graphs."""
    from tests.dist_utils import run_world

    results = run_world(_tp_nccl_body, 2, args=(compile_,), timeout=600)
    (outs, graphs, graph_error, compile_error), other = results[0], results[1]
    assert outs == other[0], "TP ranks disagree"
    assert graphs > 0 and graph_error is None and compile_error is None, (graphs, graph_error, compile_error)
    ref = NativeEngine.from_model(_model("llama").cuda(), config=_config()).generate(PROMPTS, PARAMS)
    for c, (tokens, logprobs) in zip(ref, outs):
        assert tokens == c.token_ids
        assert max(abs(a - b) for a, b in zip(logprobs, c.logprobs)) <= 1e-4
