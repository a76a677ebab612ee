"""TP=2 x DP=2 (FSDP2 over DTensor TP, 4 processes) gradients equal single-process gradients.

One world checks, in order: sharded loading into the 2-D model (it starts from other
weights), full_state_dict, gradients of the logits loss, gradients of the chunked
vocab-parallel log-prob loss (the FSDP root keeps the head gathered after forward),
activation checkpointing (full, selective) leaving gradients unchanged, and TP=2 x PP=2 and
DP=2 (FSDP) x PP=2 layouts (1F1B) whose last stage computes the loss from hidden states.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import build_model
from tests.dist_utils import run_world

B, T = 4, 10


def _batch():
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 512, (B, T), generator=g)


def _lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def _full_grads(model):
    from torch.distributed.tensor import DTensor

    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in model.named_parameters()}


def _fsdp_body(rank, world, ckpt):
    from parallel.apply import head_shard, parallelize_model
    from parallel.dims import ParallelDims, build_mesh
    from parallel.loading import full_state_dict, load_sharded_weights
    from parallel.runner import forward_hidden
    from parallel.vocab_parallel import vocab_parallel_token_logprobs

    dims = ParallelDims(tp=2, dp=2)
    mesh = build_mesh(dims, list(range(4)), device_type="cpu")
    dp_rank = mesh.get_local_rank("dp")
    ids = _batch()[dp_rank * (B // 2):(dp_rank + 1) * (B // 2)]  # each DP rank its half of the batch
    out = {}
    for ac in ("none", "selective", "full"):
        model = parallelize_model(build_model("tiny", seed=7), mesh=mesh, dims=dims, ac=ac).module
        loaded = load_sharded_weights(model, ckpt)
        if ac == "none":
            out["loaded"] = loaded
            out["state"] = full_state_dict(model)
        _lm_loss(model(ids), ids).backward()
        out[f"grads_{ac}"] = _full_grads(model)
        if ac == "none":
            model.zero_grad()
            hidden = forward_hidden(model, ids)
            w, start = head_shard(model)
            logp, _ = vocab_parallel_token_logprobs(hidden[:, :-1], w, ids[:, 1:], tp_group=mesh["tp"].get_group(),
                                                    vocab_start=start, chunk_size=5)
            (-logp.mean()).backward()
            out["vp_grads"] = _full_grads(model)
    out["pp_tp"] = _pipelined(ParallelDims(tp=2, pp=2), ckpt=ckpt)
    out["pp_dp"] = _pipelined(ParallelDims(dp=2, pp=2), ckpt=ckpt)
    return out


def _pipelined(dims, *, ckpt):
    """PP=2 with TP=2 or FSDP DP=2 over the same 4 ranks: per-stage gradients of the token-mean NLL."""
    from parallel.apply import head_shard, parallelize_model
    from parallel.dims import build_mesh
    from parallel.loading import load_sharded_weights
    from parallel.vocab_parallel import vocab_parallel_token_logprobs

    mesh = build_mesh(dims, list(range(4)), device_type="cpu")
    runner = parallelize_model(build_model("tiny", seed=7), mesh=mesh, dims=dims, n_microbatches=2)
    for m in runner.modules:
        load_sharded_weights(m, ckpt)
    rows = B // dims.dp
    dp_rank = mesh.get_local_rank("dp")
    ids = _batch()[dp_rank * rows:(dp_rank + 1) * rows]
    pos = torch.arange(T).expand(rows, T).contiguous()
    tp_group = mesh["tp"].get_group() if dims.tp > 1 else None

    def loss_fn(hidden, mb):
        w, start = head_shard(runner.last_module)
        logp, _ = vocab_parallel_token_logprobs(hidden[:, :-1], w, mb["ids"][:, 1:], tp_group=tp_group,
                                                vocab_start=start, chunk_size=8)
        # normalised by this rank's whole batch: micro-batch losses add up, FSDP averages the DP ranks
        return -logp.sum() / (rows * (T - 1))

    runner.forward_backward_rows(ids if runner.has_first else None, position_ids=pos, extras={"ids": ids},
                            loss_fn=loss_fn)
    return {n: g for m in runner.modules for n, g in _full_grads(m).items()}


@pytest.mark.distributed
def test_tp2_dp2_fsdp_equals_single_process(tmp_path):
    from models.hf_io import save_pretrained

    ref = build_model("tiny", seed=0)
    save_pretrained(ref, tmp_path / "ckpt")
    ids = _batch()
    _lm_loss(ref(ids), ids).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}

    out = run_world(_fsdp_body, 4, (str(tmp_path / "ckpt"),))
    names = {n for n, _ in ref.named_parameters()}
    for key in ("pp_tp", "pp_dp"):
        pp_names = set()
        for o in out:
            for n, g in o[key].items():
                torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=f"{key} {n}")
                pp_names.add(n)
        assert pp_names == names, key
    for o in out:
        assert set(o["loaded"]) == names
        for n, p in ref.named_parameters():
            torch.testing.assert_close(o["state"][n], p.detach(), rtol=0, atol=0, msg=n)
        for key in ("grads_none", "grads_selective", "grads_full", "vp_grads"):
            assert set(o[key]) == names
            for n in names:
                torch.testing.assert_close(o[key][n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=f"{key} {n}")
