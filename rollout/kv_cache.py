"""KV cache as one contiguous slot per running sequence, and the attention backends that use it.

Layout: one tensor [layers, 2 (k, v), slots, kv_heads, slot_len, head_dim]. Why slots and not pages:
decode is HBM-bound, and a decode batch over cache rows [0, B) attends to `k[:B, :, :kv_len]`, a
strided *view*, so each step reads exactly the live KV once (up to the length bucket). Paged blocks
in pure PyTorch need a gather of every sequence's blocks per layer per step (read + write + read:
~3x the KV traffic; at batch 256 x 256 context on llama-1b that is 4.3 GB -> 12.9 GB a step, below
half the roofline by construction) unless a custom paged-attention kernel is used. The price is
that a slot reserves max_model_len tokens, so concurrency = cache tokens / max_model_len.

An fp8 cache (RolloutConfig.kv_cache_dtype="fp8") stores K and V as float8_e4m3fn with one fp32 scale per
(token, KV head) beside them, `scales` [layers, 2, slots, kv_heads, slot_len]: each written row of head_dim values
is divided by its own absolute maximum / 448 (e4m3's largest finite value), so no calibration is needed and a
weight update never invalidates a scale. Decode reads about half the bytes (1 + 4 / head_dim per value). The
attention kernels dequantize on load (K's scale multiplies the scores, V's the probabilities). A bf16/fp32 cache
has an empty `scales`.

Backends follow models/llama.py's protocol `attn(layer_idx, q, k, v) -> out` with q [B, Hq, T, D]
and k/v [B, Hkv, T, D] after RoPE; metadata is set explicitly before the forward (docs/design.md, convention 7).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value

# SDPA backends of the engine's prefills (fresh prompts and continuations): every one but cuDNN. PyTorch puts cuDNN
# SDPA first on sm90/sm100 once its cuDNN is >= 9.15.1 (torch 2.11's cu13 wheels), and cuDNN finalizes an execution
# plan per new shape (rows, heads, query length, KV length): ~60 ms, once per prefill step, since a prefill's rows
# and lengths change at every step (agent turns returning in waves: 73 ms per continuation prefill step on an H200).
# Flash (causal fresh prompts) and memory-efficient (masked continuations) kernels are built ahead of time.
PREFILL_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def prefill_sdpa():
    """Context in which a prefill's attention runs: SDPA restricted to PREFILL_SDPA_BACKENDS (the global choice is
    restored on exit, so the trainer's attention in the same process keeps its own)."""
    return sdpa_kernel(list(PREFILL_SDPA_BACKENDS))


def kv_bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V of one token over all layers (local heads under TP), an fp8 cache's scales included."""
    per_value = torch.empty((), dtype=dtype).element_size()
    scales = 4 if dtype == FP8 else 0  # one fp32 scale per (token, head) for K and for V
    return 2 * num_layers * num_kv_heads * (head_dim * per_value + scales)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (fp8 values [..., D], fp32 scales [...]): each row over its own absolute maximum."""
    scale = (x.float().abs().amax(-1) / FP8_MAX).clamp_min(1e-30)
    return (x.float() / scale[..., None]).to(FP8), scale


class KVCache:
    def __init__(self, *, num_layers: int, num_slots: int, num_kv_heads: int, slot_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        # zeros, not empty: masked positions are multiplied by 0 in attention and NaN garbage would leak.
        # One spare slot and position: decode slices [:B] and [:kv_len] then never reach the full dim, so
        # torch.compile never specialises B or kv_len to a constant (a slice to the end would).
        self.data = torch.zeros(num_layers, 2, num_slots + 1, num_kv_heads, slot_len + 1, head_dim, dtype=dtype,
                                device=device)
        shape = (num_layers, 2, num_slots + 1, num_kv_heads, slot_len + 1) if dtype == FP8 else (0,)
        self.scales = torch.zeros(shape, dtype=torch.float32, device=device)  # empty unless fp8
        self.num_slots, self.slot_len = num_slots, slot_len

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer, each [slots + 1, Hkv, slot_len + 1, D] (the last slot/position spare)."""
        return self.data[layer_idx, 0], self.data[layer_idx, 1]

    def move_slots(self, moves: list[tuple[int, int]], *, lengths: list[int]) -> None:
        """Copy the first lengths[i] positions of slot src_i into slot dst_i (all layers)."""
        for (src, dst), n in zip(moves, lengths, strict=True):
            self.data[:, :, dst, :, :n].copy_(self.data[:, :, src, :, :n])
            if self.scales.numel():
                self.scales[:, :, dst, :, :n].copy_(self.scales[:, :, src, :, :n])


