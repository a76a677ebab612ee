"""rollout/folded_norms.py: the engine's layers with their norm weights folded into the projections, against the
unfolded engine, the trainer's forward, and (Triton's CPU interpreter) the kernels that apply the row scale."""

import pytest
import torch

from rollout import NativeEngine, SamplingParams
from rollout.folded_norms import FoldedDecoderLayer, rms_scale, scaled_silu_mul
from tests.rollout.test_engine import PROMPTS, config, naive_greedy, peaked_model, trainer_logprobs
from tests.triton_interp import run_interpreted


def test_engine_folds_each_norm_into_its_projections_once():
    model = peaked_model(seed=1)
    engine = NativeEngine.from_model(model, config=config())
    engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # no second fold
    layer, src = engine.runner.model.model.layers["0"], model.model.layers["0"]
    assert type(layer) is FoldedDecoderLayer
    gamma = src.input_layernorm.weight
    assert torch.equal(layer.self_attn.q_proj.weight, src.self_attn.q_proj.weight * gamma[None, :])
    gamma = src.post_attention_layernorm.weight
    assert torch.equal(layer.mlp.up_proj.weight, src.mlp.up_proj.weight * gamma[None, :])
    unfolded = NativeEngine.from_model(model, config=config(fold_norms=False)).runner.model.model.layers["0"]
    assert type(unfolded) is not FoldedDecoderLayer and torch.equal(unfolded.self_attn.q_proj.weight,
                                                                     src.self_attn.q_proj.weight)


def test_folded_engine_equals_trainer_logprobs_and_naive_greedy_after_an_update():
    engine = NativeEngine.from_model(peaked_model(seed=2), config=config())
    other = peaked_model(seed=3)
    engine.update_weights(other.state_dict().items())  # every projection re-folded with the new norms
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    assert [c.token_ids for c in engine.generate(PROMPTS, greedy)] == [naive_greedy(other, q, 10) for q in PROMPTS]
    for c in engine.generate(PROMPTS[:3], SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=5,
                                                          ignore_eos=True)):
        ref = trainer_logprobs(other, c.prompt_ids, c.token_ids, 1.0)
        assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= 1e-5


def test_a_norm_updated_without_its_projections_is_refused():
    model = peaked_model(seed=1)
    engine = NativeEngine(model.config, config=config())
    engine.update_weights(model.state_dict().items())
    engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2))  # folds
    engine.update_weights([("model.layers.1.input_layernorm.weight", model.model.layers["1"].input_layernorm.weight)])
    with pytest.raises(RuntimeError, match="input_layernorm.weight was updated without.*q_proj"):
        engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2))
    # with its projections it folds again, and the engine is the model's
    layer = {k: v for k, v in model.state_dict().items() if k.startswith("model.layers.1.")}
    engine.update_weights(layer.items())
    out = engine.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [c.token_ids for c in out] == [naive_greedy(model, q, 6) for q in PROMPTS[:2]]


def test_scaled_silu_mul_torch_path_is_the_unfolded_mlp_activation():
    torch.manual_seed(0)
    x, w, gamma = torch.randn(5, 16) * 3, torch.randn(2 * 24, 16), torch.rand(16) + 0.5
    normed = x * rms_scale(x, 1e-6) * gamma
    gate, up = (normed @ w.T).chunk(2, dim=-1)
    out = scaled_silu_mul(x @ (w * gamma).T, x, 1e-6)
    assert torch.allclose(out, torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_kernels_apply_the_row_scale_like_the_unfolded_inputs():
    # the decode kernel with norm_x (unshared and shared prompts) equals it over q/k/v scaled beforehand, and the
    # SiLU kernel equals its torch formula, both under Triton's interpreter
    run_interpreted("""
        import torch
        from rollout.folded_norms import rms_scale, scaled_silu_mul
        from rollout.triton_attention import attend
        torch.manual_seed(0)
        b, hkv, g, d, hid, slot_len = 4, 2, 2, 16, 40, 64
        x = torch.randn(b, hid) * 4
        r = rms_scale(x, 1e-5)  # [B, 1]
        q = torch.randn(b, hkv * g, 1, d)
        k, v = (torch.randn(b, hkv, 1, d) for _ in range(2))
        cos, sin = torch.randn(b, d), torch.randn(b, d)
        pos = torch.tensor([20, 21, 22, 5])
        base = torch.randn(2, 2, b, hkv, slot_len, d)
        base[:, :, 1, :, :20] = base[:, :, 0, :, :20]  # rows 0-2 share a 20-token prompt
        base[:, :, 2, :, :20] = base[:, :, 0, :, :20]
        prefix = (torch.tensor([20, 20, 20, 0], dtype=torch.int32), torch.tensor([0, 0, 0, -1], dtype=torch.int32),
                  torch.tensor([[0, 1, 2, -1], [-1, -1, -1, -1]], dtype=torch.int32),
                  torch.tensor([20, 0], dtype=torch.int32))
        config = dict(BLOCK_N=16, num_warps=4, num_stages=2)
        for shared in (None, prefix):
            want_cache, got_cache = base.clone(), base.clone()
            sc = r[:, :, None, None]
            want = attend(want_cache, 1, pos, q * sc, k * sc, v * sc, 64, cos, sin, shared, config=config)
            got = attend(got_cache, 1, pos, q, k, v, 64, cos, sin, shared, norm_x=x, eps=1e-5, config=config)
            assert (got - want).abs().max().item() < 1e-5, shared is not None
            assert (got_cache - want_cache).abs().max().item() < 1e-5
        gu = torch.randn(6, 2 * 1500)
        xs = torch.randn(6, hid)
        rr = rms_scale(xs, 1e-6)
        gate, up = gu.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate * rr) * (up * rr)
        assert (scaled_silu_mul(gu, xs, 1e-6) - ref).abs().max().item() < 1e-5
        print("ok")
    """)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu on the GPU machine)")
def test_bf16_folded_engine_agrees_with_the_trainer_as_closely_as_the_unfolded_one():
    # CUDA graphs, the Triton decode kernel (shared prompts: n = 4) and the SiLU kernel, in bf16
    model = peaked_model(seed=1, scale=4.0).to(device="cuda", dtype=torch.bfloat16)
    params = SamplingParams(temperature=1.0, max_tokens=24, n=4, seed=7, ignore_eos=True)
    diffs = {}
    for fold in (False, True):
        engine = NativeEngine.from_model(model, config=config(fold_norms=fold, decode_attention="triton",
                                                              max_model_len=128, kv_cache_tokens=128 * 16))
        outs = engine.generate(PROMPTS, params)
        diffs[fold] = max((trainer_logprobs(model, c.prompt_ids, c.token_ids, 1.0)
                           - torch.tensor(c.logprobs)).abs().max().item() for c in outs)
        assert len(engine.runner.graphs) > 0
    assert diffs[True] <= max(1.5 * diffs[False], 0.05), diffs
