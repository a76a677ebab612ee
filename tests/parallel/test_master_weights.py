"""Megatron's mixed-precision layout at dp = 1 (parallel/master_weights.py: bf16 weights, fp32 main grads,
fp32 masters in the optimizer) trains exactly like FSDP2's mixed precision on the same model: the same
losses, grad norms and fp32 weights, bit for bit, over clipped steps of several uneven micro-batches or of
one (whose main grads stay bf16).
A checkpoint round trip restores the fp32 masters and moments (AdamW's loader alone would round them to
bf16), and checkpoints move between the two layouts. Released gradients drop the main grads. At pp = 2
with a tied embedding the pipeline's tied copies step with the whole fp32 gradient like the
single-process runner's; at tp = 2 the DTensor main grads and masters give the single-process runner's
gradients. A bf16 main grad holds a step's first gradient and turns fp32 at the second."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from models import build_model
from models.document_attention import DocumentAttention
from parallel.master_weights import MasterWeightAdamW, attach_main_grads
from parallel.native_runner import LocalRunner
from parallel.runner import MicroBatch
from parallel.shard_adamw import ShardLocalAdamW
from tests.dist_utils import run_world
from tests.parallel.test_runner import _batches, _critic, _logp


def _loss_fn(runner, batches):
    n_tok = sum(mb.input_ids.shape[1] - 1 for mb in batches)

    def loss_fn(h, k):
        loss = -_logp(runner, h, batches[k]).sum() / n_tok
        return loss, {"loss": loss.detach()}
    return loss_fn


def _value_loss_fn(runner, batches):
    def loss_fn(h, k):  # a critic's: no vocab-sharded head under TP
        loss = F.linear(h, runner.head("score")[0]).float().square().mean() / len(batches)
        return loss, {"loss": loss.detach()}
    return loss_fn


def _steps(runner, opt, n: int, device: str = "cpu", loss=_loss_fn, micro: int = 4) -> list[tuple[float, float]]:
    """n clipped optimizer steps over the first `micro` of the 4 uneven micro-batches: [(summed loss, grad norm)]."""
    batches = [MicroBatch(mb.input_ids.to(device), mb.position_ids.to(device)) for mb in _batches()[:micro]]
    out = []
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        metrics = runner.forward_backward(batches, loss_fn=loss(runner, batches))
        norm = runner.optimizer_step(opt, max_norm=0.05)  # small: the clip scales the gradients
        out.append((float(sum(m["loss"] for m in metrics)), norm))
    return out


def _fp32_weights(runner, opt) -> dict[str, torch.Tensor]:
    """HF name -> the fp32 weight: the optimizer's master (16-bit params) or the parameter itself (FSDP)."""
    out = {}
    for n, p in runner.named_parameters():
        w = opt.state[p]["master"] if "master" in opt.state[p] else p
        out[n] = (w.to_local() if hasattr(w, "to_local") else w).detach().clone()
    return out


def _runner(*, fsdp: bool, mesh, dims, device: str = "cpu"):
    from parallel.apply import parallelize_model

    # both start from the bf16 rounding of the weights: the 16-bit layout's masters begin there
    model = build_model("tiny", seed=3).to(torch.bfloat16).float().to(device)
    return parallelize_model(model, mesh=mesh, dims=dims, param_dtype=torch.bfloat16, fsdp=fsdp,
                             attn_factory=DocumentAttention)


@contextlib.contextmanager
def _world_of_one(backend: str = "gloo", device: str = "cpu"):
    from parallel.dims import ParallelDims, build_mesh

    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    dims = ParallelDims(tp=1, pp=1, dp=1)
    try:
        yield build_mesh(dims, [0], device_type=device), dims
    finally:
        dist.destroy_process_group()


