"""A split-K Triton GEMM for the decode step's projections, y = x @ W^T with a deterministic reduction.

    y = decode_linear(x, w)     # x [..., K], w [N, K] (nn.Linear layout) -> [..., N]; F.linear where it declines
    y = splitk_linear(x, w, block_m=128, block_n=128, block_k=64, split_k=4, num_warps=8, num_stages=4)

Why: at decode sizes the output has too few tiles for the GPU. At M = 256 rows, o_proj (N = K = 2048) has
32 tiles of 128 x 128 for 132 SMs, and cuBLAS reaches 41% of the shape's ceiling (down_proj 54%, qkv 55%;
bench/results/decode_gemm_256_h200.json). Split-K gives each SM a tile and a K-slice of it: program
(s, tile) sums x[tile rows, slice s] @ W[tile cols, slice s]^T in fp32, and the SPLIT_K partials of a tile
are added in the fixed order 0, 1, .., SPLIT_K - 1 and rounded once, so the output is bitwise reproducible
(the engine's log-probs are compared with the trainer's). Two reductions, both in that order, so both give
the same bits:

  "serial": split s spins on the tile's int32 counter until it reads s, adds its partial into one fp32
            workspace tile (split 0 writes it) and moves the counter to s + 1; the last split adds the
            workspace to its partial, writes y and sets the counter back to 0.
  "gather": every split writes its partial to its own fp32 slice and bumps the counter; the one that
            draws the last ticket sums slices 0..SPLIT_K-1 in order, writes y and resets the counter. No
            program waits, and the adds are one step deep instead of SPLIT_K - 1 (serial chains them).

Ordering. Workspace and counters are allocated once per (device, M, N, slices) and cached; the counters
start at zero and every call leaves them at zero, so a CUDA graph replays the kernel with no memset. One
workspace serves one stream at a time (the engine's decode graph is one stream). Triton gives a scalar
atomic to one thread of the CTA (it broadcasts the result through shared memory), so before a counter
moves a CTA barrier puts every thread's workspace stores ahead of that thread's release atomic; the
acquire read that ends a wait is followed by a barrier, and workspace loads bypass L1 (.cg). Program ids
are split-major (pid = s * tiles + tile): the GPU hands out a 1-D grid's blocks in increasing index (what
NVIDIA hardware does, though CUDA does not promise it), so every split s - 1 program has started before
any split s program, and a spinning program never keeps one it waits for from an SM, even past one wave.
decode_linear keeps the grid within one wave anyway (tiles * split_k <= SMs).

SPLIT_K = 1 is the plain tiled kernel (no workspace). decode_linear declines (F.linear, i.e. cuBLAS) where
Triton does not run (models.triton_support.triton_runs), where x or w is not contiguous, for dtypes other
than bf16/fp16, or where the output already has a wave of tiles. A torch custom op, so torch.compile and
CUDA graph capture treat it as opaque. Not wired into the engine, and not yet timed on a GPU (its sm_90
PTX was read: wgmma, 16-byte cp.async pipelining, the atomics above); choose_config's table is a first
guess for `python -m bench.decode_gemm --rows 256` (variants "splitk": a sweep over both reductions, and
"splitk_auto": decode_linear) to replace. Under TRITON_INTERPRET=1 it runs on CPU tensors
(tests/rollout/test_triton_gemm.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from models.triton_support import triton_runs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: decode_linear is F.linear
    triton = None

REDUCTIONS = ("serial", "gather")
MIN_BLOCK = 16  # the smallest tile side (tl.dot's); the counters are sized for it, so any tiling fits

if triton is not None:

    @triton.jit
    def _splitk_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, tiles_m, n_tiles,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, SERIAL: tl.constexpr, UPCAST: tl.constexpr):
        pid = tl.program_id(0)
        s = pid // n_tiles  # split-major: see the module docstring (no deadlock past one wave)
        tile = pid - s * n_tiles
        # the m-tiles of one weight tile are neighbours: they run together and share its read (L2)
        tn = tile // tiles_m
        tm = tile - tn * tiles_m
        rm = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        steps = K // (SPLIT_K * BLOCK_K)
        k0 = s * steps * BLOCK_K  # (a visible multiple of BLOCK_K: 16-byte vector loads; K // SPLIT_K hides it)
        # rows past M / N load a clamped (valid) row instead of masking: unmasked loads pipeline better
        xm = tl.where(rm < M, rm, M - 1).to(tl.int64)
        wn = tl.where(rn < N, rn, N - 1).to(tl.int64)
        x_ptrs = x_ptr + xm[:, None] * K + (k0 + rk)[None, :]
        w_ptrs = w_ptr + wn[:, None] * K + (k0 + rk)[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for _ in range(steps):
            a, b = tl.load(x_ptrs), tl.load(w_ptrs)
            if UPCAST:  # the interpreter multiplies bf16 as its uint16 storage; fp32 products are exact anyway
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee" if UPCAST else None)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K

        mask = (rm < M)[:, None] & (rn < N)[None, :]
        offs = rm[:, None] * N + rn[None, :]
        y_ptrs = y_ptr + offs
        if SPLIT_K == 1:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        elif SERIAL:
            cnt = cnt_ptr + tile
            ws_ptrs = ws_ptr + offs
            if s > 0:
                while tl.atomic_add(cnt, 0, sem="acquire") != s:
                    pass
                tl.debug_barrier()  # no thread reads the workspace before thread 0 saw split s - 1's release
                acc += tl.load(ws_ptrs, mask=mask, other=0.0, cache_modifier=".cg")  # (p0 + .. + p_{s-1}) + p_s
            if s < SPLIT_K - 1:
                tl.store(ws_ptrs, acc, mask=mask)
                tl.debug_barrier()  # every thread's stores precede the release below
                tl.atomic_xchg(cnt, s + 1, sem="release")
            else:
                tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(cnt, 0, sem="relaxed")  # the next launch (stream-ordered) starts from 0
        else:
            cnt = cnt_ptr + tile
            ws_ptrs = ws_ptr + offs
            tl.store(ws_ptrs + s * M * N, acc, mask=mask)
            tl.debug_barrier()
            if tl.atomic_add(cnt, 1, sem="acq_rel") == SPLIT_K - 1:  # the last to arrive: all slices are written
                tl.debug_barrier()
                total = tl.load(ws_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                for j in tl.static_range(1, SPLIT_K):  # slice order, not arrival order: deterministic
                    total += tl.load(ws_ptrs + j * M * N, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(cnt, 0, sem="relaxed")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(device: torch.device, m: int, n: int, slices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 workspace [slices, M, N], zeroed int32 counters, one per MIN_BLOCK tile), made once per key. The
    first call of a shape should come before CUDA graph capture (the engine's warm-up is such a call)."""
    key = (device, m, n, slices)
    if key not in _SCRATCH:
        tiles = _cdiv(m, MIN_BLOCK) * _cdiv(n, MIN_BLOCK)
        _SCRATCH[key] = (torch.empty(slices, m, n, dtype=torch.float32, device=device),
                         torch.zeros(tiles, dtype=torch.int32, device=device))
    return _SCRATCH[key]


