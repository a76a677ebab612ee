"""GPU-only checks of the native engine: CUDA graphs change nothing but speed.

    pytest -m gpu tests/rollout/test_engine_gpu.py
"""

import pytest
import torch
from torch.nn.attention import SDPBackend

from models import build_model, preset_config
from rollout import NativeEngine, RolloutConfig, SamplingParams, kv_cache

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 17, 33, 9, 250], [1, 4], [1, 100, 200, 300, 400, 500, 7, 8, 9], [3] * 40, [1, 2, 3]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
          SamplingParams(temperature=1.0, max_tokens=25, n=3, seed=1, ignore_eos=True),
          SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=20, seed=2, ignore_eos=True),
          SamplingParams(temperature=1.0, max_tokens=33, seed=3, stop_token_ids=[7, 8, 9]),
          SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)]


def _model(dtype):
    model = build_model(preset_config("tiny"), seed=0, device="cuda", dtype=dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def _config(**kw):
    return RolloutConfig(**{**dict(max_model_len=128, kv_cache_tokens=128 * 8, max_num_seqs=8, block_size=16), **kw})


def _trainer_logprobs(model, c, temperature):
    ids = torch.tensor([c.prompt_ids + c.token_ids], device="cuda")
    with torch.no_grad():
        logits = model(ids)[0, len(c.prompt_ids) - 1: -1].float()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, -1).gather(1, torch.tensor(c.token_ids, device="cuda")[:, None])[:, 0]
    return lp.cpu()


# torch.compile on GPU is checked by bench/generate.py (sdpa+compile vs the trainer forward): compiling
# here would eat the GPU test budget
@pytest.mark.parametrize("variant", [dict(decode_attention=k) for k in ("triton", "sdpa", "bmm", "auto")])
def test_graphs_match_eager_fp32(variant):
    model = _model(torch.float32)
    eager = NativeEngine.from_model(model, config=_config(enable_cuda_graph=False, **variant)).generate(PROMPTS, PARAMS)
    engine = NativeEngine.from_model(model, config=_config(**variant))
    graphed = engine.generate(PROMPTS, PARAMS)
    assert len(engine.runner.graphs) > 0
    for a, b in zip(eager, graphed):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        p = PARAMS[a.prompt_index]
        assert (_trainer_logprobs(model, b, p.temperature) - torch.tensor(b.logprobs)).abs().max() < 1e-4


def test_bf16_logprobs_close_to_trainer_and_sleep_frees_memory():
    model = _model(torch.bfloat16)
    engine = NativeEngine(model.config, config=_config(), device="cuda", dtype=torch.bfloat16)
    engine.update_weights(model.state_dict().items())
    outs = engine.generate(PROMPTS, PARAMS)
    for c in outs:
        diff = (_trainer_logprobs(model, c, PARAMS[c.prompt_index].temperature) - torch.tensor(c.logprobs)).abs()
        assert diff.max() < 0.25  # bf16 logits of a peaked model: different kernels round differently
    before = torch.cuda.memory_allocated()
    engine.sleep()
    freed = before - torch.cuda.memory_allocated()
    cache_bytes = 128 * 8 * 2 * 4 * 2 * 16 * 2  # tokens x (k, v) x layers x kv heads x head_dim x bf16
    assert freed >= cache_bytes
    engine.wake_up()
    engine.update_weights(model.state_dict().items())
    again = engine.generate(PROMPTS, PARAMS)
    assert [c.token_ids for c in again] == [c.token_ids for c in outs]


def test_resident_sleep_keeps_graphs_across_weight_updates():
    model = _model(torch.float32)
    engine = NativeEngine(model.config, config=_config(free_memory_on_sleep=False, decode_attention="triton"),
                          device="cuda", dtype=torch.float32)
    engine.update_weights(model.state_dict().items())
    first = engine.generate(PROMPTS, PARAMS)
    graphs = dict(engine.runner.graphs)
    assert graphs
    engine.sleep()
    engine.wake_up()
    engine.update_weights(model.state_dict().items())
    again = engine.generate(PROMPTS, PARAMS)
    assert all(engine.runner.graphs[k] is g for k, g in graphs.items())  # replayed, not re-captured
    assert [c.token_ids for c in again] == [c.token_ids for c in first]


