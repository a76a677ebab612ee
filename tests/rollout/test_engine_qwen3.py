"""NativeEngine on a Qwen3-shaped model (per-head q/k RMSNorm before RoPE, head_dim != hidden / heads):
its log-probs equal the trainer's forward, greedy equals the naive loop, with fused and unfused
projections, on CPU and through the Triton decode kernel (which applies RoPE itself) interpreted."""

import pytest
import torch

from models import build_model, preset_config
from rollout import NativeEngine, SamplingParams
from tests.rollout.test_engine import PROMPTS, config, naive_greedy, trainer_logprobs


def qwen3_model(*, tied: bool = False, seed: int = 0, layers: int | None = None):
    """Tiny Qwen3: 4 heads x head_dim 32 over hidden 64, norms away from 1 (so a missed or misplaced q/k
    norm changes the answer), a scaled head for peaked distributions. layers: fewer than the preset's 4."""
    cfg = preset_config("tiny-qwen3", tie_word_embeddings=tied, **({} if layers is None else
                                                                    {"num_hidden_layers": layers}))
    model = build_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers.values():
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1.0 + 0.5 * torch.randn(norm.weight.shape, generator=gen))
        (model.model.embed_tokens if tied else model.lm_head).weight.mul_(20.0)
    return model


@pytest.mark.parametrize("tied,fuse", [(False, True), (True, True), (False, False)],
                         ids=["untied-fused", "tied-fused", "untied-unfused"])
def test_qwen3_engine_logprobs_equal_trainer(tied, fuse):
    model = qwen3_model(tied=tied)
    engine = NativeEngine.from_model(model, config=config(fuse_projections=fuse))
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = engine.generate(PROMPTS[:3], greedy)
    assert [c.token_ids for c in outs] == [naive_greedy(model, q, 10) for q in PROMPTS[:3]]
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, n=2, seed=5, ignore_eos=True)
    for c in engine.generate(PROMPTS, sampled):
        ref = trainer_logprobs(model, c.prompt_ids, c.token_ids, 0.9)
        assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= 1e-5


def test_qwen3_engine_without_qk_norm_would_differ():
    """The check above can fail: the same weights with the q/k norms dropped give other log-probs."""
    model = qwen3_model()
    plain = qwen3_model()
    for layer in plain.model.layers.values():
        layer.self_attn.q_norm = layer.self_attn.k_norm = None
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        assert (model(ids) - plain(ids)).abs().max() > 1e-2


def test_qwen3_triton_decode_applies_rope_after_the_qk_norm():
    """The Triton kernel rotates q and the new k itself; the model must hand it normed (un-rotated) q/k."""
    pytest.importorskip("triton")
    from tests.triton_interp import run_interpreted

    out = run_interpreted("""
        import torch
        from rollout import NativeEngine, SamplingParams
        from tests.rollout.test_engine import PROMPTS, config, naive_greedy, trainer_logprobs
        from tests.rollout.test_engine_qwen3 import qwen3_model
        model = qwen3_model(layers=2)  # the interpreter runs each layer's kernel programs in Python
        for fused in (True, False):
            engine = NativeEngine.from_model(model, config=config(decode_attention="triton", fuse_projections=fused))
            assert engine.runner._pick_kernel(2, 16) == "triton"
            greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            outs = engine.generate(PROMPTS[:2], greedy)
            assert [c.token_ids for c in outs] == [naive_greedy(model, q, 6) for q in PROMPTS[:2]]
            sampled = SamplingParams(temperature=1.0, max_tokens=6, seed=3, ignore_eos=True)
            for c in engine.generate(PROMPTS[:2], sampled):
                ref = trainer_logprobs(model, c.prompt_ids, c.token_ids, 1.0)
                assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= 1e-5, fused
        print("ok")
    """)
    assert "ok" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("compile_", [False, True], ids=["graphs", "graphs+compile"])
def test_qwen3_cuda_graphs_with_triton_decode_equal_trainer_fp32(compile_):
    """The GPU decode path of a qk-norm model: CUDA graphs, the fused q|k norm, the Triton kernel's RoPE,
    and Inductor's fusion of all three, against the trainer forward (fp32)."""
    from tests.rollout.test_engine_gpu import PARAMS, PROMPTS, _trainer_logprobs
    from tests.rollout.test_engine_gpu import _config as gpu_config

    model = qwen3_model().cuda()
    engine = NativeEngine.from_model(model, config=gpu_config(decode_attention="triton", compile=compile_))
    outs = engine.generate(PROMPTS, PARAMS)
    runner = engine.runner
    assert len(runner.graphs) > 0 and runner.graph_error is None
    assert getattr(runner._decode, "error", None) is None
    for c in outs:
        p = PARAMS[c.prompt_index]
        assert (_trainer_logprobs(model, c, p.temperature) - torch.tensor(c.logprobs)).abs().max() < 1e-4
