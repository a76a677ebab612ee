"""The split-K GEMM (rollout/triton_gemm.py) against an fp32 matmul, run by Triton's CPU interpreter
(TRITON_INTERPRET=1) in a child process; its F.linear fallback, launch chooser and custom op on CPU; and GPU
checks at llama-1b's decode shapes (determinism, CUDA graph replay, grids past one wave).

The interpreter runs programs one after another in pid order, so there the serial split-K never spins: it
checks the arithmetic, the summation order and the counter reset; the waiting is exercised on a GPU only."""

import os

import pytest
import torch
import torch.nn.functional as F

from tests.rollout.test_triton_attention import run_interpreted

pytest.importorskip("triton")

# (M, N, K) of llama-1b's decode projections: qkv, o_proj, gate_up, down_proj
LLAMA_1B = ((4096, 2048), (2048, 2048), (16384, 2048), (2048, 8192))


def test_kernel_equals_fp32_matmul_deterministically_with_either_reduction():
    out = run_interpreted("""
        import torch
        from rollout import triton_gemm
        from rollout.triton_gemm import decode_linear, splitk_linear
        gen = torch.Generator().manual_seed(0)

        def operands(m, n, k, dtype=torch.bfloat16):
            return (torch.randn(m, k, generator=gen).to(dtype),
                    (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype))

        def check(y, x, w):
            ref = x.float() @ w.float().T
            # one rounding to bf16 (the interpreter truncates: up to one ulp) after an fp32 sum
            err = (y.float() - ref).abs().max().item()
            assert y.dtype == x.dtype and y.shape == ref.shape and err <= 2 ** -7 * ref.abs().max().item(), err

        checked = 0
        # M = 1, 5 (partial row tiles), 32; N = 96 (a partial column tile); splits 1, 2, 4
        for m, n, k in ((1, 64, 128), (5, 96, 256), (32, 128, 256)):
            for bm, bn, bk in ((16, 32, 32), (32, 16, 16)):
                for split_k in (1, 2, 4):
                    config = dict(block_m=bm, block_n=bn, block_k=bk, split_k=split_k, num_warps=4, num_stages=2)
                    x, w = operands(m, n, k)
                    y = splitk_linear(x, w, **config)
                    check(y, x, w)
                    assert torch.equal(splitk_linear(x, w, **config), y), "a second call differs"
                    # the gather reduction adds in the same order: the same bits
                    assert torch.equal(splitk_linear(x, w, **config, reduce="gather"), y)
                    assert all(not c.any() for _, c in triton_gemm._SCRATCH.values()), "counters left nonzero"
                    x2, w2 = operands(m, n, k)  # the reset counters and cached workspace serve the next call
                    check(splitk_linear(x2, w2, **config), x2, w2)
                    checked += 1
        x, w = operands(5, 64, 128, torch.float16)
        check(splitk_linear(x, w, block_m=16, block_n=32, block_k=32, split_k=2, num_warps=4, num_stages=2), x, w)

        # decode_linear: leading dims flattened, the chooser's split (64 x 128 tiles, K / 4 = 256) taken
        x, w = operands(6, 128, 1024)
        assert triton_gemm.choose_config(6, 128, 1024, sm_count=16)["split_k"] == 4
        y = decode_linear(x.view(3, 2, 1024), w)
        assert y.shape == (3, 2, 128) and torch.equal(y.view(6, 128), splitk_linear(
            x, w, **triton_gemm.choose_config(6, 128, 1024, sm_count=16)))
        check(y.view(6, 128), x, w)
        # traced whole: the launch is chosen inside the opaque op, at run time
        step = torch.compile(decode_linear, fullgraph=True, backend="aot_eager")
        assert torch.equal(step(x.view(3, 2, 1024), w), y)

        utils = ("test_schema", "test_faketensor")
        torch.library.opcheck(splitk_linear, (x, w), dict(block_m=16, block_n=32, block_k=64, split_k=2,
                              num_warps=4, num_stages=2), test_utils=utils)
        torch.library.opcheck(triton_gemm._decode_linear_2d, (x, w), test_utils=utils)
        print("checked", checked)
    """)
    assert int(out.split()[-1]) == 18


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the fallback is for a Triton-less device")
def test_fallback_on_a_device_without_triton_equals_f_linear():
    from rollout.triton_gemm import decode_linear, splitk_linear

    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 3, 256, generator=gen).bfloat16(), torch.randn(64, 256, generator=gen).bfloat16()
    assert torch.equal(decode_linear(x, w), F.linear(x, w))
    assert torch.equal(decode_linear(x.float().transpose(0, 1), w.float()), F.linear(x.float().transpose(0, 1),
                                                                                      w.float()))
    config = dict(block_m=16, block_n=32, block_k=64, split_k=2, num_warps=4, num_stages=2)
    assert torch.equal(splitk_linear(x[0], w, **config), F.linear(x[0], w))
    # a config the GPU would refuse is refused here too, with the numbers
    with pytest.raises(ValueError, match=r"K\(256\) must be a multiple of split_k\(8\) \* block_k\(64\)"):
        splitk_linear(x[0], w, **(config | dict(split_k=8)))
    with pytest.raises(ValueError, match="power of two"):
        splitk_linear(x[0], w, **(config | dict(block_n=48)))
    with pytest.raises(ValueError, match="contiguous"):
        splitk_linear(x[0].float(), w.float(), **config)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the fallback is for a Triton-less device")