def _check(x: torch.Tensor, w: torch.Tensor, block_m: int, block_n: int, block_k: int, split_k: int,
           reduce: str) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x [M, K] and w [N, K] expected, got {tuple(x.shape)} and {tuple(w.shape)} "
                         "(decode_linear flattens leading dims)")
    if not (x.is_contiguous() and w.is_contiguous()) or x.dtype != w.dtype or x.dtype not in (
            torch.bfloat16, torch.float16):
        raise ValueError(f"x and w must be contiguous bf16/fp16 of one dtype, got {x.dtype} "
                         f"(contiguous {x.is_contiguous()}) and {w.dtype} (contiguous {w.is_contiguous()})")
    for name, b in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if b < MIN_BLOCK or b & (b - 1):
            raise ValueError(f"{name}({b}) must be a power of two >= {MIN_BLOCK}")
    k = x.shape[1]
    if split_k < 1 or k % (split_k * block_k):
        raise ValueError(f"K({k}) must be a multiple of split_k({split_k}) * block_k({block_k}); "
                         f"choose split_k or block_k so that it divides")
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce({reduce!r}) must be one of {REDUCTIONS}")


@torch.library.custom_op("hybridrl_rollout::splitk_linear", mutates_args=())
def splitk_linear(x: torch.Tensor, w: torch.Tensor, *, block_m: int, block_n: int, block_k: int, split_k: int,
                  num_warps: int, num_stages: int, reduce: str = "serial") -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] in x's dtype (bf16/fp16, both contiguous), fp32 accumulation, SPLIT_K
    programs per BLOCK_M x BLOCK_N output tile over K-slices of K / split_k (a multiple of block_k).
    `reduce` picks how the partials meet ("serial" or "gather", same bits). Where Triton does not run
    (a CPU tensor without TRITON_INTERPRET=1) it validates the config and returns F.linear(x, w)."""
    _check(x, w, block_m, block_n, block_k, split_k, reduce)
    if not triton_runs(x.device):
        return F.linear(x, w)
    (m, k), n = x.shape, w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    slices = split_k if split_k > 1 and reduce == "gather" else 1
    if slices * m * n >= 2 ** 31:  # the kernel's output / workspace offsets are int32
        raise ValueError(f"M({m}) * N({n}) * slices({slices}) must stay below 2**31; split the rows")
    tiles_m, tiles_n = _cdiv(m, block_m), _cdiv(n, block_n)
    if split_k == 1:
        ws, cnt = y, y  # unused: the SPLIT_K == 1 branch is compiled out
    else:
        ws, cnt = _scratch(x.device, m, n, slices)
    _splitk_kernel[(split_k * tiles_m * tiles_n,)](
        x, w, y, ws, cnt, m, n, k, tiles_m, tiles_m * tiles_n, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split_k, SERIAL=reduce == "serial", UPCAST=not x.is_cuda, num_warps=num_warps, num_stages=num_stages)
    return y


@splitk_linear.register_fake
def _splitk_linear_fake(x, w, *, block_m, block_n, block_k, split_k, num_warps, num_stages, reduce="serial"):
    return x.new_empty(x.shape[0], w.shape[0])


def choose_config(m: int, n: int, k: int, *, sm_count: int) -> dict | None:
    """The split-K launch for x [M, K] @ W[N, K]^T, or None where cuBLAS is kept (the output already has about
    a wave of tiles, or K is not a multiple of the tile's K). Tiles of 64 rows up to M = 64, else 128, by 128
    columns; the most splits (8, 4, 2) that keep tiles * split_k <= sm_count (one wave: every program has an
    SM) and leave each program >= 4 K-steps of 64 (enough to fill the software pipeline)."""
    block_m, block_n, block_k = (64 if m <= 64 else 128), 128, 64
    tiles = _cdiv(m, block_m) * _cdiv(n, block_n)
    for split_k in (8, 4, 2):
        if tiles * split_k <= sm_count and k % (split_k * block_k) == 0 and k // split_k >= 4 * block_k:
            return dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k,
                        num_warps=8 if block_m * block_n >= 128 * 128 else 4, num_stages=4, reduce="serial")
    return None


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # the interpreter: any number exercises the same code
    return torch.cuda.get_device_properties(device).multi_processor_count


@torch.library.custom_op("hybridrl_rollout::decode_linear_2d", mutates_args=())
def _decode_linear_2d(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """decode_linear on x [M, K]: the launch is chosen inside an op, so torch.compile never traces the device
    query or the table (and a compiled graph keeps choosing per call, like the eager one)."""
    config = choose_config(x.shape[0], w.shape[0], x.shape[1], sm_count=_sm_count(x.device))
    return F.linear(x, w) if config is None else splitk_linear(x, w, **config)


@_decode_linear_2d.register_fake
def _decode_linear_2d_fake(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


def decode_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T -> [..., N]: the split-K kernel with choose_config's launch where it applies,
    else F.linear (Triton does not run here, x or w not contiguous, not bf16/fp16, no split worth making)."""
    k = w.shape[-1]
    if not (x.shape[-1] == k and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and x.is_contiguous() and w.is_contiguous() and triton_runs(x.device)):
        return F.linear(x, w)
    return _decode_linear_2d(x.view(-1, k), w).view(*x.shape[:-1], w.shape[0])
