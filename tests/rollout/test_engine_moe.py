"""The native engine decoding a tiny Qwen3-MoE (fp32, CPU): behaviour log-probs equal the trainer's forward, and
each completion's recorded experts equal the trainer's router choice on the same tokens."""

import copy

import pytest
import torch

from models import build_model, preset_config
from models.moe import RouterTrace
from rollout import NativeEngine, SamplingParams
from tests.rollout.test_engine import PROMPTS, config, trainer_logprobs


@pytest.fixture(scope="module")
def moe_model():
    model = build_model(preset_config("tiny-qwen3-moe"), seed=0).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked distributions, as the dense engine tests
        for layer in model.config.moe_layers:  # routers with clear preferences (no near-ties)
            model.model.layers[str(layer)].mlp.gate.weight.mul_(30.0)
    return model


def trainer_experts(model, ids: list[int]) -> torch.Tensor:
    trace = RouterTrace(keep_choice=True)
    with torch.no_grad():
        model(torch.tensor([ids]), routing=trace)
    return torch.stack([trace.chosen[layer] for layer in model.config.moe_layers], dim=1)


@pytest.mark.parametrize("fuse", [True, False])
def test_moe_engine_logprobs_and_recorded_experts_equal_the_trainer(moe_model, fuse):
    params = [SamplingParams(temperature=1.0, max_tokens=n, seed=i, n=2 if i == 1 else 1, ignore_eos=True)
              for i, n in enumerate((9, 6, 4, 7, 5))]
    # a small cache: sequences queue, slots are compacted, decode is pipelined (as in the dense tests)
    engine = NativeEngine.from_model(moe_model, config=config(fuse_projections=fuse, kv_cache_tokens=96 * 3,
                                                              max_num_seqs=3))
    outs = engine.generate(PROMPTS, params)
    assert len(outs) == 6
    cfg = moe_model.config
    for c in outs:
        ref = trainer_logprobs(moe_model, c.prompt_ids, c.token_ids, 1.0)
        assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= 1e-5
        ran = c.prompt_ids + c.token_ids[:-1]  # the last sampled token never ran
        assert c.routed_experts.shape == (len(ran), len(cfg.moe_layers), cfg.num_experts_per_tok)
        assert c.routed_experts.dtype == torch.int16
        assert torch.equal(c.routed_experts.sort(-1).values.int(), trainer_experts(moe_model, ran).sort(-1).values)


def test_dense_engine_records_no_experts():
    model = build_model(preset_config("tiny", num_hidden_layers=1), seed=0)
    out = NativeEngine.from_model(model, config=config()).generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert out[0].routed_experts is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("compile_", [False, True], ids=["graphs", "graphs+compile"])
def test_moe_bf16_cuda_graphs_record_experts_the_trainer_replays(moe_model, compile_):
    """The GPU decode path of a mixture of experts (bf16 grouped GEMMs inside CUDA graphs, the experts copied out
    of each graphed step): the records replay exactly in the trainer, whose own router mostly agrees."""
    from tests.rollout.test_engine_gpu import PARAMS, _trainer_logprobs
    from tests.rollout.test_engine_gpu import PROMPTS as GPU_PROMPTS
    from tests.rollout.test_engine_gpu import _config as gpu_config

    model = copy.deepcopy(moe_model).to("cuda", torch.bfloat16)
    engine = NativeEngine.from_model(model, config=gpu_config(compile=compile_))
    outs = engine.generate(GPU_PROMPTS, PARAMS)
    runner = engine.runner
    assert len(runner.graphs) > 0 and runner.graph_error is None
    assert getattr(runner._decode, "error", None) is None
    layers = model.config.moe_layers
    agree = total = 0
    for c in outs:
        ran = torch.tensor([c.prompt_ids + c.token_ids[:-1]], device="cuda")
        rec = c.routed_experts.to("cuda")
        replay = RouterTrace(recorded={layer: rec[:, j] for j, layer in enumerate(layers)}, replay=True,
                             keep_choice=True)
        with torch.no_grad():
            model(ran, routing=replay)
        for j, layer in enumerate(layers):
            assert torch.equal(replay.chosen[layer], rec[:, j].int())
        agree += int(replay.compared) - int(replay.mismatched)
        total += int(replay.compared)
        assert (_trainer_logprobs(model, c, PARAMS[c.prompt_index].temperature)
                - torch.tensor(c.logprobs)).abs().max() < 0.25  # bf16, as the dense engine's GPU test
    assert agree / total >= 0.9, f"trainer's own router agreed on {agree}/{total} routings"


def test_moe_kept_kv_turn_records_the_experts_of_its_whole_context(moe_model):
    # a second turn continued from kept KV: its record covers the earlier turn's tokens (kept) and the new ones
    engine = NativeEngine.from_model(moe_model, config=config())
    p = SamplingParams(temperature=1.0, max_tokens=5, seed=3, ignore_eos=True)
    engine.add_request(PROMPTS[0], p, sessions=["s"])
    (first,) = [c for _ in range(20) for c in engine.step()]
    ctx = PROMPTS[0] + first.token_ids + [7, 8]
    engine.add_request(ctx, p, sessions=["s"])
    (second,) = [c for _ in range(20) for c in engine.step()]
    engine.release_session("s")
    assert engine.stats["kv_reused_tokens"] == len(PROMPTS[0]) + 4
    ran = ctx + second.token_ids[:-1]
    assert torch.equal(second.routed_experts.sort(-1).values.int(), trainer_experts(moe_model, ran).sort(-1).values)
    ref = trainer_logprobs(moe_model, ctx, second.token_ids, 1.0)
    assert (ref - torch.tensor(second.logprobs)).abs().max().item() <= 1e-5
