"""Where each packed document starts and which keys it sees: what varlen attention needs, computed
on the host from the position ids.

    layout = DocumentLayout.from_positions(position_ids)        # one device->host copy
    layout = DocumentLayout.from_arrays(host_layout(pos_np), device)   # the packer: no device sync
    DocumentAttention(position_ids, layout=layout)

A new segment starts wherever the position does not increase (and at every row start). A segment
whose first position is 0 is a root; one starting at s > 0 continues the row's last root and also
sees that root's first s tokens (a GRPO prompt packed once with its n responses). Over the flattened
B*T tokens: cu_seqlens [S+1] int32 (segment boundaries), and for continuations the key index [K]
(each segment's keys: its root's first s tokens, then its own) with cu_seqlens_k [S+1].

`gather_keys(x, layout)` is x.index_select(0, key_index) whose backward needs no atomics: every token
has exactly one "own" copy among the keys (own_index), and only the shared prompt's tokens have more
(prefix_copies, one row of key positions per such token, summed in fp32). The plain index_select's
backward, an index_add of bf16 rows, took 58 ms of a 1.0 s GRPO update on an H200; the same sum as
torch ops under Inductor 28 ms (docs/history/speed_round2_profile.md); on CUDA it is now one Triton kernel
(models/triton_gather.py).

The dense view (`dense_*`): every segment as one row of a [rows, S] batch holding its keys (a
continuation's: its root's first s tokens, then its own), padded at the end to the longest. With the
queries gathered the same way, causal attention aligned top-left over each row is exact for the own
tokens: a row's prompt copies and its padding are computed and dropped (`dense_own` is each token's
own position), and a valid query never reaches the padding behind it. `dense_waste` is the rows'
causal work over the segments' own (>= 1); DocumentAttention takes this view for cuDNN's fused kernel
when the waste is small. `gather_dense(x, layout)` is gather_keys over the dense positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated aranges [starts[k], starts[k] + lens[k]) (lens >= 0) as one int64 array."""
    return np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(starts - (np.cumsum(lens) - lens), lens)


def host_layout(pos: np.ndarray) -> dict:
    """pos [B, T] int -> {"cu": int32 [S+1], "max_len": int, "continues": bool, and when it continues
    "key_index": int64 [K], "cu_k": int32 [S+1], "max_k": int, "own_index": int64 [B*T] (where among the
    keys each token's own copy sits), "prefix_rows": int64 [U] (the tokens that continuations also see)
    and "prefix_copies": int64 [U, C] (those extra copies' key positions, -1 padded); always the dense
    view's "dense_*" (_dense_layout)}."""
    b, t = pos.shape
    starts = np.ones((b, t), dtype=bool)
    starts[:, 1:] = pos[:, 1:] <= pos[:, :-1]  # every row also starts a segment
    cont = starts[:, 1:] & (pos[:, 1:] > 0)
    first = np.flatnonzero(starts.reshape(-1))
    cu = np.append(first, b * t).astype(np.int32)
    lens = np.diff(cu).astype(np.int64)
    out = {"cu": cu, "max_len": int(lens.max()), "continues": bool(cont.any())}
    if not out["continues"]:
        every = np.arange(b * t, dtype=np.int64)
        no_rows, (no_copies,) = _prefix_copies(every[:0], every[:0], every[:0])
        return out | _dense_layout(lens, np.zeros_like(lens), every, no_rows, no_copies)
    s0 = pos.reshape(-1)[first]
    root = np.where(s0 == 0, first, -1)
    last_root = np.maximum.accumulate(root)  # the latest root segment at or before each segment...
    sees = (s0 > 0) & (last_root >= first - first % t)  # ...counts only inside the same row
    pre = np.where(sees, s0, 0).astype(np.int64)
    # per segment two runs of keys: the root's first s0 tokens (continuations only), then its own
    run_starts = np.stack([np.where(sees, last_root, 0), first], 1).reshape(-1)
    run_lens = np.stack([pre, lens], 1).reshape(-1)
    key_lens = pre + lens
    cu_k = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(key_lens, out=cu_k[1:])
    # a continuation's prompt copies: key positions from its cu_k, dense positions from its row's start
    c = np.flatnonzero(sees)
    rows, (copies, dense_copies) = _prefix_copies(last_root[c], pre[c], cu_k[c].astype(np.int64),
                                                  c * int(key_lens.max()))
    key_index, own_index = _ranges(run_starts, run_lens), _ranges(cu_k[:-1].astype(np.int64) + pre, lens)
    return out | {"key_index": key_index, "cu_k": cu_k, "max_k": int(key_lens.max()), "own_index": own_index,
                  "prefix_rows": rows, "prefix_copies": copies} | _dense_layout(lens, pre, key_index, rows,
                                                                               dense_copies)


