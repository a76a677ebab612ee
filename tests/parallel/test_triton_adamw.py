"""The Triton master-weight AdamW step (parallel/triton_adamw.py) against torch's single-tensor AdamW, a naive
reference: the fp32 masters and moments agree to fp32 rounding over several steps, for bf16 and fp32 gradients,
with and without 16-bit weights, across tensor and chunk boundaries and split launches. MasterWeightAdamW with
the kernel steps like its torch path, counts its steps on the host and resumes from a checkpoint of the torch
path. The CPU tests run the kernel under Triton's interpreter in a child process; the GPU test runs it natively
on llama-shaped tensors. In both the bf16 weights are exactly the masters' rounding."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interp import run_interpreted

pytest.importorskip("triton")

# each step of the kernel against torch's single-tensor AdamW run from the same state on fp32 copies (the
# reference rounds to 16 bits where the kernel stores 16 bits); the kernel's chunks are made small so that a
# tensor spans several programs and a launch several tensors
_REFERENCE = """
import torch
import parallel.triton_adamw as K
from parallel.triton_adamw import adamw_

KW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

def reference(ws, ms, vs, grads, step, scale):
    params = [torch.nn.Parameter(w.float().clone()) for w in ws]
    opt = torch.optim.AdamW(params, **KW, foreach=False)
    for p, m, v, g in zip(params, ms, vs, grads):
        p.grad = g.float() * scale
        opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.float().clone(),
                        "exp_avg_sq": v.float().clone()}
    opt.step()
    return [p.detach() for p in params], [opt.state[p]["exp_avg"] for p in params], \
        [opt.state[p]["exp_avg_sq"] for p in params]

def close(got, want, what):
    if got.dtype == torch.float32:  # the lerp's g - m cancels: a few ulps of the gradient's scale, not of m's
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7, msg=what)
        return
    # 16 bits: the fp32 results agree to rounding, so their roundings are equal but where they straddle a tie;
    # where the step cancels the weight (w ~ lr), fp32 rounding of the O(1) inputs (1e-6 absolute) can be
    # several 16-bit ulps of the tiny result
    rounded = want.to(got.dtype)
    ulp = want.abs().to(got.dtype).float() * 2 ** -7
    assert ((got.float() - rounded.float()).abs() <= ulp + 1e-6).all(), what
    assert (got == rounded).float().mean() > 0.99, what

def run(shapes, grad, weight, moment, copy, steps=3, scale=0.5, device="cpu"):
    torch.manual_seed(0)
    ws = [torch.randn(s, device=device).to(weight) for s in shapes]
    ms = [torch.zeros(s, device=device, dtype=moment) for s in shapes]
    vs = [torch.zeros(s, device=device, dtype=moment) for s in shapes]
    cs = [w.to(copy) for w in ws] if copy is not None else None
    for step in range(1, steps + 1):
        grads = [torch.randn(s, device=device).to(grad) for s in shapes]
        want = reference(ws, ms, vs, grads, step, scale)
        adamw_(grads, ws, ms, vs, cs, **KW, step=step, grad_scale=scale)
        for name, got, ref in zip(("weight", "exp_avg", "exp_avg_sq"), (ws, ms, vs), want):
            for i, (g, r) in enumerate(zip(got, ref)):
                close(g, r, f"step {step} {name} {i}")
        for c, w in zip(cs or [], ws):  # the 16-bit weights: exactly the masters' rounding, as torch copies it
            assert torch.equal(c, w.to(copy))
"""

# (grad, weight, moments, 16-bit copy): fp32 masters with one micro-batch's bf16 main grads or summed fp32 ones;
# plain fp32 training; bf16 weights and moments (the bf16 LM step)
_CASES = {"master_bf16_grads": "torch.bfloat16, torch.float32, torch.float32, torch.bfloat16",
          "master_fp32_grads": "torch.float32, torch.float32, torch.float32, torch.bfloat16",
          "fp32": "torch.float32, torch.float32, torch.float32, None",
          "bf16": "torch.bfloat16, torch.bfloat16, torch.bfloat16, None"}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_kernel_steps_like_torch_adamw(case):
    run_interpreted(_REFERENCE + f"""
