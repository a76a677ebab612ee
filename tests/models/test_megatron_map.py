"""HF <-> megatron-core weight mapping (pure functions, no processes): exact round trips and the fused layouts."""

import pytest
import torch

from models.config import preset_config
from models.heads import LlamaForValue
from models.llama import LlamaForCausalLM, init_weights
from models.megatron_map import hf_names, hf_to_megatron, megatron_to_hf, stage_layers
from parallel.sharding import pp_stage_layers, tp_shard_dim, tp_slices


def _hf(cfg, cls=LlamaForCausalLM):
    m = cls(cfg)
    init_weights(m, seed=0)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # distinct norms (init puts them all at 1): a q_norm / k_norm mix-up cannot hide
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(1.0, 0.1, generator=gen)
    if cls is LlamaForValue:
        torch.nn.init.normal_(m.score.weight, generator=torch.Generator().manual_seed(1))
    return {n: p.detach() for n, p in m.named_parameters(remove_duplicate=False)}


def _local(hf, *, tp, r):
    return {n: t[tp_slices(n, tuple(t.shape), rank=r, world=tp)] for n, t in hf.items()}


CONFIGS = {
    "llama": preset_config("tiny", num_attention_heads=8, num_key_value_heads=4),
    "qwen2_tied": preset_config("tiny", model_type="qwen2", tie_word_embeddings=True, num_attention_heads=8,
                                num_key_value_heads=4),
    "qwen3": preset_config("tiny-qwen3", tie_word_embeddings=False),  # per-head q/k norms; 2 KV heads (tp <= 2)
}
TPS = {"llama": (1, 2, 4), "qwen2_tied": (1, 2, 4), "qwen3": (1, 2)}


@pytest.mark.parametrize("name,tp", [(name, tp) for name, tps in TPS.items() for tp in tps])
@pytest.mark.parametrize("pp", [1, 2])
def test_round_trip_is_exact_and_covers_every_tensor(name, tp, pp):
    cfg = CONFIGS[name]
    hf = _hf(cfg)
    seen = {}
    for s in range(pp):
        for r in range(tp):
            local = {n: t for n, t in _local(hf, tp=tp, r=r).items() if n in hf_names(cfg, pp=pp, pp_rank=s)}
            mc = hf_to_megatron(local, cfg, tp=tp, pp=pp, pp_rank=s)
            back = megatron_to_hf(mc, cfg, tp=tp, pp=pp, pp_rank=s)
            assert set(back) == set(hf_names(cfg, pp=pp, pp_rank=s))
            for n, t in back.items():
                assert torch.equal(t, local[n] if n in local else local["model.embed_tokens.weight"]), n
                seen.setdefault(n, {})[r] = t
    # every HF tensor is reassembled from the ranks' shards
    for n, t in hf.items():
        dim = tp_shard_dim(n)
        parts = seen[n]
        full = torch.cat([parts[r] for r in range(tp)], dim=dim) if dim is not None and tp > 1 else parts[0]
        assert torch.equal(full, t), n


def test_fused_layouts_match_megatron_core():
    """linear_qkv of rank r is rows chunk r of the tp=1 fused tensor (groups stay whole); linear_fc1 is
    [gate chunk r; up chunk r], NOT a contiguous chunk of the tp=1 tensor (megatron.md's table)."""
    cfg = CONFIGS["qwen2_tied"]
    hf = _hf(cfg)
    full = hf_to_megatron(hf, cfg, tp=1, pp=1, pp_rank=0)
    qkv, fc1 = full["decoder.layers.0.self_attention.linear_qkv.weight"], full["decoder.layers.0.mlp.linear_fc1.weight"]
    d, rep = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    # group 0 = q heads 0..rep-1, then k head 0, then v head 0
    g0 = torch.cat([hf["model.layers.0.self_attn.q_proj.weight"][: rep * d],
                    hf["model.layers.0.self_attn.k_proj.weight"][:d], hf["model.layers.0.self_attn.v_proj.weight"][:d]])
    assert torch.equal(qkv[: (rep + 2) * d], g0)
    f = cfg.intermediate_size
    for r in range(2):
        local = hf_to_megatron(_local(hf, tp=2, r=r), cfg, tp=2, pp=1, pp_rank=0)
        assert torch.equal(local["decoder.layers.0.self_attention.linear_qkv.weight"], qkv.chunk(2)[r])
        assert torch.equal(local["decoder.layers.0.self_attention.linear_qkv.bias"],
                           full["decoder.layers.0.self_attention.linear_qkv.bias"].chunk(2)[r])
        want = torch.cat([fc1[:f].chunk(2)[r], fc1[f:].chunk(2)[r]])
        assert torch.equal(local["decoder.layers.0.mlp.linear_fc1.weight"], want)