def _layouts_agree(device: str, backend: str, *, exact: bool, micro: int = 4):
    with _world_of_one(backend, device) as (mesh, dims):
        fsdp = _runner(fsdp=True, mesh=mesh, dims=dims, device=device)
        mine = _runner(fsdp=False, mesh=mesh, dims=dims, device=device)
        assert all(p.dtype == torch.bfloat16 and not hasattr(p, "to_local") for p in mine.parameters())
        opts = [r.build_optimizer(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1) for r in (fsdp, mine)]
        assert type(opts[0]) is ShardLocalAdamW and type(opts[1]) is MasterWeightAdamW
        want_steps = _steps(fsdp, opts[0], 3, device, micro=micro)
        got_steps = _steps(mine, opts[1], 3, device, micro=micro)
        if exact:  # losses and (clipped) grad norms
            assert want_steps == got_steps
        else:
            assert got_steps == pytest.approx(want_steps, rel=1e-5)
        want, got = _fp32_weights(fsdp, opts[0]), _fp32_weights(mine, opts[1])
        for n, p in mine.named_parameters():
            assert got[n].dtype == torch.float32, n
            if exact:
                assert torch.equal(got[n], want[n]), n
            else:
                torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-5, msg=n)
            assert torch.equal(p.detach(), got[n].to(torch.bfloat16)), n  # the weights the forward reads
            st = opts[1].state[p]
            assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32, n
            # the bf16 grads were folded in; one micro-batch's stays as it came (its fp32 sum, exactly)
            assert p.grad is None and p.main_grad.dtype == (torch.float32 if micro > 1 else torch.bfloat16), n
        name = "model.layers.0.mlp.up_proj.weight"
        assert not torch.equal(got[name].cpu(), dict(build_model("tiny", seed=3).named_parameters())[name])
        mine.release_gradients()
        assert all(p.main_grad is None for p in mine.parameters())


@pytest.mark.parametrize("micro", [4, 1])
def test_main_grads_equal_fsdp_mixed_precision(micro):
    _layouts_agree("cpu", "gloo", exact=True, micro=micro)


@pytest.mark.gpu
@pytest.mark.parametrize("micro", [4, 1])
def test_gpu_main_grads_match_fsdp_mixed_precision(micro):
    """FSDP2's side steps with torch's fused AdamW, ours with the Triton kernel (parallel/triton_adamw.py);
    cuBLAS may pick other kernels for the two layouts' GEMMs: to rounding."""
    _layouts_agree("cuda", "nccl", exact=False, micro=micro)


def test_first_gradient_stays_16_bit_and_the_second_sums_in_fp32():
    torch.manual_seed(0)
    plain = torch.nn.Linear(16, 8).to(torch.bfloat16)
    hooked = torch.nn.Linear(16, 8).to(torch.bfloat16)
    hooked.load_state_dict(plain.state_dict())
    attach_main_grads(hooked)
    x = torch.randn(2, 3, 16).to(torch.bfloat16)
    want = []
    for part in x:  # each micro-batch's own bf16 gradient, from the model without hooks
        plain.zero_grad()
        plain(part).float().square().sum().backward()
        want.append(plain.weight.grad.clone())
    hooked(x[0]).float().square().sum().backward()
    w = hooked.weight
    assert w.grad is None and w.main_grad.dtype == torch.bfloat16 and torch.equal(w.main_grad, want[0])
    hooked(x[1]).float().square().sum().backward()
    assert w.main_grad.dtype == torch.float32 and torch.equal(w.main_grad, want[0].float() + want[1].float())


def _accumulate_and_compare(plain, hooked, micro_batches) -> None:
    """Backward every micro-batch through `hooked` (main grads) and `plain` (each bf16 gradient summed in fp32
    here): the main grads must equal those sums exactly, with no gradient left in .grad."""
    want = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in plain.named_parameters()}
    for part in micro_batches:
        plain.zero_grad()
        plain(part).float().square().sum().backward()
        for n, p in plain.named_parameters():
            want[n] += p.grad.float()
        hooked(part).float().square().sum().backward()
    for n, p in hooked.named_parameters():
        assert p.grad is None and p.main_grad.dtype == torch.float32 and torch.equal(p.main_grad, want[n]), n


