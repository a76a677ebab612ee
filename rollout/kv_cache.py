"""KV cache as one contiguous slot per running sequence, and the attention backends that use it.

Layout: one tensor [layers, 2 (k, v), slots, kv_heads, slot_len, head_dim]. Why slots and not pages:
decode is HBM-bound, and a decode batch over cache rows [0, B) attends to `k[:B, :, :kv_len]`, a
strided *view*, so each step reads exactly the live KV once (up to the length bucket). Paged blocks
in pure PyTorch need a gather of every sequence's blocks per layer per step (read + write + read:
~3x the KV traffic; at batch 256 x 256 context on llama-1b that is 4.3 GB -> 12.9 GB a step, below
half the roofline by construction) unless a custom paged-attention kernel is used. The price is
that a slot reserves max_model_len tokens, so concurrency = cache tokens / max_model_len.

Backends follow models/llama.py's protocol `attn(layer_idx, q, k, v) -> out` with q [B, Hq, T, D]
and k/v [B, Hkv, T, D] after RoPE; metadata is set explicitly before the forward (STYLE.md #7).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kv_bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V of one token over all layers (local heads under TP)."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class KVCache:
    def __init__(self, *, num_layers: int, num_slots: int, num_kv_heads: int, slot_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        # zeros, not empty: masked positions are multiplied by 0 in attention and NaN garbage would leak
        self.data = torch.zeros(num_layers, 2, num_slots, num_kv_heads, slot_len, head_dim, dtype=dtype,
                                device=device)
        self.num_slots, self.slot_len = num_slots, slot_len

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer, each [slots, Hkv, slot_len, D]."""
        return self.data[layer_idx, 0], self.data[layer_idx, 1]

    def move_slots(self, moves: list[tuple[int, int]], *, lengths: list[int]) -> None:
        """Copy the first lengths[i] positions of slot src_i into slot dst_i (all layers)."""
        for (src, dst), n in zip(moves, lengths, strict=True):
            self.data[:, :, dst, :, :n].copy_(self.data[:, :, src, :, :n])


class PrefillAttention:
    """Causal attention over right-padded prompts [Np, H, T, D]; writes row r's K/V into every slot of
    `slots` whose `rows` entry is r (n samples of one prompt share one prefill)."""

    def __init__(self, cache: KVCache, *, slots: torch.Tensor, rows: torch.Tensor):
        self.cache, self.slots, self.rows = cache, slots, rows

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.cache.layer(layer_idx)
        t = k.shape[2]
        # right padding is harmless: causal rows never see it, and decode overwrites/masks it later
        kc[self.slots, :, :t] = k[self.rows]
        vc[self.slots, :, :t] = v[self.rows]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class DecodeAttention:
    """One new token per cache row: write K/V at `positions`, attend over the first kv_len positions.

    `prepare(positions, kv_len)` runs once per forward (inside the CUDA graph) and builds the
    length mask; every layer then only indexes views of the cache, no KV copy.
    """

    def __init__(self, cache: KVCache, *, mode: str = "sdpa"):
        self.cache, self.mode = cache, mode
        self.kv_len = 0
        self.index = self.mask = None

    def prepare(self, positions: torch.Tensor, kv_len: int) -> None:
        """positions [B] int64: where each row's new token goes (rows attend to [0, position])."""
        self.kv_len = kv_len
        b = positions.shape[0]
        _, _, _, hkv, _, d = self.cache.data.shape
        self.index = positions.view(b, 1, 1, 1).expand(b, hkv, 1, d)
        valid = torch.arange(kv_len, device=positions.device)[None, :] <= positions[:, None]  # [B, L]
        if self.mode == "sdpa":
            self.mask = valid[:, None, None, :]
        else:
            self.mask = torch.zeros(valid.shape, dtype=torch.float32, device=positions.device)
            self.mask = self.mask.masked_fill(~valid, float("-inf"))[:, None, None, :]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, hq, _, d = q.shape
        hkv = k.shape[1]
        kc, vc = self.cache.layer(layer_idx)
        kc[:b].scatter_(2, self.index, k)
        vc[:b].scatter_(2, self.index, v)
        keys, values = kc[:b, :, : self.kv_len], vc[:b, :, : self.kv_len]  # views: [B, Hkv, L, D]
        # GQA without repeating KV: the G query heads of a KV head become G "query positions"
        qg = q.reshape(b, hkv, hq // hkv, d)
        if self.mode == "sdpa":
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=self.mask)
        else:
            scores = torch.matmul(qg * d**-0.5, keys.transpose(-1, -2)).float() + self.mask
            out = torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), values)
        return out.reshape(b, hq, 1, d)
