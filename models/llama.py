"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3 dense, Qwen3-MoE, Mistral) with Hugging Face parameter names.

Qwen3-MoE layers carry models/moe.py's SparseMoeBlock as `mlp`; a `routing` RouterTrace passed to the forward
(like `attn`) replays and records their expert choices. Dense models never see it.

Single-device definition; parallel/ applies TP/PP/FSDP to it. Every tensor-parallel
sensitive reshape uses -1 for the head count, so a DTensor-sharded q/k/v projection
(local heads = heads / tp) runs through the same code.

Attention is pluggable and explicit (docs/design.md, convention 7): `forward(..., attn=backend)` where
`backend(layer_idx, q, k, v) -> out` with q [B, Hq, T, D], k/v [B, Hkv, T, D] after
RoPE (Qwen3: after its per-head q/k RMSNorm, then RoPE) and out [B, Hq, T, D]. The default
is causal SDPA; `DocumentAttention` handles packed rows; the rollout engine passes its
KV-cache backend.

Pipeline stages are made by setting `model.embed_tokens`, `model.norm` or `lm_head`
to None and deleting entries of the `model.layers` ModuleDict (keys stay the global
layer indices, so parameter names stay Hugging Face names).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.document_layout import DocumentLayout, gather_dense, gather_keys
from models.moe import GroupedExperts, RouterTrace, SparseMoeBlock


