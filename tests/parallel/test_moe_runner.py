"""Routing replay through the runner: with replay on, the trainer's MoE layers use exactly the experts the rollout
engine recorded (also where its own router now disagrees, which the mismatch metric counts), and the load-balancing
loss joins the loss with router_aux_loss_coef."""

import copy

import torch

from models import build_model, preset_config
from models.document_attention import DocumentAttention
from models.moe import RouterTrace
from parallel.native_runner import LocalRunner
from parallel.runner import MicroBatch
from ppo.batch.packing import pack_prompt_responses, pack_routing
from rollout import NativeEngine, RolloutConfig, SamplingParams


def _rollout():
    """A tiny MoE policy's samples (2 per prompt) and their packed row with the engine's records."""
    engine_model = build_model(preset_config("tiny-qwen3-moe"), seed=0).eval()
    engine = NativeEngine.from_model(engine_model, config=RolloutConfig(max_model_len=64, kv_cache_tokens=64 * 8,
                                                                        max_num_seqs=8, block_size=16))
    outs = engine.generate([[1, 5, 9, 13], [1, 7]], SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=3,
                                                                    ignore_eos=True))
    prompts, responses = [c.prompt_ids for c in outs], [c.token_ids for c in outs]
    packed = pack_prompt_responses(prompts, responses, pad_id=0, share_prompts=True, pad_to_multiple=8)
    row = pack_routing(prompts, [c.routed_experts for c in outs], num_tokens=packed.num_tokens, share_prompts=True)
    return engine_model, packed, row


def test_replay_makes_the_trainer_route_as_the_engine_recorded():
    engine_model, packed, row = _rollout()
    trainer = copy.deepcopy(engine_model)  # a policy that moved since generation: its routers disagree
    cfg = trainer.config
    with torch.no_grad():
        for layer in cfg.moe_layers:
            w = trainer.model.layers[str(layer)].mlp.gate.weight
            w.add_(0.5 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(layer)))
    recorded = {layer: row[:, j] for j, layer in enumerate(cfg.moe_layers)}
    attn = DocumentAttention(packed.position_ids, backend="mask")
    has = row[:, 0, 0] >= 0
    for replay in (True, False):
        trace = RouterTrace(recorded=recorded, replay=replay, keep_choice=True)
        with torch.no_grad():
            trainer.hidden_states(packed.input_ids, packed.position_ids, attn=attn, routing=trace)
        same = all(torch.equal(trace.chosen[layer][has].sort(-1).values, recorded[layer][has].int().sort(-1).values)
                   for layer in cfg.moe_layers)
        assert same == replay
        assert int(trace.compared) == int(has.sum()) * len(cfg.moe_layers) and int(trace.mismatched) > 0


def test_runner_adds_the_load_balancing_loss_and_reports_the_mismatch():
    model, packed, row = _rollout()
    model.train()
    cfg = model.config
    runner = LocalRunner(model, attn_factory=lambda pos, **kw: DocumentAttention(pos, backend="mask", **kw))
    mb = MicroBatch(packed.input_ids, packed.position_ids, routing=row, replay=True)
    metrics = runner.forward_backward([mb, mb], loss_fn=lambda h, k: h.sum() * 0.0)  # the aux loss alone
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and "gate." in n}
    assert metrics[0]["router_mismatch"] == 0.0  # on-policy, same weights: the router agrees with the engine
    model.zero_grad()
    trace = RouterTrace(recorded={layer: row[:, j] for j, layer in enumerate(cfg.moe_layers)}, replay=True)
    model.hidden_states(packed.input_ids, packed.position_ids, attn=DocumentAttention(packed.position_ids,
                                                                                       backend="mask"), routing=trace)
    aux = trace.aux_loss(cfg.num_experts)
    assert abs(float(metrics[0]["aux_loss"]) - float(aux.detach())) < 1e-6
    (cfg.router_aux_loss_coef * aux).backward()  # two micro-batches of 1/2 each: the coefficient once
    for name, g in got.items():
        assert torch.allclose(g, dict(model.named_parameters())[name].grad, atol=1e-7), name
    assert got and all(g.abs().sum() > 0 for g in got.values())
