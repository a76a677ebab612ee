"""Unfiltered sampling (no top-k / top-p: what RL uses) as ONE Triton kernel, one program per row.

rollout/sampler.py's `sample(..., filtered=False)` is ~10 kernels over [B, V] fp32 (cast, divide,
log_softmax, exp, a slow vocab-long cumsum scan, searchsorted, argmax, gather). Here each program streams
its row of logits in BLOCK_V tiles, in the logits' own dtype:

  pass 1: each tile's max and sum of exp (fp32) of x = logits / T, kept in registers (a [TILES] vector),
          and the first index of the max (the greedy token);
  then:   the row's max and total from the tiles', and the first tile whose running mass reaches u * total;
  pass 2: that tile alone: tl.cumsum of exp(x - max) plus the mass before it, to the first index reaching
          u * total: the inverse-CDF draw of sampler.py with the same uniform u.

So a row reads its logits once plus one tile (mostly from L2), with no data-dependent loop.

    tokens, logprobs = sample_unfiltered(logits, temperature, uniforms)

Same meaning as `sample(..., filtered=False)`: T <= 0 is greedy (argmax, logprob at T = 1), else token =
the smallest j with cdf[j] >= u * cdf[V-1] and logprob = x[token] - logsumexp(x). The summation order
differs from torch's cumsum, so a sampled token can differ from sample()'s only when u lands within
float rounding of a CDF boundary (then both tokens are equally valid draws); logprobs agree to rounding.
A torch custom op, so torch.compile treats it as opaque and CUDA graphs capture it. Under TRITON_INTERPRET=1
it runs on CPU tensors (tests/rollout/test_triton_sampling.py checks it against sample() there).
"""

from __future__ import annotations

import torch

from models.triton_support import triton_runs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine then keeps sampler.sample
    triton = None


def available(device: torch.device) -> bool:
    """Whether the kernel can run here: CUDA with triton, or triton's CPU interpreter."""
    return triton_runs(device)


if triton is not None:

    @triton.jit
    def _draw(base, t, u_at, V, BLOCK_V: tl.constexpr, TILES: tl.constexpr):
        """(token, logprob) of the row of logits at `base` at temperature t (<= 0: greedy) for the uniform at
        `u_at`, read only once the first pass over the logits is done (off the critical path of their loads)."""
        greedy = t <= 0
        t = tl.where(greedy, 1.0, t)
        offs = tl.arange(0, BLOCK_V)
        tiles = tl.arange(0, TILES)

        # pass 1: each tile's max and sum of exp(x - tile max), kept in registers; the first index of the max
        t_max = tl.full([TILES], float("-inf"), tl.float32)
        t_sum = tl.zeros([TILES], tl.float32)
        m = tl.full([], float("-inf"), tl.float32)
        best = tl.zeros([], tl.int32)
        for i in range(0, tl.cdiv(V, BLOCK_V)):
            idx = i * BLOCK_V + offs
            # div_rn: IEEE division like torch's logits / T (Triton's `/` on fp32 is the approximate one)
            x = tl.math.div_rn(tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32), t)
            mx = tl.max(x, 0)
            best = tl.where(mx > m, i * BLOCK_V + tl.argmax(x, 0), best)  # strict: earlier tiles win ties
            m = tl.maximum(m, mx)
            sm = tl.sum(tl.exp(x - mx), 0)  # nan for an all -inf tile (masked tail, banned ids): mass 0 below
            t_max = tl.where(tiles == i, mx, t_max)
            t_sum = tl.where(tiles == i, sm, t_sum)

        # the tile holding the draw: the first whose running mass reaches u * total (rounding can leave u ~ 1
        # short of every tile: then the last tile with mass)
        mass = tl.where(t_max > float("-inf"), t_sum * tl.exp(t_max - m), 0.0)
        total = tl.sum(mass, 0)
        target = tl.load(u_at) * total
        cum = tl.cumsum(mass, 0)
        last_tile = tl.max(tl.where(mass > 0, tiles, 0), 0)
        k = tl.min(tl.where((cum >= target) & (mass > 0), tiles, last_tile), 0)
        before = tl.sum(tl.where(tiles < k, mass, 0.0), 0)

        # pass 2, that tile only: the first index whose running sum reaches the target (e > 0: never a token of
        # zero probability; if rounding leaves the target unmet, the tile's last token with mass)
        idx = k * BLOCK_V + offs
        ok = idx < V
        x = tl.math.div_rn(tl.load(base + idx, mask=ok, other=float("-inf")).to(tl.float32), t)
        e = tl.exp(x - m)
        cdf = tl.cumsum(e, 0) + before
        last = tl.max(tl.where(e > 0, idx, 0), 0)
        tok = tl.min(tl.where(ok & (e > 0) & (cdf >= target), idx, last), 0)
        tok = tl.where(greedy, best, tok)

        x_tok = tl.math.div_rn(tl.load(base + tok).to(tl.float32), t)
        return tok, x_tok - m - tl.log(total)

    @triton.jit
    def _sample_kernel(logits_ptr, temp_ptr, u_ptr, tok_ptr, lp_ptr, V, s_row,
                       BLOCK_V: tl.constexpr, TILES: tl.constexpr):
        row = tl.program_id(0)
        tok, lp = _draw(logits_ptr + row.to(tl.int64) * s_row, tl.load(temp_ptr + row), u_ptr + row, V, BLOCK_V,
                        TILES)
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(lp_ptr + row, lp)

    @triton.jit
    def _decode_tail_kernel(logits_ptr, meta_i_ptr, s_meta, temp_ptr, u_ptr, s_u, out_ptr, b, max_pos, V, s_row,
                            BLOCK_V: tl.constexpr, TILES: tl.constexpr):
        # row `row` of the engine's device-resident decode rows: meta_i[0] token, [1] position, [4] active
        row = tl.program_id(0)
        ids_at = meta_i_ptr + row
        pos_at = meta_i_ptr + s_meta + row
        pos = tl.load(pos_at)
        u_at = u_ptr + row.to(tl.int64) * s_u + pos + 1  # the uniform of the new token's position
        tok, lp = _draw(logits_ptr + row.to(tl.int64) * s_row, tl.load(temp_ptr + row), u_at, V, BLOCK_V, TILES)
        active = tl.load(meta_i_ptr + 4 * s_meta + row)
        tl.store(out_ptr + row, tok.to(tl.float64))
        tl.store(out_ptr + b + row, lp.to(tl.float64))
        # every program reads and writes its own row only: the in-place advance has no hazard
        tl.store(ids_at, tl.where(active > 0, tok.to(tl.int64), 0))
        tl.store(pos_at, tl.minimum(pos + active, max_pos))