@pytest.mark.parametrize("bucket_bytes", [1, 200, 1 << 30], ids=["per-parameter", "mid-backward", "end-only"])
def test_bucketed_main_grads_equal_per_parameter_sums_over_micro_batches(monkeypatch, bucket_bytes):
    # later gradients wait in a bucket added by one foreach call when it fills (or at the end of the backward):
    # the same fp32 sums as adding each gradient alone, wherever the bucket is cut; nothing is left pending
    from parallel.master_weights import _Accumulator

    monkeypatch.setattr(_Accumulator, "BUCKET_BYTES", bucket_bytes)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).to(torch.bfloat16)
    hooked = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).to(torch.bfloat16)
    hooked.load_state_dict(plain.state_dict())
    attach_main_grads(hooked)
    x = torch.randn(4, 3, 16).to(torch.bfloat16)
    _accumulate_and_compare(plain, hooked, x)


def test_a_backward_that_raises_leaves_nothing_pending_for_the_retry(monkeypatch):
    # a CUDA OOM mid-backward: the update zeroes the gradients and reruns; what the failed backward left in the
    # bucket (its end-of-backward flush never ran) must not reach the retry's main grads
    from parallel.master_weights import MasterWeightAdamW, _Accumulator

    monkeypatch.setattr(_Accumulator, "BUCKET_BYTES", 1 << 30)

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("CUDA out of memory (simulated)")

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).to(torch.bfloat16)
    hooked = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).to(torch.bfloat16)
    hooked.load_state_dict(plain.state_dict())
    attach_main_grads(hooked)
    opt = MasterWeightAdamW(list(hooked.parameters()), lr=1e-3)
    x = torch.randn(3, 3, 16).to(torch.bfloat16)
    for part in x[:2]:
        hooked(part).float().square().sum().backward()
    with pytest.raises(RuntimeError, match="simulated"):  # the second layer's gradients arrive, then it raises
        hooked[1](Boom.apply(hooked[0](x[2]))).float().square().sum().backward()
    opt.zero_grad(set_to_none=True)
    _accumulate_and_compare(plain, hooked, x[:2])


def test_checkpoint_round_trip_keeps_fp32_masters():
    with _world_of_one() as (mesh, dims):
        _checkpoint_round_trip(mesh, dims)