class AttentionBackend(Protocol):
    """attn(layer_idx, q, k, v) -> out over [B, H, T, D]. A backend whose `applies_rope` attribute is true
    (the engine's Triton decode kernel) takes q and k before RoPE and rotates them itself."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def causal_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over [B, H, T, D]; GQA handled by SDPA."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def document_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] positions that restart at 0 for each packed sequence -> [B, T] document ids."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] <= position_ids[:, :-1]
    return torch.cumsum(starts.long(), dim=1)


class DocumentAttention:
    """Causal attention restricted to each packed document (rows hold several sequences).

    Built once per forward from the [B, T] position ids (a new segment starts wherever the
    position does not increase) and shared by all layers. A segment whose first position is 0 is
    a document of its own; a segment starting at position s > 0 *continues* the last such root
    document of its row: it also sees that root's first s tokens (positions 0..s-1). That is how a
    prompt is packed once with its n responses (ppo/batching.pack(share_prompts=True)): prompt +
    response 1 form the root, responses 2..n follow with positions from len(prompt) on.
    Three exact implementations:
    - "mask": SDPA with a [B, 1, T, T] boolean mask (CPU, fp32, and any fallback);
    - "varlen": flash attention over cumulative document lengths (torch.nn.attention.varlen),
      O(T) memory and no wasted cross-document FLOPs; CUDA with bf16/fp16 only;
    - "dense": every segment as one row of a padded batch (the layout's dense view: a continuation's
      row holds its prompt's keys, then its own), causal attention per row by cuDNN's fused kernel on
      CUDA (SDPA elsewhere). It computes the padding and a continuation's prompt queries and drops
      them (layout.dense_waste), and on an H200 still ran GRPO's packed groups twice as fast forward
      as FA2's varlen kernel, whose programs see only a few key blocks each
      (bench/results/varlen_attention_dense_h200.json).
    backend="auto" takes dense for forward-only passes (no grad: the reference's and other scoring
    forwards) when its waste is at most DENSE_MAX_WASTE, else varlen, each when the tensors allow it
    and a one-time probe on this GPU agrees with the mask path; else the mask. Training passes keep
    varlen: there cuDNN's backward is within 15% of FA2's, and the dense view's extra gathers and
    scatters made GRPO's update slower (measured in docs/history/measurements.md). Off CUDA, auto takes
    dense (SDPA per row, training too) where it scores far fewer positions than the mask (cpu_prefers_dense).
    """

    def __init__(self, position_ids: torch.Tensor, *, backend: str = "auto", layout: DocumentLayout | None = None):
        if backend not in ("auto", "mask", "varlen", "dense"):
            raise ValueError(f"DocumentAttention backend {backend!r}: use auto, mask, varlen or dense")
        if backend == "varlen" and not position_ids.is_cuda:
            raise ValueError("DocumentAttention backend 'varlen' needs CUDA tensors; use 'auto' or 'mask' on CPU")
        self.position_ids = position_ids
        self.backend = backend
        self._mask: torch.Tensor | None = None
        self.layout: DocumentLayout | None = None  # the varlen and dense paths' segments and keys
        # everything data-dependent (host work, the GPU probes, the dense view's cost) happens here,
        # eagerly, so layers compiled with torch.compile see only tensor work in __call__. `layout` (the
        # packer computes it on the host: models/document_layout.py) saves the one device->host copy.
        self.dense_fits = False  # auto: the dense view wastes little enough for cuDNN to win
        self.cpu_dense = False  # auto off CUDA: the dense view instead of the mask (cpu_prefers_dense)
        # varlen with fewer K/V heads than query heads, where this torch's varlen_attn has no enable_gqa: the K/V
        # heads as they are when the flash kernel takes them (probed: "varlen_gqa"), else expanded by hand;
        # True / False forces it
        self.gqa_native: bool | None = None
        if backend == "dense" or (position_ids.is_cuda and backend != "mask"):
            self.layout = layout or DocumentLayout.from_positions(position_ids)
            self.dense_fits = self.layout.dense_waste <= DENSE_MAX_WASTE
            for dtype in _HALF if backend in ("auto", "varlen") else ():
                if backend == "auto":
                    _fused_ok("varlen", position_ids.device, dtype)
                    if self.continues:
                        _fused_ok("varlen", position_ids.device, dtype, prefix=True)
                    if self.dense_fits:
                        _fused_ok("dense", position_ids.device, dtype, prefix=True)
                _fused_ok("varlen_gqa", position_ids.device, dtype, prefix=self.continues)
        elif backend == "auto" and layout is not None and cpu_prefers_dense(layout, position_ids.shape):
            self.layout, self.cpu_dense = layout, True
        else:
            self._mask = self._document_mask(position_ids)

    @property
    def continues(self) -> bool:
        """Some segment continues a root (it starts past position 0 inside a row)."""
        if self.layout is not None:
            return self.layout.continues
        pos = self.position_ids
        return bool(((pos[:, 1:] <= pos[:, :-1]) & (pos[:, 1:] > 0)).any())

    @property
    def mask(self) -> torch.Tensor:
        """[B, 1, T, T] bool: query i may attend key j (same document, j <= i)."""
        if self._mask is None:
            self._mask = self._document_mask(self.position_ids)
        return self._mask

    @staticmethod
    def _document_mask(position_ids: torch.Tensor) -> torch.Tensor:
        doc = document_ids_from_positions(position_ids)
        t = position_ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
        mask = (doc[:, :, None] == doc[:, None, :]) & causal
        # continuation segments also see their root's tokens before their own first position
        start_pos = _segment_start_values(position_ids, doc)
        root = torch.cummax(torch.where(start_pos == 0, doc, torch.zeros_like(doc)), dim=1).values
        cont = start_pos > 0
        sees_root = (cont[:, :, None] & (doc[:, None, :] == root[:, :, None])
                     & (position_ids[:, None, :] < start_pos[:, :, None]))
        return (mask | sees_root)[:, None]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.backend == "dense" or self.cpu_dense or (
                self.backend == "auto" and self.dense_fits and not torch.is_grad_enabled() and q.dtype in _HALF
                and q.shape[-1] <= 128 and _fused_ok("dense", q.device, q.dtype, prefix=True)):
            return self._dense_attention(q, k, v)
        use_varlen = self.layout is not None and (
            self.backend == "varlen"
            or (q.dtype in _HALF and q.shape[-1] <= 256 and _fused_ok("varlen", q.device, q.dtype)
                and (not self.continues or _fused_ok("varlen", q.device, q.dtype, prefix=True)))
        )
        if use_varlen:
            return self._varlen_attention(q, k, v)
        if q.is_cuda and q.shape[1] != k.shape[1]:
            # CUDA's fused kernels take a mask only with equal head counts; with enable_gqa SDPA
            # would fall back to the math kernel ([B, H, T, T] scores), so expand K/V instead
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=q.shape[1] != k.shape[1])

    def _varlen_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        b, hq, t, d = q.shape
        lay = self.layout
        cu, max_len = lay.cu_seqlens, lay.max_len
        kwargs, expand = _varlen_kwargs(gqa=hq != k.shape[1])
        if expand and (self.gqa_native if self.gqa_native is not None
                       else _fused_ok("varlen_gqa", q.device, q.dtype, prefix=lay.continues)):
            # the flash kernel takes fewer K/V heads (and sums their gradients) itself: no [T, Hq, D] copies of
            # K and V, nor the reduction of their expanded gradients in the backward
            expand = False
        q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (q, k, v))  # [B*T, H, D]
        if lay.continues:  # continuation segments: gathered keys (before any GQA expansion: half the rows' bytes)
            k, v = gather_keys(k, lay), gather_keys(v, lay)
        if expand:  # this torch's varlen_attn has no GQA: give every query head its own K/V head
            k, v = (x.repeat_interleave(hq // x.shape[1], dim=1) for x in (k, v))
        if not lay.continues:
            out = varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)
        else:  # causal is bottom-right aligned (probed at startup)
            out = varlen_attn(q, k, v, cu, lay.cu_seqlens_k, max_len, lay.max_k, **kwargs)
        return out.view(b, t, hq, d).transpose(1, 2)

    def _dense_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, hq, t, d = q.shape
        lay = self.layout
        q, k, v = (gather_dense(x.transpose(1, 2).reshape(b * t, x.shape[1], d), lay) for x in (q, k, v))
        if k.shape[2] != hq:  # expanded after the gather (half the bytes gathered); cuDNN's GQA backward is slower
            k, v = (x.repeat_interleave(hq // x.shape[2], dim=2) for x in (k, v))
        out = causal_rows(*(x.transpose(1, 2) for x in (q, k, v)))  # [rows, H, S, D] over [rows, S, H, D]
        out = out.transpose(1, 2).reshape(-1, hq, d).index_select(0, lay.dense_own)
        return out.view(b, t, hq, d).transpose(1, 2)


def cpu_prefers_dense(layout: DocumentLayout, shape: torch.Size) -> bool:
    """Off CUDA (no fused kernel takes the packed documents): the dense view, when its scores (a row of the longest
    segment's width per segment) are under half the mask path's (a [T, T] square per packed row; the other half
    pays for the dense view's gathers). A row of many short documents, such as a supervised warm-up's packed
    demonstrations, scores ~T / width times fewer positions."""
    rows, width = layout.dense_index.shape
    return 2 * rows * width * width < shape[0] * shape[1] * shape[1]


def causal_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention aligned top-left over [N, H, S, D] rows of equal heads: cuDNN's fused kernel on
    CUDA (differentiable; the log-sum-exp kept only when a backward may follow), SDPA elsewhere."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, grad, 0.0, True, False)[0]


# The dense view's largest waste that auto accepts in a forward-only pass: cuDNN ran (a)'s packed
# groups (waste 1.11) forward in 0.170 ms against FA2's 0.341 (bench.varlen_attention on an H200), so
# it stays ahead up to a waste of ~2; the bound leaves room for the gathers around it.
DENSE_MAX_WASTE = 1.5
_HALF = (torch.bfloat16, torch.float16)


def _varlen_kwargs(*, gqa: bool) -> tuple[dict, bool]:
    """Causal keyword(s) for this torch's varlen_attn, and whether GQA heads must be expanded by hand.
    The API moved: 2.10 takes is_causal=; later releases take window_size=(-1, 0); enable_gqa=
    arrived in 2.12."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if gqa and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs, gqa and "enable_gqa" not in params
def _segment_start_values(position_ids: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """[B, T]: the position id at which each token's segment starts (segments = document ids)."""
    first = torch.ones_like(position_ids, dtype=torch.bool)
    first[:, 1:] = doc[:, 1:] != doc[:, :-1]
    idx = torch.arange(position_ids.shape[1], device=position_ids.device).expand_as(position_ids)
    first_idx = torch.cummax(torch.where(first, idx, torch.zeros_like(idx)), dim=1).values
    return position_ids.gather(1, first_idx)


_FUSED_OK: dict[tuple[str, int, torch.dtype, bool], bool] = {}


def _fused_ok(backend: str, device: torch.device, dtype: torch.dtype, *, prefix: bool = False) -> bool:
    """`backend` ("varlen" flash attention, "varlen_gqa" the same with K/V heads unexpanded, or cuDNN over the
    "dense" view) runs on this GPU and matches the mask path (_probe, once per device and dtype; False off CUDA);
    prefix=True also checks continuation segments (for varlen: fewer queries than keys, bottom-right causal)."""
    if device.type != "cuda":
        return False
    key = (backend, device.index or 0, dtype, prefix)
    if key not in _FUSED_OK:
        _FUSED_OK[key] = False  # while probing: the probe's own DocumentAttention must not probe it again
        _FUSED_OK[key] = _probe(device, dtype, backend=backend, prefix=prefix)
    return _FUSED_OK[key]


def _probe(device: torch.device, dtype: torch.dtype, *, backend: str, prefix: bool) -> bool:
    """`backend` runs on this GPU and agrees with the mask path: outputs, and for dense (whose backward
    is a separate cuDNN kernel) and varlen_gqa (varlen with K/V heads not expanded: the kernel's own GQA,
    backward included) the q/k/v gradients too."""
    import logging

    try:
        gen = torch.Generator(device=device).manual_seed(0)
        pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7]], device=device)
        if prefix:  # a root of 8 tokens, then two continuations of its first 3 (a prompt shared 3 ways)
            pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 3, 4, 5, 3, 4, 5, 6, 7]], device=device)
        grads = backend in ("dense", "varlen_gqa")
        qkv = [torch.randn(1, h, 16, 64, device=device, dtype=dtype, generator=gen).requires_grad_(grads)
               for h in (4, 2, 2)]
        with torch.set_grad_enabled(grads):
            attn = DocumentAttention(pos, backend="varlen" if backend == "varlen_gqa" else backend)
            attn.gqa_native = backend == "varlen_gqa" or None
            fast = attn(0, *qkv)
            ref = DocumentAttention(pos, backend="mask")(0, *qkv)
            pairs = [(fast, ref)]
            if grads:
                g = torch.randn(fast.shape, device=device, dtype=dtype, generator=gen)
                pairs += zip(torch.autograd.grad(fast, qkv, g), torch.autograd.grad(ref, qkv, g))
        err = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
        if err > 2e-2 * (4 if grads else 1):
            raise RuntimeError(f"{backend} differs from the masked SDPA by {err:.3g}")
        return True
    except Exception as e:  # capability probe: a missing kernel means another path, not a crash
        what = "rows with shared prompts" if prefix else "packed rows"
        logging.getLogger(__name__).warning("%s attention unavailable on %s (%s); %s take the next path",
                                            backend, device, e, what)
        return False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 and scale in the input dtype, as Hugging Face does (bit-compatible)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def compute_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies [D/2], with the llama3 long-context scaling when configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor = rs["factor"]
        low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_len = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rotary_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype):
    """[B, T] positions -> cos, sin of shape [B, 1, T, D] in `dtype` (computed in fp32)."""
    freqs = position_ids[..., None].float() * inv_freq.float().to(position_ids.device)  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        # Qwen3: one RMSNorm over head_dim shared by all q heads (and one by all k heads), applied before
        # RoPE; [D] weights, so tensor parallelism replicates them
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: the local head count under tensor parallelism
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:  # before RoPE, also when the attention backend rotates q/k itself
            q, k = self.q_norm(q), self.k_norm(k)
        if not getattr(attn, "applies_rope", False):
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.sparse = cfg.is_moe_layer(layer_idx)  # Qwen3-MoE: this layer's MLP is a mixture of experts
        self.mlp = SparseMoeBlock(cfg, layer_idx) if self.sparse else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend,
                routing: RouterTrace | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        if self.sparse and routing is not None:  # an MoE layer's forward with a trace (dense models pass none)
            return x + self.mlp(self.post_attention_layernorm(x), routing)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The trunk: embeddings, decoder layers, final norm. Any of them may be absent (PP)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", compute_inv_freq(cfg), persistent=False)

    def __setattr__(self, name, value):
        # RoPE frequencies stay fp32 whatever is assigned: a bf16 copy would put rounded angles into one
        # engine (e.g. the rollout's) and exact ones into the trainer, so PPO's on-policy ratio != 1
        if name == "inv_freq" and isinstance(value, torch.Tensor) and value.dtype != torch.float32:
            value = compute_inv_freq(self.config).to(value.device)
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        # .to(bf16) would round the RoPE frequencies (angle errors of tens of radians at position 4k) and
        # to_empty() would leave them uninitialised: recompute them in fp32 on the new device instead
        super()._apply(fn, recurse)
        self.inv_freq = compute_inv_freq(self.config).to(self.inv_freq.device)
        return self

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        attn: AttentionBackend | None = None,
        routing: RouterTrace | None = None,
    ) -> torch.Tensor:
        """x: token ids [B, T] (first stage) or hidden states [B, T, H] -> hidden [B, T, H]. routing: an MoE
        model's RouterTrace over the B * T tokens (replayed experts in, choices and load statistics out)."""
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        b, t = h.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(t, device=h.device).expand(b, t)
        if attn is None:
            attn = causal_attention
        cos, sin = rotary_cos_sin(self.inv_freq, position_ids, h.dtype)
        if routing is None:
            for layer in self.layers.values():
                h = layer(h, cos, sin, attn)
        else:
            for layer in self.layers.values():
                h = layer(h, cos, sin, attn, routing)
        return self.norm(h) if self.norm is not None else h


