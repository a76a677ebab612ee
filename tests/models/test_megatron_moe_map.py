"""Hugging Face <-> megatron-core mapping of a mixture of experts' sparse layers (models/megatron_map.py): exact
both ways for every expert-parallel rank's slice of the stacked experts, and megatron-core's SequentialMLP (the
experts of its MoE layer without Transformer Engine, which builds and runs on the CPU unlike the layer's token
dispatcher) loaded with the mapped weights computes the native grouped experts' outputs."""

from __future__ import annotations

import pytest
import torch

from models import build_model
from models.megatron_map import hf_names, hf_to_megatron, megatron_to_hf

MOE = "tiny-qwen3-moe"  # layer 0 dense (mlp_only_layers), layer 1 sparse: 8 experts, top-2


def _local(full: dict, cfg, *, ep: int, ep_rank: int) -> dict:
    n = cfg.num_experts // ep
    return {k: (t[ep_rank * n:(ep_rank + 1) * n] if ".mlp.experts." in k else t) for k, t in full.items()
            if k in hf_names(cfg, pp=1, pp_rank=0)}


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_moe_mapping_is_exact_both_ways_for_every_expert_parallel_rank(ep):
    model = build_model(MOE, seed=0)
    cfg = model.config
    full = {n: p.detach() for n, p in model.named_parameters()}
    for r in range(ep):
        local = _local(full, cfg, ep=ep, ep_rank=r)
        mc = hf_to_megatron(local, cfg, tp=1, pp=1, pp_rank=0, ep=ep)
        assert "decoder.layers.0.mlp.linear_fc1.weight" in mc  # the dense layer as before
        assert torch.equal(mc["decoder.layers.1.mlp.router.weight"], full["model.layers.1.mlp.gate.weight"])
        experts = sorted(k for k in mc if k.startswith("decoder.layers.1.mlp.experts."))
        assert len(experts) == 2 * (8 // ep) and not any(".linear_fc" in k and "experts" not in k
                                                          for k in mc if k.startswith("decoder.layers.1."))
        for e in range(8 // ep):  # local expert e is global expert r * 8 / ep + e: [gate; up] rows, then down
            g = r * (8 // ep) + e
            fc1 = mc[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"]
            assert torch.equal(fc1, full["model.layers.1.mlp.experts.gate_up_proj"][g])
            assert torch.equal(mc[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc2.weight"],
                               full["model.layers.1.mlp.experts.down_proj"][g])
        back = megatron_to_hf(mc, cfg, tp=1, pp=1, pp_rank=0, ep=ep)
        assert back.keys() == local.keys()
        assert all(torch.equal(back[k], local[k]) for k in local)
    with pytest.raises(ValueError, match=r"8 experts held, and ep\(2\) of num_experts\(8\) gives 4"):
        hf_to_megatron(_local(full, cfg, ep=1, ep_rank=0), cfg, tp=1, pp=1, pp_rank=0, ep=2)


def test_sequential_mlp_with_mapped_weights_equals_the_native_experts():
    pytest.importorskip("megatron.core")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import SequentialMLP

    from models.megatron_model import transformer_config
    from models.moe import expert_mlp
    from parallel.dims import ParallelDims, build_mesh
    from parallel.megatron_groups import build_process_groups
    from tests.ppo.world import world_of_one

    model = build_model(MOE, seed=0)
    cfg = model.config
    full = {n: p.detach() for n, p in model.named_parameters()}
    with world_of_one():
        pgc = build_process_groups(build_mesh(ParallelDims(), [0], device_type="cpu"))
        tc = transformer_config(cfg, num_moe_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.moe_intermediate_size,
                                moe_router_topk=cfg.num_experts_per_tok)
        spec = get_gpt_layer_local_spec(num_experts=cfg.num_experts, moe_grouped_gemm=False, normalization="RMSNorm")
        experts = SequentialMLP(cfg.num_experts, tc, spec.submodules.mlp.submodules.experts.submodules,
                                pg_collection=pgc)
        mc = hf_to_megatron(_local(full, cfg, ep=1, ep_rank=0), cfg, tp=1, pp=1, pp_rank=0)
        prefix = "decoder.layers.1.mlp.experts."
        experts.load_state_dict({k[len(prefix):]: v for k, v in mc.items() if k.startswith(prefix)}, strict=True)
        counts = torch.tensor([3, 0, 5, 1, 2, 4, 0, 6])  # rows per expert, sorted by expert as a dispatcher does
        g = torch.Generator().manual_seed(0)
        xs = torch.randn(int(counts.sum()), cfg.hidden_size, generator=g)
        probs = torch.rand(xs.shape[0], generator=g)
        with torch.no_grad():
            got, _ = experts(xs, counts, probs)
            want = [expert_mlp(xs, counts, torch.repeat_interleave(torch.arange(8), counts),
                               full["model.layers.1.mlp.experts.gate_up_proj"],
                               full["model.layers.1.mlp.experts.down_proj"], align=align) * probs[:, None]
                    for align in (1, 8)]  # 8: CUDA's padded groups (the expert-parallel receiver's path there)
    for w in want:
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)
