"""Qwen3 in the parallel layouts. DTensor TP=2 equals TP=1 (gloo): logits and every gradient, the per-head
q/k norms' included (their inputs are this rank's heads, so their weight gradients must be summed over
the group), untied and tied embeddings (one Shard(0) DTensor shared by the lookup and the head), and
with FSDP2 composed. Pipeline stages chained equal the whole model and keep the norms' HF names."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import build_model, preset_config
from tests.dist_utils import run_world

B, T = 2, 10
NORMS = ("model.layers.0.self_attn.q_norm.weight", "model.layers.3.self_attn.k_norm.weight")


def _model(tied: bool):
    cfg = preset_config("tiny-qwen3", tie_word_embeddings=tied)
    model = build_model(cfg, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms away from 1: their values and gradients then matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    return model


def _batch():
    return torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(3))


def _loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def _tp_body(rank, world):
    from torch.distributed.tensor import DTensor

    from parallel.apply import parallelize_model
    from parallel.dims import ParallelDims, build_mesh

    dims = ParallelDims(tp=2)
    mesh = build_mesh(dims, [0, 1], device_type="cpu")
    ids = _batch()
    out = {}
    for tied in (False, True):
        model = parallelize_model(_model(tied), mesh=mesh, dims=dims).module
        logits = model(ids)
        _loss(logits, ids).backward()
        norm_grads = {n: model.get_parameter(n).grad for n in NORMS}
        fsdp_grads = {}
        if tied:  # FSDP2 composed with TP on the same mesh (size-1 dp): its post-backward reduces the norms'
            # gradients, and the tied DTensor is one parameter of the root group (the untied case adds nothing)
            model_f = parallelize_model(_model(tied), mesh=mesh, dims=dims, fsdp=True).module
            _loss(model_f(ids), ids).backward()
            fsdp_grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                          for n, p in model_f.named_parameters()}
        out[tied] = dict(
            logits=logits.detach(),
            grads={n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                   for n, p in model.named_parameters()},
            # a replicated weight holds the full gradient on every rank (Replicate, not a Partial to reduce later)
            norm_placements={str(g.placements) for g in norm_grads.values()},
            norm_local={n: g.to_local().clone() for n, g in norm_grads.items()},
            fsdp_grads=fsdp_grads,
            tied_shared=model.lm_head.weight is model.model.embed_tokens.weight,
        )
    return out


@pytest.mark.distributed
def test_qwen3_tp2_equals_tp1():
    ids = _batch()
    out = run_world(_tp_body, 2)
    for tied in (False, True):
        ref = _model(tied)
        ref_logits = ref(ids)
        _loss(ref_logits, ids).backward()
        grads = {n: p.grad for n, p in ref.named_parameters()}
        for o in out:
            got = o[tied]
            assert got["tied_shared"] == tied
            torch.testing.assert_close(got["logits"], ref_logits.detach(), rtol=1e-5, atol=1e-5)
            assert set(got["grads"]) == set(grads)
            for name, g in grads.items():
                torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)
            assert got["norm_placements"] == {"(Replicate(),)"}
            for name in NORMS:
                assert grads[name].abs().max() > 1e-4  # a gradient that can be wrong
                torch.testing.assert_close(got["norm_local"][name], grads[name], rtol=1e-4, atol=1e-6, msg=name)
            assert set(got["fsdp_grads"]) == (set(grads) if tied else set())
            for name, g in grads.items() if tied else ():
                torch.testing.assert_close(got["fsdp_grads"][name], g, rtol=1e-4, atol=1e-6, msg=f"fsdp {name}")


def test_qwen3_pipeline_stages_chain_to_the_full_model():
    from parallel.pipeline import split_stage

    ids = _batch()
    full = _model(False)
    ref = full(ids)
    stages = [split_stage(_model(False), num_stages=3, stage=s) for s in range(3)]
    h = ids
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(stages[-1].lm_head(h), ref, rtol=0, atol=0)
    names = [n for stage in stages for n, _ in stage.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in full.named_parameters())
    assert "model.layers.3.self_attn.k_norm.weight" in dict(stages[2].named_parameters())