class LlamaForCausalLM(nn.Module):
    """`model(input_ids, position_ids=None) -> logits [B, T, V]`; HF names `model.*`, `lm_head.*`."""

    hf_architecture = "ForCausalLM"  # config.json architectures = [<Family>ForCausalLM]

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head's weight with the embedding when the config ties them (Qwen2-0.5B style); call
        again after anything that re-creates parameters (`to_empty`). No-op on a pipeline stage that lacks
        either module: there the stage that has lm_head holds its own copy (see models/hf_io.py)."""
        if self.config.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(self, input_ids, position_ids=None, *, attn=None, routing=None) -> torch.Tensor:
        if routing is None:
            return self.model(input_ids, position_ids, attn=attn)
        return self.model(input_ids, position_ids, attn=attn, routing=routing)

    def forward(self, input_ids, position_ids=None, *, attn=None, routing=None) -> torch.Tensor:
        h = self.hidden_states(input_ids, position_ids, attn=attn, routing=routing)
        return self.lm_head(h) if self.lm_head is not None else h


def init_weights(model: nn.Module, *, std: float = 0.02, seed: int | None = None) -> None:
    """Random initialisation like Hugging Face's `_init_weights` (normal(0, std), norms at 1)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for mod in model.modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            w = torch.empty(mod.weight.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            with torch.no_grad():
                mod.weight.copy_(w)
            if getattr(mod, "bias", None) is not None:
                with torch.no_grad():
                    mod.bias.zero_()
        elif isinstance(mod, GroupedExperts):
            for p in (mod.gate_up_proj, mod.down_proj):
                w = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
                with torch.no_grad():
                    p.copy_(w)
        elif isinstance(mod, RMSNorm):
            with torch.no_grad():
                mod.weight.fill_(1.0)