def _config(vocab: int, interpret: bool) -> dict:
    """Launch constants, a function of the vocab alone: tile size and warps set the summation order, so a row's
    draw then never depends on the batch around it or on timing (no autotune). On a GPU 8192-wide tiles over 8
    warps: fastest at B = 256 on an H200 for V = 32k..152k (at B <= 64, 16 warps would be ~2 us faster; at
    B = 512, 2048 tiles over 4 warps ~7 us). Small tiles under the interpreter: several tiles on small test
    vocabs. TILES: a power of two >= the tile count, the length of the per-tile register vectors."""
    block, warps = (256, 4) if interpret else (min(8192, max(1024, triton.next_power_of_2(vocab))), 8)
    return dict(BLOCK_V=block, TILES=triton.next_power_of_2(triton.cdiv(vocab, block)), num_warps=warps)


@torch.library.custom_op("hybridrl_rollout::sample_unfiltered", mutates_args=())
def sample_unfiltered(logits: torch.Tensor, temperature: torch.Tensor,
                      uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (bf16 / fp16 / fp32), temperature [B] (<= 0: greedy), uniforms [B] in (0, 1) ->
    tokens [B] int64 and logprobs [B] fp32 = log softmax(logits / T)[token], T = 1 when greedy."""
    b, vocab = logits.shape
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    if b == 0:
        return tokens, logprobs
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    temperature = temperature.float().contiguous()
    uniforms = uniforms.float().contiguous()
    _sample_kernel[(b,)](logits, temperature, uniforms, tokens, logprobs, vocab, logits.stride(0),
                         **_config(vocab, interpret=not logits.is_cuda))
    return tokens, logprobs


@sample_unfiltered.register_fake
def _sample_unfiltered_fake(logits, temperature, uniforms) -> tuple[torch.Tensor, torch.Tensor]:
    b = logits.shape[0]
    return logits.new_empty(b, dtype=torch.int64), logits.new_empty(b, dtype=torch.float32)


# the tail kernel's register cap on CUDA: 256 threads a program, so at most 128 registers keep two programs per
# SM and a 256-row step in one wave. Uncapped, the few registers the row's advance adds over the draw's took it
# past 128 on an H200 (triton 3.6): 32.1 us a 256-row step against the draw's own 22.5; capped 21.1 (ptxas spills
# ~100 bytes), and 16.6 us at 32 rows either way (bench.decode_tail, bench/results/decode_tail_h200.json)
TAIL_MAXNREG = 128


def decode_tail(logits: torch.Tensor, meta_i: torch.Tensor, temperature: torch.Tensor, u_table: torch.Tensor,
                out: torch.Tensor, *, max_position: int, maxnreg: int | None = TAIL_MAXNREG) -> None:
    """The engine's decode step after its forward, as ONE kernel (it was ~12 at decode sizes: the uniforms'
    gather, the draw, two copies into `out`, and the rows' advance as clamp / add / where / copies, each a
    launch gap in the step's CUDA graph). For rows b < B = logits.shape[0]:

        u = u_table[b, meta_i[1, b] + 1]; (tok, lp) = the unfiltered draw of sample_unfiltered(logits[b], T[b], u)
        out[b], out[B + b] = tok, lp                         (float64)
        meta_i[0, b] = tok if meta_i[4, b] > 0 else 0        (the next step's token)
        meta_i[1, b] = min(meta_i[1, b] + meta_i[4, b], max_position)

    logits [B, V]; meta_i int64 [>= 5, slots] (rows: token, position, key, top_k, active), contiguous rows;
    temperature fp32 [>= B]; u_table fp32 [>= B, >= max position + 2]; out float64 [>= 2B]. Writes in place,
    in stream order (graph-capturable); not a custom op: the engine runs it outside torch.compile. maxnreg: the
    kernel's register cap on CUDA (None: ptxas's choice; see TAIL_MAXNREG)."""
    b, vocab = logits.shape
    if b == 0:
        return
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if meta_i.dtype != torch.int64 or meta_i.stride(1) != 1 or meta_i.shape[0] < 5 or temperature.dtype != \
            torch.float32 or u_table.dtype != torch.float32 or u_table.stride(1) != 1 or out.dtype != torch.float64:
        raise ValueError("decode_tail wants int64 meta_i [5, slots], fp32 temperature and u_table, float64 out, "
                         "each with contiguous rows")
    config = _config(vocab, interpret=not logits.is_cuda)
    if logits.is_cuda and maxnreg is not None:
        config["maxnreg"] = maxnreg
    _decode_tail_kernel[(b,)](logits, meta_i, meta_i.stride(0), temperature, u_table, u_table.stride(0), out, b,
                              max_position, vocab, logits.stride(0), **config)
