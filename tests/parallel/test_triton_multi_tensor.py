"""The multi-tensor accumulation kernel (parallel/triton_multi_tensor.py) against torch's add, a naive reference:
fp32 accumulators plus 16-bit or fp32 gradients equal torch's fp32 sums bit for bit across chunk boundaries,
ragged lengths and split launches; the main-grad buckets of parallel/master_weights.py give the same sums through
it. The CPU tests run the kernel under Triton's interpreter in a child process; the GPU test runs it natively."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interp import run_interpreted

pytest.importorskip("triton")

_REFERENCE = """
import torch
from parallel.triton_multi_tensor import accumulate_

def run(shapes, grad_dtype, device="cpu"):
    torch.manual_seed(0)
    accs = [torch.randn(s, device=device) for s in shapes]
    for _ in range(2):
        grads = [torch.randn(s, device=device).to(grad_dtype) for s in shapes]
        want = [a + g.float() for a, g in zip(accs, grads)]
        accumulate_(accs, grads)
        for i, (a, w) in enumerate(zip(accs, want)):
            assert torch.equal(a, w), (i, (a - w).abs().max())
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_accumulation_equals_torch_add(dtype):
    run_interpreted(_REFERENCE + f"""
import parallel.triton_multi_tensor as K
K.ADD_CHUNK, K.ADD_BLOCK, K.MAX_TENSORS = 64, 16, 3  # tensors over several programs, 5 tensors in two launches
run([(37,), (8, 16), (200,), (1,), (3, 65)], torch.{dtype})
print("ok")
""")


def test_main_grad_buckets_sum_through_the_kernel():
    # parallel/master_weights.py's buckets, with the kernel in place of the foreach add: the main grads are the
    # fp32 sums of every micro-batch's bf16 gradient, bit for bit
    run_interpreted("""
import torch
import parallel.triton_multi_tensor as K
from parallel.master_weights import _Accumulator, attach_main_grads
from tests.parallel.test_master_weights import _accumulate_and_compare
calls = []
kernel = K.accumulate_
K.accumulate_ = lambda accs, grads: (calls.append(len(accs)), kernel(accs, grads))
K.ADD_CHUNK, K.ADD_BLOCK = 64, 16
_Accumulator.BUCKET_BYTES = 1 << 30
torch.manual_seed(0)
plain = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).to(torch.bfloat16)
hooked = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).to(torch.bfloat16)
hooked.load_state_dict(plain.state_dict())
attach_main_grads(hooked)
_accumulate_and_compare(plain, hooked, torch.randn(3, 4, 16).to(torch.bfloat16))
assert calls == [4, 4], calls  # one launch per backward after the first, each over the four parameters
print("ok")
""")


def test_mismatched_lists_are_refused():
    from parallel.triton_multi_tensor import accumulate_

    a, g = [torch.zeros(4)], [torch.zeros(4, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="different lengths"):
        accumulate_(a, g + g)
    with pytest.raises(ValueError, match="accs"):
        accumulate_(g, g)
    with pytest.raises(ValueError, match="one dtype"):
        accumulate_(a + a, g + [torch.zeros(4)])
    with pytest.raises(ValueError, match="length"):
        accumulate_([torch.zeros(5)], g)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_accumulation_equals_torch_add(dtype):
    """Qwen3-0.6B's per-layer shapes plus a ragged one, default chunking, on the device."""
    ns: dict = {}
    exec(_REFERENCE, ns)
    ns["run"]([(1024, 2048), (1024, 1024), (3072, 1024), (1024, 3072), (128,), (1000, 37)], dtype, device="cuda")