def dequantized(cache: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A view of cache values in `dtype`: fp8 values times their row scales (a copy), else the view itself."""
    if not scales.numel():
        return cache
    return (cache.float() * scales[..., None]).to(dtype)


class PrefillAttention:
    """Causal attention over right-padded prompts [Np, H, T, D]; writes row r's K/V into every slot of
    `slots` whose `rows` entry is r (n samples of one prompt share one prefill)."""

    def __init__(self, cache: KVCache, *, slots: torch.Tensor, rows: torch.Tensor):
        self.cache, self.slots, self.rows = cache, slots, rows

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # right padding is harmless: causal rows never see it, and decode overwrites/masks it later
        write_prefill_kv(self.cache.data, self.cache.scales, layer_idx, self.slots, self.rows, k, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class ContinuationAttention:
    """Prefill of continuations: row r's T new tokens sit at positions starts[r] + [0, lens[r]) of slot slots[r],
    whose first starts[r] positions already hold the KV of the tokens before them (a parked sequence's earlier
    turns). Writes the new K/V into the slot, then attends causally over the slot's positions [0, start + t].
    Padding (t >= lens[r]) writes into the slot's spare last position, which nothing reads.

    The SDPA call is one that the memory-efficient kernel takes (prefill_sdpa): an additive mask built once per
    forward (not converted per layer), its rows 16-aligned (kv_len, below), and no `enable_gqa` (torch 2.11's
    memory-efficient kernel has no GQA: the call would fall to the math path): the G query heads of a KV head
    become G blocks of query positions, as in DecodeAttention."""

    def __init__(self, cache: KVCache, *, slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                 kv_index: torch.Tensor):
        self.cache, self.slots = cache, slots
        self.starts, self.lens = starts, lens
        # kv_index = arange(kv_len): kv_len >= max(starts + lens), known on the host (no device sync per layer),
        # a dynamic dim for torch.compile as in DecodeAttention; a multiple of 16 where the slot allows (the
        # caller rounds it up): the mask's rows then need no padding copy in the kernel, and whether they do is
        # not a guard that recompiles the graph
        self.kv_index, self.kv_len = kv_index, kv_index.shape[0]
        self.flat: torch.Tensor | None = None  # [N Hkv T] cache row of each new K/V row (built by the 1st layer)
        self.mask: torch.Tensor | None = None  # [N, 1, G T, kv_len] additive, in the query dtype

    def _metadata(self, q: torch.Tensor, hkv: int) -> None:
        n, hq, t, _ = q.shape
        steps = torch.arange(t, device=q.device)
        positions = self.starts[:, None] + steps[None, :]  # [N, T]
        written = torch.where(steps[None, :] < self.lens[:, None], positions, self.cache.slot_len)  # [N, T]
        # each new K/V row's index in cache[layer, i] viewed as [slots * Hkv * positions, D], in k's [N, Hkv, T]
        # order: (slot * Hkv + head) * (slot_len + 1) + position
        heads = torch.arange(hkv, device=q.device)
        self.flat = ((self.slots[:, None, None] * hkv + heads[None, :, None]) * (self.cache.slot_len + 1)
                     + written[:, None, :]).reshape(-1)
        valid = self.kv_index[None, None, :] <= positions[:, :, None]  # [N, T, kv_len]
        mask = torch.zeros(valid.shape, dtype=q.dtype, device=q.device).masked_fill_(~valid, float("-inf"))
        g = hq // hkv
        self.mask = mask[:, None].expand(n, g, t, self.kv_len).reshape(n, 1, g * t, self.kv_len)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, hq, t, d = q.shape
        hkv = k.shape[1]
        if self.flat is None:
            self._metadata(q, hkv)
        kv_len, slots, scales = self.kv_len, self.slots, self.cache.scales
        write = write_continuation_kv if torch.compiler.is_compiling() else _write_rows
        write(self.cache.data, scales, layer_idx, self.flat, k, v)
        out = []
        for i in (0, 1):
            if scales.numel():
                out.append(dequantized(self.cache.data[layer_idx, i][slots, :, :kv_len],
                                       scales[layer_idx, i][slots, :, :kv_len], q.dtype))
            else:
                out.append(self.cache.data[layer_idx, i][slots, :, :kv_len])
        # query head h = kv head h // G: [N, Hq, T, D] -> [N, Hkv, G T, D] (G blocks of T positions per KV head)
        grouped = q.reshape(n, hkv, (hq // hkv) * t, d)
        return F.scaled_dot_product_attention(grouped, out[0], out[1], attn_mask=self.mask).reshape(n, hq, t, d)


def _write_rows(cache: torch.Tensor, scales: torch.Tensor, layer: int, flat: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> None:
    """cache[layer, 0/1] viewed as rows of head_dim values: row flat[j] = the j-th row of k/v [N, Hkv, T, D] in
    that order (quantized with their row scales into `scales` for an fp8 cache). One index_copy_ per tensor."""
    d = k.shape[-1]
    for i, x in enumerate((k, v)):
        rows = x.reshape(-1, d)
        if scales.numel():  # (fp8 copies as bytes: CPU index_copy has no float8 kernel)
            values, row_scales = quantize_rows(rows)
            cache[layer, i].view(torch.uint8).view(-1, d).index_copy_(0, flat, values.view(torch.uint8))
            scales[layer, i].view(-1).index_copy_(0, flat, row_scales)
        else:
            cache[layer, i].view(-1, d).index_copy_(0, flat, rows)


@torch.library.custom_op("hybridrl_rollout::write_continuation_kv", mutates_args=("cache", "scales"))
def write_continuation_kv(cache: torch.Tensor, scales: torch.Tensor, layer: int, flat: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor) -> None:
    """_write_rows as an op opaque to torch.compile, so the compiled continuation mutates the cache in place
    instead of functionalising (copying) it. Eager callers call _write_rows itself (no dispatch overhead)."""
    _write_rows(cache, scales, layer, flat, k, v)


@write_continuation_kv.register_fake
def _write_continuation_kv_fake(cache, scales, layer, flat, k, v) -> None:
    return None


@torch.library.custom_op("hybridrl_rollout::write_prefill_kv", mutates_args=("cache", "scales"))
def write_prefill_kv(cache: torch.Tensor, scales: torch.Tensor, layer: int, slots: torch.Tensor, rows: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor) -> None:
    """cache[layer, 0/1, slots[i], :, :T] = k/v[rows[i]] for prompt rows k/v [Np, Hkv, T, D] (quantized with
    their row scales into `scales` for an fp8 cache). Opaque to torch.compile (like write_kv below), so the
    compiled prefill mutates the cache in place."""
    from rollout import triton_attention

    if cache.is_cuda and triton_attention.available(cache.device, k.shape[-1]):
        triton_attention.write_prefill(cache, layer, slots, rows, k, v, scales)  # one kernel, near HBM speed
        return
    t = k.shape[2]
    for i, x in enumerate((k, v)):
        if scales.numel():  # (fp8 copies as bytes: CPU index_put has no float8 kernel)
            values, row_scales = quantize_rows(x[rows])
            cache.view(torch.uint8)[layer, i, slots, :, :t] = values.view(torch.uint8)
            scales[layer, i, slots, :, :t] = row_scales
        else:
            cache[layer, i, slots, :, :t] = x[rows]


@write_prefill_kv.register_fake
def _write_prefill_kv_fake(cache, scales, layer, slots, rows, k, v) -> None:
    return None


@torch.library.custom_op("hybridrl_rollout::write_kv", mutates_args=("cache", "scales"))
def write_kv(cache: torch.Tensor, scales: torch.Tensor, layer: int, positions: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """cache[layer, 0/1, b, :, positions[b]] = k/v[b, :, 0] for rows b < B (quantized into `scales` for an fp8
    cache). An opaque op so torch.compile mutates the cache in place instead of functionalising (copying) a
    multi-GB tensor."""
    b, hkv, _, d = k.shape
    index = positions.view(b, 1, 1, 1).expand(b, hkv, 1, d)
    for i, x in enumerate((k, v)):
        if scales.numel():  # (fp8 scatters as bytes: CPU scatter has no float8 kernel)
            x, row_scales = quantize_rows(x)
            scales[layer, i, :b].scatter_(2, index[..., 0], row_scales)
            cache.view(torch.uint8)[layer, i, :b].scatter_(2, index, x.view(torch.uint8))
        else:
            cache[layer, i, :b].scatter_(2, index, x)


@write_kv.register_fake
def _write_kv_fake(cache, scales, layer, positions, k, v) -> None:
    return None


# decode kernels: our Triton kernel (rollout/triton_attention.py: K/V write fused, reads only the live
# positions, no mask), SDPA with PyTorch's own backend choice, SDPA forced to one backend, or two batched
# matmuls; "auto" (rollout/model_runner.py) times them per CUDA-graph shape and keeps the fastest
DECODE_KERNELS = ("triton", "sdpa", "sdpa-efficient", "sdpa-cudnn", "bmm")
_FORCED = {"sdpa-efficient": "EFFICIENT_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}


def decode_kernels(device: torch.device, head_dim: int) -> tuple[str, ...]:
    """The DECODE_KERNELS that can run on `device` ("triton" needs CUDA and triton, or its interpreter)."""
    from rollout import triton_attention

    return tuple(k for k in DECODE_KERNELS if k != "triton" or triton_attention.available(device, head_dim))


class DecodeAttention:
    """One new token per cache row [0, B): write K/V at `positions`, attend over the first kv_len positions.

    Built once per forward (inside the CUDA graph / compiled region) from `kv_index` = arange(kv_len),
    whose length carries the KV bucket as a tensor shape (a dynamic dim for torch.compile, not a
    recompile per bucket). Each layer then only indexes views of the cache: no KV copy.
    """

    def __init__(self, cache: torch.Tensor, *, positions: torch.Tensor, kv_index: torch.Tensor, mode: str = "sdpa",
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                 prefix: tuple[torch.Tensor, ...] | None = None, scales: torch.Tensor | None = None):
        self.cache, self.positions, self.mode = cache, positions, mode
        # an fp8 cache's row scales (KVCache.scales); empty for a bf16/fp32 cache
        self.scales = cache.new_zeros(0, dtype=torch.float32) if scales is None else scales
        # shared-prompt tables (rollout/shared_prefix.py) and the kernel's counters, read by the triton kernel only
        self.prefix = prefix if mode == "triton" else None
        self.kv_len = kv_index.shape[0]
        self.mask = None
        # (cos, sin) [B, D] at each row's position: the Triton kernel rotates q and the new k itself, and
        # the caller (the engine's FusedQKVAttention) passes them un-rotated when `applies_rope`
        self.rope = rope if mode == "triton" else None
        if mode == "triton":  # bounds come from `positions` inside the kernel: no mask, no bucket
            return
        valid = kv_index[None, :] <= positions[:, None]  # [B, L]: rows attend to [0, position]
        # additive mask built once per forward (SDPA would convert a bool mask in every layer); fp32 for
        # the bmm path's fp32 scores, the cache dtype for SDPA (an fp8 cache's: fp32, cast to the query's per call)
        dtype = torch.float32 if mode == "bmm" or self.scales.numel() else cache.dtype
        zeros = torch.zeros(valid.shape, dtype=dtype, device=positions.device)
        self.mask = zeros.masked_fill(~valid, float("-inf"))[:, None, None, :]

    @property
    def applies_rope(self) -> bool:
        return self.rope is not None

    @property
    def applies_norm(self) -> bool:
        """Whether q/k/v may arrive unnormalised, with the rows `norm_x` whose RMS scales them (folded_norms)."""
        return self.mode == "triton"

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 norm_x: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
        if self.mode == "triton":
            from rollout.triton_attention import decode_attention, decode_attention_shared

            args = (self.cache, self.scales, layer_idx, self.positions, q, k, v, self.kv_len,
                    *(self.rope or (None, None)))
            if self.prefix is None:
                return decode_attention(*args, norm_x, eps)
            return decode_attention_shared(*args, *self.prefix, norm_x, eps)
        if norm_x is not None:
            raise ValueError(f"decode attention {self.mode!r} does not apply a norm")
        b, hq, _, d = q.shape
        hkv = k.shape[1]
        write_kv(self.cache, self.scales, layer_idx, self.positions, k, v)
        keys, values = (self.cache[layer_idx, i, :b, :, : self.kv_len] for i in (0, 1))  # views: [B, Hkv, L, D]
        if self.scales.numel():  # fp8: dequantized copies (the triton kernel dequantizes on load instead)
            keys, values = (dequantized(x, self.scales[layer_idx, i, :b, :, : self.kv_len], q.dtype)
                            for i, x in enumerate((keys, values)))
        # GQA without repeating KV: the G query heads of a KV head become G "query positions"
        qg = q.reshape(b, hkv, hq // hkv, d)
        mask = self.mask if self.mode == "bmm" else self.mask.to(q.dtype)  # a no-op but for an fp8 cache
        if self.mode == "sdpa":
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
        elif self.mode in _FORCED:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([getattr(SDPBackend, _FORCED[self.mode])]):
                out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
        else:
            scores = torch.matmul(qg * d**-0.5, keys.transpose(-1, -2)).float() + self.mask
            out = torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), values)
        return out.reshape(b, hq, 1, d)


def fastest_decode_kernel(cache: KVCache, *, rows: int, kv_index: torch.Tensor, num_heads: int,
                          sync) -> tuple[str, dict[str, float]]:
    """Time the decode kernels on layer 0 for `rows` rows attending all len(kv_index) positions (the
    bucket's worst case); returns the fastest and the ms of each that ran. The K/V they write at the
    last position is saved first and restored after, so the live cache is unchanged. Kernels that
    cannot run this shape here (e.g. a forced backend) are skipped."""
    _, _, _, hkv, _, d = cache.data.shape
    dev = cache.data.device
    dtype = torch.bfloat16 if cache.scales.numel() else cache.data.dtype  # an fp8 cache serves a bf16 engine
    kv_len = kv_index.shape[0]
    q = torch.randn(rows, num_heads, 1, d, device=dev, dtype=dtype)
    k, v = (torch.randn(rows, hkv, 1, d, device=dev, dtype=dtype) for _ in range(2))
    pos = torch.full((rows,), kv_len - 1, dtype=torch.int64, device=dev)
    saved = cache.data[0, :, :rows, :, kv_len - 1].clone()
    saved_scales = cache.scales[0, :, :rows, :, kv_len - 1].clone() if cache.scales.numel() else None
    times = {}
    try:
        for kernel in decode_kernels(dev, d):
            try:
                attn = DecodeAttention(cache.data, positions=pos, kv_index=kv_index, mode=kernel,
                                       scales=cache.scales)
                for _ in range(2):
                    attn(0, q, k, v)
                sync()
                t0 = time.perf_counter()  # 5 back-to-back launches of a >10 us kernel: launch cost is hidden
                for _ in range(5):
                    attn(0, q, k, v)
                sync()
                times[kernel] = round((time.perf_counter() - t0) / 5 * 1e3, 4)
            except Exception:  # noqa: BLE001 - a backend that cannot run this shape is simply not a candidate
                continue
    finally:
        cache.data[0, :, :rows, :, kv_len - 1] = saved
        if saved_scales is not None:
            cache.scales[0, :, :rows, :, kv_len - 1] = saved_scales
    return (min(times, key=times.get) if times else "sdpa"), times
