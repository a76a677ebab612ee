"""Qwen3 training on the megatron-core backend over NCCL: DDP, megatron's grad finalisation and the
distributed optimizer with the per-head q/k layernorms.

    source .whl/prelude.sh && python -m pytest -q -s -m gpu tests/parallel/test_megatron_qwen3_gpu.py

At tp 1 (one H200) and tp 2 (two GPUs, skipped with fewer): the summed loss, every gradient (this rank's TP
shard, HF names) and the clipped grad norm equal the native model's. At tp 2 this checks megatron-core's
finalize step sums the replicated q/k layernorm grads over TP (each rank sees only its heads) and that the
grad norm counts them once. Prints one JSON line per tp (-s shows it).
"""

import json

import pytest
import torch

from tests.dist_utils import run_world
from tests.parallel.test_megatron_gpu import _batch, _cfg, _gpus, _logprobs, _native, _native_hidden, _nll, _runner

pytest.importorskip("megatron.core")


def _qwen3_native():
    native = _native(_cfg(model_type="qwen3"))  # tiny body with per-head q/k norms (head_dim 32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms away from 1 and q != k, so a dropped or swapped norm changes the answer
        for n, p in native.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(torch.empty(p.shape).normal_(1.0, 0.2, generator=gen))
    return native


def _train_grads_body(rank, world):
    import copy

    from models.megatron_map import megatron_to_hf
    from parallel.sharding import tp_slices

    native = _qwen3_native()
    cfg = native.config
    runner, opt = _runner(copy.deepcopy(native), tp=world, world=world, lr=0.0)
    mbs, targets = _batch(cfg)
    nloss = 0.0
    for k, mb in enumerate(mbs):
        loss = -_logprobs(_native_hidden(native, mb), native.lm_head.weight, 0, targets[k], None)[0].sum()
        loss = loss / targets.numel()
        loss.backward()
        nloss += float(loss)
    nnorm = float(torch.nn.utils.clip_grad_norm_(native.parameters(), 1e9))
    metrics = runner.forward_backward(mbs, loss_fn=_nll(runner, targets))
    grads = megatron_to_hf({n: p.main_grad.clone() for n, p in runner.gpt.named_parameters()}, cfg, tp=world, pp=1,
                           pp_rank=0)
    norm = runner.optimizer_step(opt, max_norm=1e9)
    ref = dict(native.named_parameters(remove_duplicate=False))
    r = runner.pgc.tp.rank()
    err = {n: (g.float() - ref[n].grad[tp_slices(n, tuple(ref[n].shape), rank=r, world=world)]).abs().max().item()
           for n, g in grads.items()}
    scale = max(p.grad.abs().max().item() for p in native.parameters())
    return dict(tp=world, loss=sum(m["loss"] for m in metrics), native_loss=nloss, grad_norm=norm,
                native_grad_norm=nnorm, grad_err=max(err.values()), grad_scale=scale,
                qk_norm_grad_err=max(v for n, v in err.items() if n.endswith(("q_norm.weight", "k_norm.weight"))))


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=[pytest.mark.distributed, _gpus(2)])])
def test_qwen3_training_grads_equal_native(tp):
    res = run_world(_train_grads_body, tp, backend="nccl")
    print(json.dumps({"test": "megatron_qwen3_grads", "results": res}))
    for r in res:
        assert abs(r["loss"] - r["native_loss"]) < 1e-5, r
        assert abs(r["grad_norm"] - r["native_grad_norm"]) <= 1e-4 * r["native_grad_norm"], r
        assert r["grad_err"] <= 1e-5 * r["grad_scale"], r
