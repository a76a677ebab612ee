"""TP=2 equals TP=1: logits and parameter gradients; the DTensor plan matches parallel/sharding.py.

The same world also checks sharded loading into the TP model (parallel/loading.py; its
single-process cases are in test_loading.py): one world instead of two saves ~15 s of
process start-up on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import build_model
from parallel.sharding import tp_shard_dim, tp_slices
from tests.dist_utils import run_world

B, T = 2, 10


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 512, (B, T), generator=g)


def _lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def _grads(model):
    from torch.distributed.tensor import DTensor

    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in model.named_parameters()}


def _tp_body(rank, world, ckpt):
    from torch.distributed.tensor import DTensor, Shard

    from parallel.apply import head_shard, parallelize_model
    from parallel.dims import ParallelDims, build_mesh
    from parallel.loading import full_state_dict, load_sharded_weights
    from parallel.runner import forward_hidden
    from parallel.tensor_parallel import apply_tp
    from parallel.vocab_parallel import vocab_parallel_token_logprobs

    ids = _batch()
    dims = ParallelDims(tp=2)
    mesh = build_mesh(dims, [0, 1], device_type="cpu")
    model = parallelize_model(build_model("tiny", seed=0), mesh=mesh, dims=dims).module
    placements = {n: ([pl.dim for pl in p.placements if isinstance(pl, Shard)] if isinstance(p, DTensor) else [])
                  for n, p in model.named_parameters()}
    local_q = model.model.layers["0"].self_attn.q_proj.weight.to_local().shape
    all_dtensor = all(isinstance(p, DTensor) for p in model.parameters())  # foreach optimizers need no mix
    logits = model(ids)
    _lm_loss(logits, ids).backward()
    grads = _grads(model)

    # chunked vocab-parallel log-probs from the sharded head, gradients through TP
    model.zero_grad()
    hidden = forward_hidden(model, ids)
    w_local, start = head_shard(model)
    logp, ent = vocab_parallel_token_logprobs(hidden[:, :-1], w_local, ids[:, 1:], tp_group=mesh["tp"].get_group(),
                                              vocab_start=start, chunk_size=7, with_entropy=True)
    (-logp.mean() + 0.1 * ent.mean()).backward()
    vp_grads = _grads(model)

    # a size-1 TP mesh (tp=1 x dp=2 layout) must apply cleanly and change nothing
    mesh1 = build_mesh(ParallelDims(dp=2), [0, 1], device_type="cpu")
    model1 = apply_tp(build_model("tiny", seed=0), mesh1["tp"])
    logits1 = model1(ids)

    # loss-parallel logits: a vocab-sharded DTensor, cross-entropy without gathering them
    from torch.distributed.tensor.parallel import loss_parallel

    model_lp = parallelize_model(build_model("tiny", seed=0), mesh=mesh, dims=dims, loss_parallel=True).module
    logits_lp = model_lp(ids)
    with loss_parallel():
        _lm_loss(logits_lp, ids).backward()
    lp_grads = _grads(model_lp)
    lp_logits = logits_lp.full_tensor().detach()

    # FSDP2 on the size-1 dp dim of the same mesh, composed with TP=2, must change nothing
    model_f = parallelize_model(build_model("tiny", seed=0), mesh=mesh, dims=dims, fsdp=True).module
    _lm_loss(model_f(ids), ids).backward()
    fsdp1_grads = _grads(model_f)

    # sharded loading (parallel/loading.py) into a TP model that starts from other weights
    loaded_model = apply_tp(build_model("tiny", seed=3), mesh["tp"])
    load_sharded_weights(loaded_model, ckpt)
    loaded = {n: p.to_local().detach().clone() for n, p in loaded_model.named_parameters()}
    return dict(all_dtensor=all_dtensor, placements=placements, local_q=tuple(local_q), logits=logits.detach(),
                grads=grads, logp=logp.detach(), ent=ent.detach(), vp_grads=vp_grads, start=start,
                logits1=logits1.detach(), fsdp1_grads=fsdp1_grads, lp_grads=lp_grads, lp_logits=lp_logits,
                loaded=loaded,
                gathered=full_state_dict(loaded_model))


@pytest.mark.distributed
def test_tp2_equals_tp1(tmp_path):
    from models.hf_io import save_pretrained

    ids = _batch()
    ref = build_model("tiny", seed=0)
    save_pretrained(ref, tmp_path)
    ref_logits = ref(ids)
    _lm_loss(ref_logits, ids).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref.zero_grad()
    ls = F.log_softmax(ref(ids)[:, :-1].float(), -1)
    ref_logp = ls.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ref_ent = -(ls.exp() * ls).sum(-1)
    (-ref_logp.mean() + 0.1 * ref_ent.mean()).backward()
    ref_vp_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}

    out = run_world(_tp_body, 2, (str(tmp_path),))
    full = dict(ref.named_parameters())
    for r, o in enumerate(out):
        # loading reads exactly the slice parallel/sharding.py assigns to this rank; gathering restores the whole
        assert set(o["loaded"]) == set(full)
        for n, p in full.items():
            want = p.detach()[tp_slices(n, tuple(p.shape), rank=r, world=2)]
            torch.testing.assert_close(o["loaded"][n], want, rtol=0, atol=0, msg=n)
            torch.testing.assert_close(o["gathered"][n], p.detach(), rtol=0, atol=0, msg=n)
        # the plan agrees with the one table training, generation and resharding share
        for name, dims in o["placements"].items():
            want = tp_shard_dim(name)
            assert dims == ([] if want is None else [want]), (name, dims, want)
        assert o["all_dtensor"]
        assert o["local_q"] == (ref.config.num_attention_heads * ref.config.head_dim // 2, ref.config.hidden_size)
        assert o["start"] == r * ref.config.vocab_size // 2
        torch.testing.assert_close(o["logits"], ref_logits.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o["logits1"], ref_logits.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(o["lp_logits"], ref_logits.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o["logp"], ref_logp.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o["ent"], ref_ent.detach(), rtol=1e-5, atol=1e-5)
        assert set(o["grads"]) == set(ref_grads)
        for name in ref_grads:
            torch.testing.assert_close(o["grads"][name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
            torch.testing.assert_close(o["fsdp1_grads"][name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
            torch.testing.assert_close(o["lp_grads"][name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
            torch.testing.assert_close(o["vp_grads"][name], ref_vp_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_apply_tp_rejects_indivisible_tp():
    from parallel.tensor_parallel import apply_tp

    class _Mesh:
        def size(self):
            return 3

    with pytest.raises(ValueError, match=r"tp\(3\) must divide num_attention_heads\(4\)"):
        apply_tp(build_model("tiny", seed=0), _Mesh())


def _compiled_body(rank, world):
    from parallel.apply import parallelize_model
    from parallel.dims import ParallelDims, build_mesh

    dims = ParallelDims(tp=2)
    mesh = build_mesh(dims, [0, 1], device_type="cpu")
    model = parallelize_model(build_model("tiny", seed=0), mesh=mesh, dims=dims, ac="full", compile=True).module
    ids = _batch()
    _lm_loss(model(ids), ids).backward()
    return _grads(model)


@pytest.mark.distributed
@pytest.mark.slow(seconds=45)
def test_tp2_compiled_layers_with_full_ac_match_eager():
    """torch.compile'd TP layers under full activation checkpointing (two torch 2.13 pitfalls: see apply.py)."""
    ids = _batch()
    ref = build_model("tiny", seed=0)
    _lm_loss(ref(ids), ids).backward()
    out = run_world(_compiled_body, 2)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(out[0][name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
