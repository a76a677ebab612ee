"""The native engine applies LoRA adapters in its GEMMs (rollout/engine_lora.py): the base loaded once, then only
the adapters each update; its greedy tokens and log-probs equal the adapted model's forward (fp32, 1e-5), with
fused and folded projections or plain ones, and an adapter never loaded fails the generate."""

from __future__ import annotations

import pytest
import torch

from models.lora import LoRASpec, adapters_disabled, add_adapters, is_adapter_name
from rollout import NativeEngine, SamplingParams
from tests.rollout.test_engine import config, peaked_model, trainer_logprobs

PROMPTS = [[1, 17, 33, 9, 250], [1, 4], [1, 100, 200, 300, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _adapted(spec, seed):
    model = peaked_model(layers=2, scale=5.0)
    add_adapters(model, spec, seed=0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-zero B: the adapters change the policy
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def _check(engine, model):
    moved = 0.0
    for p, c in zip(PROMPTS, engine.generate(PROMPTS, GREEDY)):
        mine = torch.tensor(c.logprobs)
        torch.testing.assert_close(mine, trainer_logprobs(model, p, c.token_ids, 0.0), rtol=0, atol=1e-5)
        with torch.no_grad():
            logits = model(torch.tensor([p + c.token_ids]))[0, len(p) - 1:-1]
        assert logits.argmax(-1).tolist() == c.token_ids
        with adapters_disabled(model):
            moved = max(moved, (trainer_logprobs(model, p, c.token_ids, 0.0) - mine).abs().max().item())
    assert moved > 1e-2  # the adapters matter: the base would fail the comparison


@pytest.mark.parametrize("fuse", [True, False], ids=["fused-folded", "plain"])
@pytest.mark.parametrize("targets", [("all-linear",), ("q_proj", "v_proj", "down_proj", "lm_head")])
def test_engine_adapters_equal_the_adapted_model_across_updates(fuse, targets):
    spec = LoRASpec(rank=4, alpha=8.0, target_modules=targets)
    model = _adapted(spec, seed=1)
    engine = NativeEngine(model.config, config=config(fuse_projections=fuse, fold_norms=fuse,
                                                      drop_weights_on_sleep=False), lora=spec)
    state = dict(model.state_dict())
    engine.update_weights(state.items())  # base and adapters
    _check(engine, model)
    for update in range(2):  # then the adapters alone: the base stays in the engine across sleep
        engine.sleep()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if is_adapter_name(n):
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(10 + update)))
        engine.wake_up()
        assert engine.holds_weights()
        engine.update_weights((n, t) for n, t in model.state_dict().items() if is_adapter_name(n))
        _check(engine, model)


def test_an_adapter_that_never_arrives_fails_the_generate():
    spec = LoRASpec(rank=4, alpha=8.0)
    model = _adapted(spec, seed=1)
    engine = NativeEngine(model.config, config=config(), lora=spec)
    engine.update_weights((n, t) for n, t in model.state_dict().items() if not is_adapter_name(n))
    with pytest.raises(RuntimeError, match="never loaded"):
        engine.generate(PROMPTS, GREEDY)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["triton", "sdpa"])
def test_adapter_updates_reach_the_captured_decode_graphs(kernel):
    """CUDA: the adapters' GEMMs run inside the captured decode; an update writes their static buffers in place, so
    the graphs captured before it (kept: free_memory_on_sleep=False) sample the new policy without a re-capture."""
    spec = LoRASpec(rank=4, alpha=8.0, target_modules=("all-linear", "lm_head"))
    model = _adapted(spec, seed=1).cuda()
    engine = NativeEngine(model.config, config=config(free_memory_on_sleep=False, decode_attention=kernel),
                          device="cuda", lora=spec)
    engine.update_weights(model.state_dict().items())
    _check_cuda(engine, model)
    graphs = dict(engine.runner.graphs)
    assert graphs and engine.runner.graph_error is None
    with torch.no_grad():
        for n, p in model.named_parameters():
            if is_adapter_name(n):
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)).cuda())
    engine.update_weights((n, t) for n, t in model.state_dict().items() if is_adapter_name(n))
    _check_cuda(engine, model)
    assert all(engine.runner.graphs.get(k) is g for k, g in graphs.items())  # replayed, not re-captured


def _check_cuda(engine, model):
    moved = 0.0
    for p, c in zip(PROMPTS, engine.generate(PROMPTS, GREEDY)):
        ids = torch.tensor([p + c.token_ids], device="cuda")
        with torch.no_grad():
            logp = torch.log_softmax(model(ids)[0, len(p) - 1:-1].float(), -1)
            with adapters_disabled(model):
                base = torch.log_softmax(model(ids)[0, len(p) - 1:-1].float(), -1)
        tokens = torch.tensor(c.token_ids, device="cuda")[:, None]
        mine = torch.tensor(c.logprobs)
        assert logp.argmax(-1).tolist() == c.token_ids
        torch.testing.assert_close(mine, logp.gather(1, tokens)[:, 0].cpu(), rtol=0, atol=1e-4)
        moved = max(moved, (base.gather(1, tokens)[:, 0].cpu() - mine).abs().max().item())
    assert moved > 1e-2


def test_a_kept_kv_turn_runs_the_adapters_too():
    # a continuation's prefill (only the new tokens, over the kept KV) goes through the same adapted GEMMs
    spec = LoRASpec(rank=4, alpha=8.0, target_modules=("all-linear",))
    model = _adapted(spec, seed=1)
    engine = NativeEngine(model.config, config=config(), lora=spec)
    engine.update_weights(model.state_dict().items())
    engine.add_request(PROMPTS[0], GREEDY, sessions=["s"])
    (first,) = [c for _ in range(12) for c in engine.step()]
    ctx = PROMPTS[0] + first.token_ids + [5, 6]
    engine.add_request(ctx, GREEDY, sessions=["s"])
    (second,) = [c for _ in range(12) for c in engine.step()]
    engine.release_session("s")
    assert engine.stats["kv_reused_tokens"] == len(PROMPTS[0]) + len(first.token_ids) - 1
    torch.testing.assert_close(torch.tensor(second.logprobs), trainer_logprobs(model, ctx, second.token_ids, 0.0),
                               rtol=0, atol=1e-5)
