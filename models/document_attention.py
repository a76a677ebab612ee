"""Causal attention over packed rows that hold several documents (`DocumentAttention`), a training and scoring
attention backend for models/llama.py's pluggable `attn`: flash varlen, cuDNN over a dense view, or a masked SDPA,
each chosen where a one-time probe on this GPU agrees with the mask path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.document_layout import DocumentLayout, gather_dense, gather_keys


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