def test_custom_op_is_opaque_to_torch_compile_fullgraph():
    from rollout.triton_gemm import decode_linear, splitk_linear

    def step(x, w1, w2):  # a projection through the op, then through the chooser
        h = splitk_linear(x, w1, block_m=16, block_n=32, block_k=64, split_k=2, num_warps=4, num_stages=2)
        return decode_linear(torch.relu(h), w2)

    gen = torch.Generator().manual_seed(2)
    x, w1, w2 = (torch.randn(*s, generator=gen).bfloat16() for s in ((4, 128), (64, 128), (32, 64)))
    got = torch.compile(step, fullgraph=True)(x, w1, w2)
    assert torch.equal(got, F.linear(torch.relu(F.linear(x, w1)), w2))


def test_chooser_fills_one_wave_and_keeps_cublas_where_tiles_suffice():
    from rollout.triton_gemm import choose_config

    picks = {}
    for m in (32, 64, 256):
        for n, k in LLAMA_1B:
            c = choose_config(m, n, k, sm_count=132)
            picks[m, n, k] = c and c["split_k"]
            if c is not None:
                tiles = -(-m // c["block_m"]) * -(-n // c["block_n"])
                assert tiles * c["split_k"] <= 132 and k % (c["split_k"] * c["block_k"]) == 0, (m, n, k, c)
    assert picks[256, 2048, 2048] == 4 and picks[256, 2048, 8192] == 4 and picks[256, 4096, 2048] == 2
    assert picks[256, 16384, 2048] is None  # 256 tiles: more than a wave already
    assert picks[32, 2048, 2048] == 8
    assert choose_config(256, 2048, 2056, sm_count=132) is None  # K not a multiple of 2 * 64


@pytest.mark.gpu
def test_decode_linear_on_gpu_is_deterministic_and_graph_capturable():
    from rollout.triton_gemm import decode_linear, splitk_linear

    torch.manual_seed(0)
    dev = "cuda"
    for m in (32, 64, 256):
        for n, k in LLAMA_1B:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
            ref = F.linear(x.float(), w.float())
            y = decode_linear(x, w)
            err = (y.float() - ref).abs().max().item()
            assert err <= 2 ** -7 * ref.abs().max().item(), (m, n, k, err)
            assert torch.equal(decode_linear(x, w), y), (m, n, k)

    # past one wave (2048 programs for 132 SMs), 8 splits: split-major order keeps the spinning deadlock-free
    x = torch.randn(256, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 2048, device=dev, dtype=torch.bfloat16) * 2048 ** -0.5
    config = dict(block_m=64, block_n=64, block_k=64, split_k=8, num_warps=4, num_stages=3)
    y = splitk_linear(x, w, **config)
    ref = F.linear(x.float(), w.float())
    assert (y.float() - ref).abs().max().item() <= 2 ** -7 * ref.abs().max().item()
    for _ in range(20):
        assert torch.equal(splitk_linear(x, w, **config), y)
        assert torch.equal(splitk_linear(x, w, **config, reduce="gather"), y)

    # CUDA graph: capture once, replay with new inputs; the counters reset themselves between replays
    x = torch.randn(256, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16) * 2048 ** -0.5
    step = torch.compile(decode_linear, fullgraph=True)
    want = step(x, w)  # compiles, allocates the workspace and warms up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(x, w)
    for _ in range(2):
        graph.replay()
        assert torch.equal(out, want)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, decode_linear(x, w))