@pytest.mark.parametrize("kernel,compile", [("triton", False), ("sdpa", False), ("triton", True)])
def test_kept_kv_turns_on_cuda_graphs_equal_the_trainer_fp32(kernel, compile):
    # three turns per prompt, kept KV (sessions), others decoding while a session is parked (padding rows of the
    # graphed decode write its slot's position 0, restored before its next turn): every turn's log-probs equal
    # the trainer's over the whole context, and only the new tokens were prefilled
    from tests.rollout.test_kept_kv import OBS, run_turns

    model = _model(torch.float32)
    engine = NativeEngine.from_model(model, config=_config(decode_attention=kernel, compile=compile))
    out = []
    run_turns(engine, PROMPTS[:4], keep=True, completions=out)
    assert len(out) == 12 and engine.stats["kv_misses"] == 0 and len(engine.runner.graphs) > 0
    conts = engine.runner.continuations  # the returning waves replayed captured graphs (continuation_graphs.py)
    assert conts.error is None and len(conts.graphs) > 0, conts.error
    assert conts.replays == engine.stats["prefill_continue_waves"] > 0  # every wave replayed a graph
    if compile:  # the graphs captured the compiled trunk
        assert engine.runner._continue_trunk.error is None
    later = sum(len(OBS[(i + t) % len(OBS)]) + 1 for i in range(4) for t in (1, 2))
    assert engine.stats["prefill_tokens"] == sum(map(len, PROMPTS[:4])) + later
    assert max((torch.tensor(c.logprobs) - _trainer_logprobs(model, c, 1.0)).abs().max().item() for c in out) < 1e-4


def test_fresh_rows_in_waves_replay_graphs_and_equal_the_trainer_fp32():
    # RolloutConfig.fresh_rows_in_waves: the first turns run in the continuation forward from position 0, replayed as
    # CUDA graphs of their bucket beside the returning turns; every log-prob still equals the trainer's
    from tests.rollout.test_kept_kv import run_turns

    model = _model(torch.float32)
    engine = NativeEngine.from_model(model, config=_config(fresh_rows_in_waves=True, min_admit_fraction=0.0))
    out = []
    run_turns(engine, PROMPTS[:4], keep=True, completions=out)
    conts = engine.runner.continuations
    assert len(out) == 12 and engine.stats["prefill_fresh_rows"] == 0 and engine.stats["kv_misses"] == 0
    assert conts.error is None and len(conts.graphs) > 0, conts.error
    assert max((torch.tensor(c.logprobs) - _trainer_logprobs(model, c, 1.0)).abs().max().item() for c in out) < 1e-4


def test_park_slots_on_cuda_graphs_equal_the_trainer_fp32():
    # 5 trajectories through 2 decode slots and 3 park slots: parked KV copied out of the graphed decode rows and back
    # (stream-ordered behind the decode step in flight); every turn's log-probs equal the trainer's, nothing evicted
    from tests.rollout.test_kept_kv import run_turns

    model = _model(torch.float32)
    engine = NativeEngine.from_model(model, config=_config(max_num_seqs=2, max_parked_seqs=3, min_admit_fraction=0.0))
    out = []
    run_turns(engine, PROMPTS, keep=True, completions=out)
    assert len(out) == 15 and engine.stats["kv_relocations"] > 0
    assert engine.stats["kv_evictions"] == engine.stats["kv_misses"] == 0
    assert max((torch.tensor(c.logprobs) - _trainer_logprobs(model, c, 1.0)).abs().max().item() for c in out) < 1e-4


def test_kept_kv_prefills_run_prebuilt_sdpa_kernels_bf16(monkeypatch):
    # the prefills' attention (fresh: causal flash; continuations: masked memory-efficient) must be served by the
    # kernels built ahead of time: with cuDNN and the math path both off, SDPA raises "No available kernel" for a call
    # neither takes (a GQA flag on the masked call, an unaligned mask, ...). Log-probs still close to the trainer's
    from tests.rollout.test_kept_kv import run_turns

    monkeypatch.setattr(kv_cache, "PREFILL_SDPA_BACKENDS", (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION))
    model = _model(torch.bfloat16)
    engine = NativeEngine.from_model(model, config=_config())
    out = []
    run_turns(engine, PROMPTS[:4], keep=True, completions=out)
    assert len(out) == 12 and engine.stats["kv_misses"] == 0 and engine.stats["kv_reused_tokens"] > 0
    assert engine.runner.continuations.error is None and engine.runner.continuations.graphs
    assert max((torch.tensor(c.logprobs) - _trainer_logprobs(model, c, 1.0)).abs().max().item() for c in out) < 0.25
