"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM: logits, router logits, the load-balancing loss and
gradients in fp32 on CPU; checkpoints both ways (per-expert tensors on disk); routing replay and traces."""

import json

import pytest
import torch

from models import ModelConfig, build_model, load_pretrained, preset_config, save_pretrained
from models.hf_io import load_tensors, tensor_shapes
from models.moe import RouterTrace
from tests.models.hf_fixtures import randomize_

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
            max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000.0)


def _hf(seed=0, **overrides):
    import transformers

    cfg = transformers.Qwen3MoeConfig(**{**TINY, **overrides})
    model = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    model.config._attn_implementation = "eager"
    randomize_(model, seed=seed)
    return model


def _ours(hf) -> torch.nn.Module:
    model = build_model(ModelConfig.from_hf(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict())  # transformers 5's in-memory names are ours
    return model.eval()


@pytest.mark.parametrize("overrides", [
    dict(norm_topk_prob=True, mlp_only_layers=[1]),  # renormalised top-k, a dense layer between MoE layers
    dict(norm_topk_prob=False, decoder_sparse_step=2),  # raw top-k probabilities; only layer 1 is MoE
])
def test_logits_router_logits_and_aux_loss_equal_transformers(overrides):
    hf = _hf(**overrides)
    ours = _ours(hf)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_router_logits=True)
        trace = RouterTrace(keep_logits=True)
        logits = ours(ids, routing=trace)
    assert (logits - ref.logits).abs().max() < 1e-5
    moe_layers = ours.config.moe_layers
    assert moe_layers == [i for i in range(3) if hasattr(hf.model.layers[i].mlp, "gate")]
    assert len(ref.router_logits) == len(moe_layers)
    for layer, hf_logits in zip(moe_layers, ref.router_logits):
        assert (trace.logits[layer] - hf_logits).abs().max() < 1e-5
    assert abs(float(trace.aux_loss(ours.config.num_experts)) - float(ref.aux_loss)) < 1e-5
    assert ours.config.router_aux_loss_coef == hf.config.router_aux_loss_coef
    with torch.no_grad():  # no trace: the same logits (the engine's and the dense callers' path)
        assert torch.equal(ours(ids), logits)


def test_gradients_equal_transformers():
    hf = _hf(norm_topk_prob=True, mlp_only_layers=[0])
    hf.train()
    ours = _ours(hf).train()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    out = hf(ids, labels=ids, output_router_logits=True)
    out.loss.backward()  # cross-entropy + router_aux_loss_coef * aux
    trace = RouterTrace()
    logits = ours(ids, routing=trace)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
    (ce + ours.config.router_aux_loss_coef * trace.aux_loss(ours.config.num_experts)).backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert (p.grad - theirs[name].grad).abs().max() < 1e-5, name


def test_expert_loop_fallback_equals_grouped_gemm(monkeypatch):
    import models.moe as moe

    hf = _hf(norm_topk_prob=True)
    ours = _ours(hf)
    ids = torch.randint(0, 128, (1, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        grouped = ours(ids)
        monkeypatch.setattr(moe, "grouped_mm_supported", lambda x: False)
        looped = ours(ids)
    assert (grouped - looped).abs().max() < 1e-5


def test_checkpoints_both_ways_with_per_expert_tensors(tmp_path):
    import transformers

    hf = _hf(norm_topk_prob=True, mlp_only_layers=[2])
    hf.save_pretrained(str(tmp_path / "hf"))
    ours = load_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() < 1e-5
    shapes = tensor_shapes(tmp_path / "hf")  # the per-expert tensors, seen stacked
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (6, 32, 32)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (6, 32, 16)
    # a slice over experts reads only those experts (what an FSDP rank loads)
    part = load_tensors(tmp_path / "hf", names=["model.layers.1.mlp.experts.gate_up_proj"],
                        slices=lambda n, shape: (slice(2, 4), slice(16, 32), slice(None)))
    full = hf.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(part["model.layers.1.mlp.experts.gate_up_proj"], full[2:4, 16:32])

    save_pretrained(ours, tmp_path / "ours")
    on_disk = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert on_disk["architectures"] == ["Qwen3MoeForCausalLM"] and on_disk["num_experts"] == 6
    assert "model.layers.0.mlp.experts.5.up_proj.weight" in load_tensors(tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours")).float().eval()
    with torch.no_grad():
        assert (back(ids).logits - hf(ids).logits).abs().max() < 1e-5
    assert ModelConfig.from_hf(on_disk) == ours.config


def test_published_config_and_active_parameters():
    cfg = preset_config("qwen3-30b-a3b")
    d = cfg.to_hf()
    assert ModelConfig.from_hf(d) == cfg and d["architectures"] == ["Qwen3MoeForCausalLM"]
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B activated (its model card; 3.35B with the input embedding)
    assert round(cfg.num_params() / 1e9, 1) == 30.5
    assert 3.3e9 < cfg.matmul_params() + cfg.vocab_size * cfg.hidden_size < 3.4e9
    dense = preset_config("qwen3-0.6b").to_hf()
    assert "num_experts" not in dense and "mlp_only_layers" not in dense  # dense configs stay as they were


def test_replay_uses_the_given_experts_and_counts_mismatches():
    torch.manual_seed(0)
    model = build_model(preset_config("tiny-qwen3-moe")).eval()
    ids = torch.randint(0, 512, (1, 10))
    own = RouterTrace(keep_choice=True)
    with torch.no_grad():
        model(ids, routing=own)
    layer = model.config.moe_layers[0]
    forced = (own.chosen[layer] + 1) % model.config.num_experts  # every token's experts changed
    forced[-1] = -1  # no record: the router's own choice
    replayed = RouterTrace(recorded={layer: forced}, replay=True, keep_choice=True)
    with torch.no_grad():
        model(ids, routing=replayed)
    assert torch.equal(replayed.chosen[layer][:-1], forced[:-1].to(torch.int32))
    assert torch.equal(replayed.chosen[layer][-1], own.chosen[layer][-1])
    assert int(replayed.mismatched) == 9 and int(replayed.compared) == 9
    compared = RouterTrace(recorded={layer: forced}, keep_choice=True)  # replay off: own choice, counted
    with torch.no_grad():
        model(ids, routing=compared)
    assert torch.equal(compared.chosen[layer], own.chosen[layer]) and int(compared.mismatched) == 9
    same = RouterTrace(recorded={layer: own.chosen[layer].flip(-1)}, replay=True)  # same sets, other order: no mismatch
    with torch.no_grad():
        model(ids, routing=same)
    assert int(same.mismatched) == 0 and int(same.compared) == 10


def test_expert_groups_padded_to_aligned_rows_give_the_same_outputs_and_gradients():
    """The CUDA layout (each expert's rows start at a multiple of 8, zero rows between) run on the CPU."""
    from models.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(ModelConfig.from_hf({**TINY, "model_type": "qwen3_moe"}))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.1)
    x = torch.randn(13, 32, requires_grad=True)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(13)])
    weights = torch.rand(13, 2)
    outs = []
    for align in (1, 8):
        y = experts(x, ids, weights, align=align)
        grads = torch.autograd.grad((y * torch.linspace(-1, 1, 32)).sum(), [x, *experts.parameters()])
        outs.append((y, grads))
    (y1, g1), (y8, g8) = outs
    assert (y1 - y8).abs().max() < 1e-6
    assert all((a - b).abs().max() < 1e-6 for a, b in zip(g1, g8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bf16_grouped_gemm_on_cuda_equals_the_expert_loop(monkeypatch):
    """The trainer's CUDA path: torch._grouped_mm over 8-row-aligned groups, forward and backward, against the
    per-expert loop, at Qwen3-30B-A3B's widths."""
    import models.moe as moe

    cfg = preset_config("qwen3-30b-a3b", num_hidden_layers=1)
    experts = moe.GroupedExperts(cfg).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(300, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.stack([torch.randperm(cfg.num_experts, device="cuda")[:8] for _ in range(300)])
    weights = torch.rand(300, 8, device="cuda")
    assert moe.grouped_mm_supported(x)
    results = []
    for grouped in (True, False):
        monkeypatch.setattr(moe, "grouped_mm_supported", lambda t, g=grouped: g)
        y = experts(x, ids, weights)
        results.append((y.float(), [g.float() for g in torch.autograd.grad(y.float().square().sum(),
                                                                          [x, *experts.parameters()])]))
    (y1, g1), (y2, g2) = results
    assert (y1 - y2).abs().max() <= 2e-2 * y2.abs().max()
    for a, b in zip(g1, g2):
        assert (a - b).abs().max() <= 2e-2 * b.abs().max()