def _dense_layout(lens: np.ndarray, pre: np.ndarray, key_index: np.ndarray, prefix_rows: np.ndarray,
                  dense_copies: np.ndarray) -> dict:
    """The dense view of segments with `lens` own tokens after `pre` prompt keys, from their keys
    (key_index, segment after segment) and the prompt tokens' extra copies at dense positions: key k of
    segment i moves to row i, column k. -> {"dense_waste", "dense_index" [rows, S] (the token at each
    position; 0 in the padding), "dense_own" [B*T], "dense_prefix_rows" [U], "dense_prefix_copies" [U, C]}."""
    n, key_lens = len(lens), pre + lens
    width = int(key_lens.max())
    row_start = np.arange(n, dtype=np.int64) * width
    index = np.zeros((n, width), dtype=np.int64)
    index.reshape(-1)[_ranges(row_start, key_lens)] = key_index
    useful = float((lens * pre + lens * (lens + 1) // 2).sum())
    return {"dense_waste": n * width * (width + 1) / 2 / useful, "dense_index": index,
            "dense_own": _ranges(row_start + pre, lens), "dense_prefix_rows": prefix_rows,
            "dense_prefix_copies": dense_copies}


def _prefix_copies(src: np.ndarray, lens: np.ndarray, *at: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Continuation c also sees tokens src[c] + [0, lens[c]) (lens >= 1); its copies of them sit at
    at[v][c] + [0, lens[c]) in each key layout v. -> (the distinct tokens seen [U] ascending, per layout
    their copies' positions [U, C] in continuation order, padded with -1), C the most copies of one token."""
    if src.size == 0:
        return src.astype(np.int64), [np.full((0, 1), -1, dtype=np.int64) for _ in at]
    new = np.ones(len(src), dtype=bool)
    new[1:] = src[1:] != src[:-1]
    heads = np.flatnonzero(new)  # each root's first continuation (src never decreases: the latest root)
    group = np.cumsum(new) - 1
    seen = lens[heads]
    if (lens == seen[group]).all() and (src[heads[1:]] >= src[heads[:-1]] + seen[:-1]).all():
        return _group_copies(src[heads], seen, heads, group, at)
    return _sorted_copies(src, lens, at)


def _group_copies(root, seen, heads, group, at) -> tuple[np.ndarray, list[np.ndarray]]:
    """_prefix_copies of well-formed rows (a GRPO pack): the continuations of one root all see its first
    seen[g] tokens and the roots' ranges do not overlap, so the sorted answer is known without a sort:
    row (g, k) is root[g] + k, and its copies are the group's continuations' at + k, in their order."""
    u_start = np.cumsum(seen) - seen
    k = np.arange(int(seen.sum()), dtype=np.int64) - np.repeat(u_start, seen)  # each row's offset in its root
    counts = np.diff(np.append(heads, len(group)))
    rank = np.arange(len(group)) - heads[group]  # each continuation's place in its group
    row_group = np.repeat(np.arange(len(seen)), seen)
    copies = []
    for starts in at:
        first_copy = np.full((len(seen), int(counts.max())), -1, dtype=np.int64)
        first_copy[group, rank] = starts  # [G, C]: where each continuation's copy of token root[g] sits
        per_row = first_copy[row_group]
        copies.append(np.where(per_row >= 0, per_row + k[:, None], -1))
    return k + np.repeat(root, seen), copies


def _sorted_copies(src, lens, at) -> tuple[np.ndarray, list[np.ndarray]]:
    """_prefix_copies of any rows: sort the seen tokens, keeping continuation order among equal ones."""
    src = _ranges(src, lens)
    order = np.argsort(src, kind="stable")
    rows, first, counts = np.unique(src[order], return_index=True, return_counts=True)
    where = np.repeat(np.arange(rows.size), counts), np.arange(src.size) - np.repeat(first, counts)
    copies = []
    for starts in at:
        c = np.full((rows.size, int(counts.max())), -1, dtype=np.int64)
        c[where] = _ranges(starts, lens)[order]
        copies.append(c)
    return rows, copies


class _GatherKeys(torch.autograd.Function):
    """index_select(0, key_index) forward; backward = the own copies' gradient (a gather) plus, for the
    prompt tokens, the sum of their extra copies' gradients in fp32 (a gather-reduce), written back by
    distinct index: no atomic adds, and the prompt's gradient is summed once in fp32, not in bf16."""

    @staticmethod
    def forward(ctx, x, key_index, own_index, prefix_rows, prefix_copies):
        ctx.save_for_backward(own_index, prefix_rows, prefix_copies)
        return x.index_select(0, key_index)

    @staticmethod
    def backward(ctx, grad):
        own_index, rows, copies = ctx.saved_tensors
        return gather_keys_grad(grad.contiguous(), own_index, rows, copies), None, None, None, None


@torch.library.custom_op("hybridrl_models::gather_keys_grad", mutates_args=())
def gather_keys_grad(grad: torch.Tensor, own_index: torch.Tensor, rows: torch.Tensor,
                     copies: torch.Tensor) -> torch.Tensor:
    """d x[key_index] / d x applied to grad [K, ...]: grad[own_index], plus for prompt token rows[u] the
    sum of its extra copies grad[copies[u]] (-1 padded) in fp32, rounded once. An opaque op (Inductor
    fused the torch expression into one slow kernel); on CUDA the sum is models/triton_gather's kernel."""
    return _gather_keys_grad_torch(grad, own_index, rows, copies)


def _gather_keys_grad_torch(grad, own_index, rows, copies) -> torch.Tensor:
    grad_x = grad.index_select(0, own_index)
    if rows.numel():
        acc = torch.promote_types(grad.dtype, torch.float32)  # half rows are summed in fp32
        valid = (copies >= 0).view(*copies.shape, *([1] * (grad.dim() - 1)))
        extra = (grad[copies.clamp(min=0)].to(acc) * valid).sum(1)
        grad_x = grad_x.index_put((rows,), (grad_x[rows].to(acc) + extra).to(grad_x.dtype))
    return grad_x


@gather_keys_grad.register_kernel("cuda")
def _gather_keys_grad_cuda(grad, own_index, rows, copies):
    from models import triton_gather

    if not triton_gather.available(grad.device):
        return _gather_keys_grad_torch(grad, own_index, rows, copies)
    return triton_gather.add_copies_(grad.index_select(0, own_index), grad, rows, copies)


@gather_keys_grad.register_fake
def _gather_keys_grad_fake(grad, own_index, rows, copies):
    return grad.new_empty((own_index.shape[0], *grad.shape[1:]))


def gather_keys(x: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
    """x [B*T, ...] (one row per token) -> the continuations' keys [K, ...] (x[key_index])."""
    return _GatherKeys.apply(x, layout.key_index, layout.own_index, layout.prefix_rows, layout.prefix_copies)


def gather_dense(x: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
    """x [B*T, ...] -> the dense view [rows, S, ...] (x[dense_index]); the backward sums each token's
    copies like gather_keys' (padding positions are no token's copy and get no gradient)."""
    index = layout.dense_index
    out = _GatherKeys.apply(x, index.view(-1), layout.dense_own, layout.dense_prefix_rows,
                            layout.dense_prefix_copies)
    return out.view(*index.shape, *x.shape[1:])


DENSE_ARRAYS = ("dense_index", "dense_own", "dense_prefix_rows", "dense_prefix_copies")
DEVICE_ARRAYS = ("cu", "key_index", "cu_k", "own_index", "prefix_rows", "prefix_copies", *DENSE_ARRAYS)


@dataclass(slots=True)
class DocumentLayout:
    """host_layout's arrays as tensors on the attention's device (the ints stay host ints)."""

    cu_seqlens: torch.Tensor  # int32 [S+1]
    max_len: int
    continues: bool
    key_index: torch.Tensor | None = None  # int64 [K]
    cu_seqlens_k: torch.Tensor | None = None  # int32 [S+1]
    max_k: int = 0
    own_index: torch.Tensor | None = None  # int64 [B*T]
    prefix_rows: torch.Tensor | None = None  # int64 [U]
    prefix_copies: torch.Tensor | None = None  # int64 [U, C]
    dense_waste: float = float("inf")  # the dense view (module docstring): its causal work over the own
    dense_index: torch.Tensor | None = None  # int64 [rows, S]
    dense_own: torch.Tensor | None = None  # int64 [B*T]
    dense_prefix_rows: torch.Tensor | None = None  # int64 [U']
    dense_prefix_copies: torch.Tensor | None = None  # int64 [U', C']

    @classmethod
    def from_arrays(cls, arrays: dict, device) -> DocumentLayout:
        """From host_layout's dict whose arrays may already be tensors on the device (the packer's)."""
        def dev(x):
            return None if x is None else torch.as_tensor(x).to(device)

        return cls(dev(arrays["cu"]), arrays["max_len"], arrays["continues"], dev(arrays.get("key_index")),
                   dev(arrays.get("cu_k")), arrays.get("max_k", 0),
                   *(dev(arrays.get(k)) for k in ("own_index", "prefix_rows", "prefix_copies")),
                   arrays["dense_waste"], *(dev(arrays[k]) for k in DENSE_ARRAYS))

    @classmethod
    def from_positions(cls, position_ids: torch.Tensor) -> DocumentLayout:
        """One device->host copy of the positions (callers without a packer-made layout)."""
        return cls.from_arrays(host_layout(position_ids.cpu().numpy()), position_ids.device)
