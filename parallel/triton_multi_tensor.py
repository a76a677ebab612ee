"""Multi-tensor launches on CUDA: one Triton kernel over a list of tensors, found through a device table, and the
fp32 gradient accumulation that uses it (parallel/master_weights.py).

    table = launch_table([grads, weights], chunk=8192)    # addresses, lengths, first program ids; one upload
    accumulate_(main_grads, grads)                        # main_grads (fp32) += grads (any float dtype), one launch

Why: torch's `_foreach_add_` has a fused multi-tensor path only when every tensor has one dtype; fp32 main grads
plus bf16 gradients take its slow path, one elementwise kernel per tensor (13,020 kernels in one update of the
Qwen3-0.6B recipe on an H100, 137 ms of device time, each launched after the last). Here a bucket of them is one
launch.

The table (parallel/triton_adamw.py uses it too): each list's element addresses, then every tensor's length, then
the first program id of each tensor, in one int64 tensor uploaded by a pinned asynchronous copy (a pageable one
would synchronise the stream first). A program takes CHUNK elements of one tensor, found by a search over the first
program ids, so tensors of any lengths share one launch.

Numerics: each element is the fp32 sum `acc + float(grad)`, as torch's add computes it: equal bit for bit
(tests/parallel/test_triton_multi_tensor.py, under Triton's interpreter on CPU and natively on a GPU).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from models.triton_support import triton_runs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: callers keep their torch path
    triton = None

MAX_TENSORS = 1024  # per launch: the program -> tensor search reads this many first-program ids
ADD_CHUNK = 8192  # elements per program of the accumulation
ADD_BLOCK = 1024
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def available(device: torch.device | str) -> bool:
    """Whether the kernels can run on `device`: CUDA with triton, or triton's CPU interpreter."""
    return triton_runs(device)


@dataclass
class LaunchTable:
    """A multi-tensor launch's device table (see the module docstring) and what the kernel is told about it."""

    addrs: torch.Tensor  # [lists x T]: list k's addresses at k * T
    numels: torch.Tensor  # [T]
    firsts: torch.Tensor  # [T]: each tensor's first program id
    tensors: int  # T
    programs: int  # the launch's grid
    aligned: bool  # every address 16-byte aligned
    align: list[int]  # per list: the alignment (bytes) to claim, so that every tensor takes one element count a vector
    tpad: int  # T rounded up to a power of two (at least 16): the search's width


def launch_table(lists: list[list[torch.Tensor]], *, chunk: int) -> LaunchTable | None:
    """The table of one launch over parallel `lists` (the first list's lengths count; at most MAX_TENSORS
    tensors); None when they hold no element."""
    first = lists[0]
    t = len(first)
    numels = [x.numel() for x in first]
    programs = [-(-n // chunk) for n in numels]
    total = sum(programs)
    if total == 0:
        return None
    firsts = list(itertools.accumulate(programs, initial=0))[:-1]
    addrs = [x.data_ptr() for col in lists for x in col]
    table = torch.tensor(addrs + numels + firsts, dtype=torch.int64)
    if first[0].device.type == "cuda":
        table = table.pin_memory().to(first[0].device, non_blocking=True)
    a = len(lists) * t
    # 16 bytes for the widest elements, proportionally less for narrower ones: where 32-bit tensors take 4
    # elements per 16-byte vector, 16-bit ones are claimed 8-byte aligned only, so that they take 4 per vector too
    # (with 8, every fp32 store would first move its registers through shared memory to the 4-per-thread layout)
    widest = max(col[0].element_size() for col in lists)
    return LaunchTable(addrs=table[:a], numels=table[a: a + t], firsts=table[a + t:], tensors=t, programs=total,
                       aligned=all(x % 16 == 0 for x in addrs),
                       align=[16 * col[0].element_size() // widest for col in lists],
                       tpad=max(16, triton.next_power_of_2(t)))


if triton is not None:
    TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def find_tensor(first_ptr, numel_ptr, T, TPAD: tl.constexpr, CHUNK: tl.constexpr):
        """This program's tensor t, its first element and the tensor's length."""
        pid = tl.program_id(0)
        idx = tl.arange(0, TPAD)
        firsts = tl.load(first_ptr + idx, mask=idx < T, other=2147483647)
        t = tl.sum((firsts <= pid).to(tl.int32), axis=0) - 1  # the tensor whose programs hold pid
        base = (pid - tl.load(first_ptr + t)).to(tl.int64) * CHUNK
        return t, base, tl.load(numel_ptr + t)

    @triton.jit
    def _accumulate_kernel(addr_ptr, numel_ptr, first_ptr, T, ACC: tl.constexpr, GRAD: tl.constexpr,
                           ALIGNED: tl.constexpr, ALIGN_A: tl.constexpr, ALIGN_G: tl.constexpr, TPAD: tl.constexpr,
                           CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        t, base, n = find_tensor(first_ptr, numel_ptr, T, TPAD, CHUNK)
        a_ptr = tl.load(addr_ptr + t).to(tl.pointer_type(ACC))
        g_ptr = tl.load(addr_ptr + T + t).to(tl.pointer_type(GRAD))
        if ALIGNED:
            a_ptr = tl.multiple_of(a_ptr, ALIGN_A)
            g_ptr = tl.multiple_of(g_ptr, ALIGN_G)
        # a length read from memory says nothing about divisibility, so a masked access is element-wise: whole
        # chunks (all but each tensor's last) run unmasked
        if base + CHUNK <= n:
            for i in range(0, CHUNK, BLOCK):
                offs = base + i + tl.arange(0, BLOCK)
                tl.store(a_ptr + offs, tl.load(a_ptr + offs) + tl.load(g_ptr + offs).to(tl.float32))
        else:
            for i in range(0, CHUNK, BLOCK):
                offs = base + i + tl.arange(0, BLOCK)
                ok = offs < n
                a = tl.load(a_ptr + offs, mask=ok, other=0.0)
                tl.store(a_ptr + offs, a + tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32), mask=ok)


def accumulate_(accs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """accs[i] += grads[i] in place: accs fp32, grads of one float dtype, both contiguous and of equal lengths,
    on one device where `available`. One launch per MAX_TENSORS tensors."""
    if len(accs) != len(grads):
        raise ValueError(f"parallel lists of different lengths: {len(accs)} and {len(grads)}")
    if not accs:
        return
    for what, col, dtypes in (("accs", accs, (torch.float32,)), ("grads", grads, FLOATS)):
        if len({(x.dtype, x.device) for x in col}) != 1 or not all(x.is_contiguous() for x in col):
            raise ValueError(f"{what}: tensors of one dtype and device, contiguous, are needed")
        if col[0].dtype not in dtypes:
            raise ValueError(f"{what}: {col[0].dtype} is not one of {dtypes}")
    if any(a.numel() != g.numel() for a, g in zip(accs, grads)):
        raise ValueError("every accumulator must have its gradient's length")
    for lo in range(0, len(accs), MAX_TENSORS):
        part = [accs[lo: lo + MAX_TENSORS], grads[lo: lo + MAX_TENSORS]]
        table = launch_table(part, chunk=ADD_CHUNK)
        if table is None:
            continue
        _accumulate_kernel[(table.programs,)](
            table.addrs, table.numels, table.firsts, table.tensors, ACC=tl.float32, GRAD=TL_DTYPE[grads[0].dtype],
            ALIGNED=table.aligned, ALIGN_A=table.align[0], ALIGN_G=table.align[1], TPAD=table.tpad, CHUNK=ADD_CHUNK,
            BLOCK=ADD_BLOCK, num_warps=4)