K.CHUNK, K.BLOCK, K.MAX_TENSORS = 64, 16, 3  # tensors over several programs, 5 tensors in two launches
run([(37,), (8, 16), (200,), (1,), (3, 65)], {_CASES[case]})
print("ok")
""")


def test_master_weight_adamw_kernel_steps_like_its_torch_path_and_resumes():
    run_interpreted("""
import torch
import parallel.triton_adamw as K
from parallel.master_weights import MasterWeightAdamW, attach_main_grads
K.CHUNK, K.BLOCK = 64, 16
torch.manual_seed(0)

def model():
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(8, 40), torch.nn.Linear(40, 3)).to(torch.bfloat16)
    m.gain = torch.nn.Parameter(torch.randn(3))  # an fp32 parameter: its own master, stepped in place
    attach_main_grads(m)
    return m

def steps(m, opt, xs, micro):
    for x in xs:
        for part in x.chunk(micro):
            (m(part.to(torch.bfloat16)).float() * m.gain).square().sum().backward()
        opt.step(grad_scale=0.5)
        opt.zero_grad()

def close(oa, a, ob, b):
    for pa, pb in zip(a.parameters(), b.parameters()):
        sa, sb = oa.state[pa], ob.state[pb]
        assert float(sa["step"]) == float(sb["step"])
        for k in ("exp_avg", "exp_avg_sq") + (("master",) if "master" in sb else ()):
            torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=1e-8)
        if "master" in sa:
            assert torch.equal(pa.detach(), sa["master"].to(torch.bfloat16))
        else:
            torch.testing.assert_close(pa.detach(), pb.detach(), rtol=1e-5, atol=1e-8)
            assert pa.dtype == torch.float32 and not hasattr(pa, "main_grad")

xs = [torch.randn(4, 8) for _ in range(3)]
for micro in (1, 2):  # one micro-batch: 16-bit main grads; two: fp32 ones
    a, b = model(), model()
    oa = MasterWeightAdamW(a.parameters(), lr=1e-2, weight_decay=0.1, kernel=True)
    ob = MasterWeightAdamW(b.parameters(), lr=1e-2, weight_decay=0.1, kernel=False)
    for x in xs:
        steps(a, oa, [x], micro)
        steps(b, ob, [x], micro)
        close(oa, a, ob, b)
        # the paths round differently in the last bit, and a flipped bf16 weight moves the next gradient:
        # each step starts the torch path from the kernel's state (a checkpoint of the one loaded by the other)
        b.load_state_dict(a.state_dict())
        ob.load_state_dict(oa.state_dict())
    assert all(st["step"].device.type == "cpu" and float(st["step"]) == 3 for st in oa.state.values())

    # a checkpoint of the torch path resumes under the kernel
    c = model()
    oc = MasterWeightAdamW(c.parameters(), lr=1e-2, weight_decay=0.1, kernel=True)
    c.load_state_dict(b.state_dict())
    oc.load_state_dict(ob.state_dict())
    assert all(st["step"].device.type == "cpu" for st in oc.state.values())
    more = [torch.randn(4, 8)]
    steps(b, ob, more, micro)
    steps(c, oc, more, micro)
    close(oc, c, ob, b)
print("ok")
""")


def test_mismatched_lists_are_refused():
    from parallel.triton_adamw import adamw_

    g, w = [torch.zeros(4, dtype=torch.bfloat16)], [torch.zeros(4)]
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, step=1)
    with pytest.raises(ValueError, match="different lengths"):
        adamw_(g, w, w, [], None, **kw)
    with pytest.raises(ValueError, match="one dtype"):
        adamw_(g, w, w, g, None, **kw)
    with pytest.raises(ValueError, match="copies"):
        adamw_(g, g, w, w, g, **kw)
    with pytest.raises(ValueError, match="length"):
        adamw_(g, [torch.zeros(5)], w, w, None, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(_CASES))
def test_gpu_kernel_steps_like_torch_adamw(case):
    """llama-1b's per-layer shapes plus a ragged one, default chunking, on the device."""
    ns: dict = {}
    exec(_REFERENCE, ns)
    shapes = [(2048, 2048), (512, 2048), (8192, 2048), (2048,), (1000, 37)]
    ns["run"](shapes, *eval(_CASES[case]), device="cuda")
