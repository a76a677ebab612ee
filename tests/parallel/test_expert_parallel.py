"""Expert parallelism (parallel/expert_parallel.py) on gloo: a tiny mixture of experts (8 experts, top-2) over
dp = 2 ranks at ep = 2 (each rank holds 4 experts whole, tokens travel by all-to-all) equals the same layout at
ep = 1 (FSDP shards the stacked experts): logits, losses (with the load-balancing loss), every gradient after
reduction, three optimizer steps (their gradient norms and the exported weights after them), and the hybrid engine's
reshard to whole-model generation weights (the expert slices gathered), each rank on its own micro-batches of
other lengths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_world


def _batches(dp_rank: int, device):
    from parallel.runner import MicroBatch

    g = torch.Generator().manual_seed(11 + dp_rank)
    out = []
    for t in ((9, 14) if dp_rank == 0 else (5, 20)):  # uneven token counts per rank and micro-batch
        ids = torch.randint(3, 512, (1, t), generator=g)
        out.append(MicroBatch(ids.to(device), torch.arange(t, device=device)[None]))
    return out


def _run(ep: int, device: str) -> dict:
    from models import build_model
    from parallel.apply import parallelize_model
    from parallel.dims import ParallelDims, build_expert_mesh, build_mesh

    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons on the GPU: no TF32 matmuls
    dims = ParallelDims(dp=2, ep=ep)
    mesh = build_mesh(dims, [0, 1], device_type=device)
    runner = parallelize_model(build_model("tiny-qwen3-moe", seed=3).to(dev), mesh=mesh, dims=dims,
                               expert_mesh=build_expert_mesh(dims, [0, 1], device_type=device))
    mbs = _batches(mesh.get_local_rank("dp"), dev)

    def logits(hidden, k):
        w, _ = runner.head()
        return hidden[0] @ w.T

    def loss_fn(hidden, k):
        ids = mbs[k].input_ids[0]
        loss = F.cross_entropy(logits(hidden, k)[:-1], ids[1:]) / len(mbs)
        return loss, {"loss": loss.detach()}

    out = {"initial_experts": runner.export_state_dict(),
           "logits": [t.detach() for t in runner.forward(mbs, reduce=logits)]}
    out["metrics"] = runner.forward_backward(mbs, loss_fn=loss_fn)
    out["grads"] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                    for n, p in runner.named_parameters()}
    # Adam's update is ~lr whatever the gradient's size, so fp32 rounding of near-zero gradients moves a weight by up
    # to ~lr between layouts: a small lr keeps that below the tolerance (the gradients themselves are compared above)
    opt = runner.build_optimizer(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    out["norms"] = [runner.optimizer_step(opt, max_norm=1.0)]
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        runner.forward_backward(mbs, loss_fn=loss_fn)
        out["norms"].append(runner.optimizer_step(opt, max_norm=1.0))
    if out["initial_experts"] is not None:
        out["initial_experts"] = out["initial_experts"]["model.layers.1.mlp.experts.gate_up_proj"]
    out["export"] = runner.export_state_dict()
    out["engine"] = _engine_weights(runner, dims)
    out["restored"] = _restored(runner, opt, dims, mesh, dev) if ep == 2 else None
    out["local_experts"] = tuple(dict(runner.training_shards())["model.layers.1.mlp.experts.down_proj"].shape)
    return _to_cpu(out)


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def _engine_weights(runner, dims) -> dict:
    """The hybrid engine's reshard of the runner's training shards into whole-model generation weights (gen tp 1
    on each of the 2 ranks), both methods: the engine runs every expert, so the expert slices are gathered."""
    import torch.distributed as dist

    from parallel.reshard import GenLayout, param_specs, plan_reshard
    from parallel.reshard_exec import METHODS, ReshardStats, build_reshard_groups, execute_reshard

    gen = GenLayout(tp=1, dp=2)
    groups = build_reshard_groups((dims, gen), [0, 1])
    plan = plan_reshard(dims, gen, param_specs(runner.model_config, itemsize=4), only_rank=dist.get_rank())
    out = {}
    for method in METHODS:
        stats = ReshardStats()
        got = execute_reshard(plan, runner.training_shards(), groups=groups, bucket_bytes=1 << 20, method=method,
                              stats=stats)
        assert stats.bytes_received == plan.bytes_received(dist.get_rank()) == plan.lower_bound_bytes(dist.get_rank())
        out[method] = {k: v.clone() for k, v in got.items()}
    return out


def _restored(runner, opt, dims, mesh, dev) -> dict:
    """A fresh ep = 2 runner of other weights, loaded from the trained one's checkpoint state (local expert shards,
    optimizer): its export and its next step's gradient norm equal the trained runner's."""
    from models import build_model
    from parallel.apply import parallelize_model
    from parallel.dims import build_expert_mesh

    state = runner.checkpoint_state(opt)
    fresh = parallelize_model(build_model("tiny-qwen3-moe", seed=9).to(dev), mesh=mesh, dims=dims,
                              expert_mesh=build_expert_mesh(dims, [0, 1], device_type=dev.type))
    fresh_opt = fresh.build_optimizer(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    fresh.load_checkpoint_state(fresh_opt, state)
    return fresh.export_state_dict()


def _body(rank, world, device="cpu"):
    return {ep: _run(ep, device) for ep in (1, 2)}


@pytest.mark.distributed
def test_ep2_equals_ep1_logits_losses_gradients_steps_and_export():
    _check(run_world(_body, world_size=2))


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ep2_equals_ep1_on_two_gpus_over_nccl():
    """The same on 2 GPUs over NCCL in fp32: the expert groups padded to 8-row multiples (the loop path; fp32 has
    no grouped GEMM on CUDA), NCCL's all_to_all_single with split sizes. Looser tolerances: cuBLAS picks kernels by
    shape, and the two layouts multiply rows in other groupings."""
    _check(run_world(_body, world_size=2, args=("cuda",), backend="nccl"), tol=(1e-4, 1e-5))


def _check(res, tol=(1e-5, 1e-6)):
    rtol, atol = tol
    for r in res:
        one, two = r[1], r[2]
        assert one["local_experts"] == (4, 64, 32) and two["local_experts"] == (4, 64, 32)  # FSDP rows / 4 experts
        for a, b in zip(one["logits"], two["logits"]):
            torch.testing.assert_close(b, a, rtol=rtol, atol=max(atol, 1e-5))
        for a, b in zip(one["metrics"], two["metrics"]):
            assert set(a) == set(b) and "aux_loss" in a
            for key in a:
                torch.testing.assert_close(b[key], a[key], rtol=rtol, atol=atol)
        assert one["grads"].keys() == two["grads"].keys()
        for n, g in one["grads"].items():
            torch.testing.assert_close(two["grads"][n], g, rtol=rtol, atol=atol, msg=n)
        assert two["grads"]["model.layers.1.mlp.experts.gate_up_proj"].abs().sum() > 0
        torch.testing.assert_close(torch.tensor(two["norms"]), torch.tensor(one["norms"]), rtol=rtol, atol=0)
    assert res[1][1]["export"] is None and res[1][2]["export"] is None
    one, two = res[0][1]["export"], res[0][2]["export"]
    assert one.keys() == two.keys()
    for n, t in one.items():
        torch.testing.assert_close(two[n], t, rtol=0, atol=atol, msg=n)
    for rank in range(2):  # the engine's weights on every rank: the exported model, experts whole
        for method, got in res[rank][2]["engine"].items():
            assert got.keys() == two.keys()
            assert all(torch.equal(got[n], t) for n, t in two.items()), method
    assert res[0][2]["restored"].keys() == two.keys()
    assert all(torch.equal(res[0][2]["restored"][n], t) for n, t in two.items())  # checkpoint state round trip
    moved = (one["model.layers.1.mlp.experts.gate_up_proj"] - res[0][1]["initial_experts"]).abs().amax(dim=(1, 2))
    assert (moved > 1e-4).all()  # every expert trained (3 steps of ~lr)