def _checkpoint_round_trip(mesh, dims):
    a, b = _runner(fsdp=False, mesh=mesh, dims=dims), _runner(fsdp=False, mesh=mesh, dims=dims)
    opt_a = a.build_optimizer(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt_b = b.build_optimizer(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    _steps(a, opt_a, 2)
    b.load_checkpoint_state(opt_b, a.checkpoint_state(opt_a))
    for pa, pb in zip(a.parameters(), b.parameters()):
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert opt_b.state[pb][k].dtype == torch.float32 and torch.equal(opt_a.state[pa][k], opt_b.state[pb][k])
    assert _steps(a, opt_a, 1) == _steps(b, opt_b, 1)
    assert all(torch.equal(x, y) for x, y in zip(_fp32_weights(a, opt_a).values(), _fp32_weights(b, opt_b).values()))
    # the checkpoint is FSDP2's format (fp32 parameters, no masters in the optimizer state): either layout
    # resumes from the other's, with the same fp32 weights
    saved = a.checkpoint_state(opt_a)
    assert all(v.dtype == torch.float32 for v in saved["params"].values())
    assert not any("master" in st for st in saved["optim"]["state"].values())
    fsdp = _runner(fsdp=True, mesh=mesh, dims=dims)
    opt_f = fsdp.build_optimizer(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    fsdp.load_checkpoint_state(opt_f, saved)
    assert all(torch.equal(x, y) for x, y in zip(_fp32_weights(a, opt_a).values(), _fp32_weights(fsdp, opt_f).values()))
    _steps(fsdp, opt_f, 1)
    c = _runner(fsdp=False, mesh=mesh, dims=dims)
    opt_c = c.build_optimizer(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    c.load_checkpoint_state(opt_c, fsdp.checkpoint_state(opt_f))
    assert all(torch.equal(x, y) for x, y in zip(_fp32_weights(fsdp, opt_f).values(), _fp32_weights(c, opt_c).values()))
    assert _steps(fsdp, opt_f, 1) == _steps(c, opt_c, 1)


def _two_steps(runner, opt, loss=_loss_fn) -> tuple[list, dict[str, torch.Tensor]]:
    """Two clipped steps' (loss, norm), and the first step's main grads (the clip scales them inside the update, not in
    place), taken before any update moved the weights: Adam's ~lr steps would amplify rounding differences in the
    second's."""
    first = _steps(runner, opt, 1, loss=loss)
    grads = _main_grads(runner)
    return first + _steps(runner, opt, 1, loss=loss), grads


def _main_grads(runner) -> dict[str, torch.Tensor]:
    return {n: (p.main_grad.full_tensor() if hasattr(p.main_grad, "full_tensor") else p.main_grad).clone()
            for n, p in runner.named_parameters()}


def _single_process(model, loss=_loss_fn):
    model = model.to(torch.bfloat16)
    attach_main_grads(model)
    runner = LocalRunner(model, attn_factory=DocumentAttention)
    opt = runner.build_optimizer(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    return _two_steps(runner, opt, loss)


def _layouts_body(rank, world):
    from parallel.apply import parallelize_model
    from parallel.dims import ParallelDims, build_mesh

    dims = ParallelDims(pp=2)
    runner = parallelize_model(build_model("tiny-qwen3", seed=0), mesh=build_mesh(dims, [0, 1], device_type="cpu"),
                               dims=dims, n_microbatches=4, param_dtype=torch.bfloat16, attn_factory=DocumentAttention)
    opt = runner.build_optimizer(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    assert isinstance(opt, MasterWeightAdamW)
    pp2 = *_two_steps(runner, opt), _fp32_weights(runner, opt), runner.has_last
    # tp = 2: DTensor parameters, so DTensor main grads (a Replicate norm weight's too) and masters
    dims = ParallelDims(tp=2)
    runner = parallelize_model(_critic(), mesh=build_mesh(dims, [0, 1], device_type="cpu"),
                               dims=dims, param_dtype=torch.bfloat16, attn_factory=DocumentAttention)
    opt = runner.build_optimizer(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    tp2 = _two_steps(runner, opt, _value_loss_fn)
    p = dict(runner.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    assert hasattr(p.main_grad, "to_local") and hasattr(opt.state[p]["master"], "to_local")
    return pp2, tp2


def _close(grads: dict, ref: dict, tied: str | None = None) -> None:
    for n, g in grads.items():
        want = ref[tied if n == "lm_head.weight" and tied else n]
        assert (g - want).abs().max() <= 0.03 * want.abs().max() + 1e-7, n


@pytest.mark.distributed
def test_pipeline_and_tensor_parallel_main_grads_match_the_single_process_runner():
    ref_steps, ref_grads = _single_process(build_model("tiny-qwen3", seed=0))
    out = run_world(_layouts_body, 2)
    res = [pp2 for pp2, _ in out]
    steps = next(s for s, _, _, last in res if last)
    for (loss, norm), (want_loss, want_norm) in zip(steps, ref_steps, strict=True):
        # the pipeline pads its micro-batches to one length: bf16 sums in another order, not bit for bit
        assert loss == pytest.approx(want_loss, rel=1e-2) and norm == pytest.approx(want_norm, rel=2e-2)
    tied = [w.get("lm_head.weight", w.get("model.embed_tokens.weight")) for _, _, w, _ in res]
    assert torch.equal(tied[0], tied[1])  # both stages' copies took the same fp32 step
    for _, grads, _, _ in res:  # the first step's fp32 gradients, the tied head's the whole one
        _close(grads, ref_grads, tied="model.embed_tokens.weight")
    ref_steps, ref_grads = _single_process(_critic(), loss=_value_loss_fn)
    for steps, grads in (tp2 for _, tp2 in out):
        # bf16 TP partial sums differ in rounding; lr 1e-2 Adam steps move every weight by ~lr, so the second
        # step's loss drifts a little further than the first's
        assert steps[0] == pytest.approx(ref_steps[0], rel=1e-2) and steps[1] == pytest.approx(ref_steps[1], rel=5e-2)
        _close(grads, ref_grads)