def test_qwen3_qk_norms_are_megatron_q_k_layernorms_on_every_tp_rank():
    """q_norm -> self_attention.q_layernorm, k_norm -> k_layernorm: the same [head_dim] tensor on each TP rank
    (megatron's qk_layernorm weights are replicated), at the stage-local layer index."""
    cfg = CONFIGS["qwen3"]
    hf = _hf(cfg)
    names = hf_names(cfg, pp=2, pp_rank=1)
    assert "model.layers.3.self_attn.q_norm.weight" in names and "model.layers.1.self_attn.k_norm.weight" not in names
    for r in range(2):
        local = {n: t for n, t in _local(hf, tp=2, r=r).items() if n in names}
        mc = hf_to_megatron(local, cfg, tp=2, pp=2, pp_rank=1)
        for x in "qk":
            got = mc[f"decoder.layers.1.self_attention.{x}_layernorm.weight"]
            assert got.shape == (cfg.head_dim,) and torch.equal(got, hf[f"model.layers.3.self_attn.{x}_norm.weight"])
        assert not torch.equal(mc["decoder.layers.1.self_attention.q_layernorm.weight"],
                               mc["decoder.layers.1.self_attention.k_layernorm.weight"])
    no_norms = preset_config("tiny")  # Llama: no q/k layernorm names either way
    assert not any("_norm" in n or "layernorm" in n.split(".")[-2]
                   for n in hf_names(no_norms, pp=1, pp_rank=0) if "self_attn" in n)


def test_views_share_storage():
    cfg = preset_config("tiny")  # 2 KV heads: at tp=2 each rank holds one group, q is a view too
    mc = hf_to_megatron(_local(_hf(cfg), tp=2, r=1), cfg, tp=2, pp=1, pp_rank=0)
    back = megatron_to_hf(mc, cfg, tp=2, pp=1, pp_rank=0)
    fused = mc["decoder.layers.1.self_attention.linear_qkv.weight"]
    for x in "qkv":
        assert back[f"model.layers.1.self_attn.{x}_proj.weight"].untyped_storage().data_ptr() == \
            fused.untyped_storage().data_ptr()
    assert back["model.layers.1.mlp.up_proj.weight"]._base is mc["decoder.layers.1.mlp.linear_fc1.weight"]


def test_value_head_and_stage_split():
    cfg = preset_config("tiny")
    hf = _hf(cfg, LlamaForValue)
    mc = hf_to_megatron({n: hf[n] for n in hf_names(cfg, pp=2, pp_rank=1, head="value")}, cfg, tp=1, pp=2,
                        pp_rank=1, head="value")
    assert "score.weight" in mc and "output_layer.weight" not in mc and "embedding.word_embeddings.weight" not in mc
    assert torch.equal(mc["decoder.layers.0.input_layernorm.weight"], hf["model.layers.2.input_layernorm.weight"])
    for s in range(2):  # megatron's even split is the native pipeline split whenever pp divides the layers
        assert stage_layers(cfg, pp=2, pp_rank=s) == pp_stage_layers(cfg.num_hidden_layers, pp=2, stage=s)


def test_rejects_layouts_megatron_cannot_run():
    cfg = preset_config("tiny")
    with pytest.raises(ValueError, match="pp\\(3\\) must divide num_hidden_layers\\(4\\)"):
        stage_layers(cfg, pp=3, pp_rank=0)
    with pytest.raises(ValueError, match="tp\\(4\\) must divide num_key_value_heads\\(2\\)"):
        hf_to_megatron({}, cfg, tp=4, pp=1, pp_rank=0)
