"""Sequence packing: B token sequences -> one row of T tokens for the model (PackedBatch), and back.

    packed = pack_prompt_responses(prompts, responses, pad_id=0, device="cuda", share_prompts=True)
    hidden = model.hidden_states(packed.input_ids, packed.position_ids,
                                 attn=DocumentAttention(packed.position_ids, layout=packed.layout))
    logp, _ = gather_response_logprobs(hidden[0], packed, token_logprobs)   # [B, R]

The packer runs on the host between micro-batches, so it is vectorised (numpy over the concatenated
tokens, no per-sequence tensor work): a 16k-token GRPO micro-batch packs in a fraction of a
millisecond. On CUDA every integer tensor of a pack lives in one pinned host buffer that crosses to
the device in a single non-blocking copy; the fields are views of the device copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from models.document_layout import DEVICE_ARRAYS, DocumentLayout, host_layout


@dataclass(slots=True)
class PackedBatch:
    """B sequences concatenated into one row of T tokens (T >= sum of lengths when padded).

    input_ids, position_ids, labels: [1, T]; position ids restart at 0 per sequence (and for the
    padding tail) so `models.document_attention.DocumentAttention(position_ids)` keeps documents apart. labels[t]
    is the next token of the same sequence (pad_id at each sequence's last token), so
    `logprobs_from_logits(logits, labels)[t]` is log p(token t+1). cu_seqlens [B+1] int32 are the
    sequence boundaries (flash-attention varlen convention). When `prompt_lens` were given,
    response_index / response_mask [B, R] locate each response token's log-prob position, and the
    flat_* [N] tensors (N = response tokens) list the masked entries in row-major order, computed on
    the host so scoring needs no device sync (boolean-mask indexing would wait for the GPU).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lens: list[int]
    max_seqlen: int
    num_pad: int
    response_index: torch.Tensor | None = None
    response_mask: torch.Tensor | None = None
    response_tokens: torch.Tensor | None = None  # [B, R] the response token ids (0 past each end)
    flat_response_index: torch.Tensor | None = None  # [N] response_index[response_mask]
    flat_response_tokens: torch.Tensor | None = None  # [N] response_tokens[response_mask]
    flat_response_slot: torch.Tensor | None = None  # [N] i * R + j of each masked entry [i, j]
    layout: DocumentLayout | None = None  # the documents for varlen attention, computed here on the host

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def pack(sequences: Sequence[torch.Tensor | Sequence[int]], *, pad_id: int, prompt_lens: Sequence[int] | None = None,
         pad_to_multiple: int = 1, device: torch.device | str | None = None,
         share_prompts: bool = False) -> PackedBatch:
    """Concatenate 1-D token sequences into a PackedBatch.

    sequences: B tensors/lists of shape [L_i] (prompt + response). prompt_lens: B ints; response i
    is sequence i after its first prompt_lens[i] tokens (prompt_lens[i] >= 1, since the first
    token has no log-prob). pad_to_multiple pads T up (CUDA-graph / sequence-parallel friendly).

    share_prompts=True (needs prompt_lens): consecutive sequences with the same prompt keep it once.
    The first is packed whole; each next one adds only its response, with positions continuing from
    the prompt length, so models.document_attention.DocumentAttention lets it see the shared prompt (a GRPO group
    of n samples costs P + sum(R_i) tokens instead of n P + sum(R_i)). Per-position `labels` then
    cannot hold every response's first token (they share one predicting position): score with
    response_index / response_tokens (`gather_response_logprobs`); cu_seqlens / seq_lens describe
    the packed segments rather than the sequences (a member with an empty response: a 0-length one).
    """
    if not sequences:
        raise ValueError("pack() needs at least one sequence")
    if device is None:
        device = sequences[0].device if torch.is_tensor(sequences[0]) else "cpu"
    if all(torch.is_tensor(s) for s in sequences):
        flat = torch.cat([s.reshape(-1) for s in sequences]).to("cpu", torch.long).numpy()
        lens = np.array([s.numel() for s in sequences], dtype=np.int64)
    else:
        parts = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sequences]
        flat, lens = np.concatenate(parts), np.array([len(s) for s in parts], dtype=np.int64)
    if share_prompts and prompt_lens is None:
        raise ValueError("pack(share_prompts=True) needs prompt_lens")
    if prompt_lens is None:
        if lens.min() < 1:
            raise ValueError(f"pack() got an empty sequence (lengths {lens.tolist()})")
        return _assemble(flat, lens, np.zeros_like(lens), None, pad_id=pad_id, pad_to_multiple=pad_to_multiple,
                         device=device)
    p = _check_prompt_lens(prompt_lens, lens)
    first = _group_starts(flat, lens, p) if share_prompts else np.ones(len(lens), dtype=bool)
    # each sequence's segment in the row: whole for a group's first member, else its response only
    seg_lens = np.where(first, lens, lens - p)
    src = np.cumsum(lens) - lens + np.where(first, 0, p)
    row = flat if first.all() else flat[_ranges(src, seg_lens)]
    return _assemble(row, seg_lens, np.where(first, 0, p), (p, lens - p, first), pad_id=pad_id,
                     pad_to_multiple=pad_to_multiple, device=device)


def pack_prompt_responses(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, pad_id: int,
                          pad_to_multiple: int = 1, device: torch.device | str = "cpu",
                          share_prompts: bool = False) -> PackedBatch:
    """pack([p + r for p, r in zip(prompts, responses)], prompt_lens=[len(p) ...], ...) from token
    lists (ppo.batch.experience.Sample's prompt_ids / response_ids) without building the concatenated
    lists, and, sharing prompts, reading each group's prompt once. Same PackedBatch, bit for bit."""
    if not prompts or len(prompts) != len(responses):
        raise ValueError(f"pack_prompt_responses needs matching, non-empty prompts ({len(prompts)}) and "
                         f"responses ({len(responses)})")
    b = len(prompts)
    p = np.fromiter(map(len, prompts), dtype=np.int64, count=b)
    r = np.fromiter(map(len, responses), dtype=np.int64, count=b)
    _check_prompt_lens(p, p + r)
    first = np.ones(b, dtype=bool)
    if share_prompts:  # list == is C-level; a group's samples often even share the list object
        first[1:] = [prompts[i] != prompts[i - 1] for i in range(1, b)]
    pieces = chain.from_iterable((prompts[i], responses[i]) if first[i] else (responses[i],) for i in range(b))
    seg_lens = np.where(first, p + r, r)
    row = np.fromiter(chain.from_iterable(pieces), dtype=np.int64, count=int(seg_lens.sum()))
    return _assemble(row, seg_lens, np.where(first, 0, p), (p, r, first), pad_id=pad_id,
                     pad_to_multiple=pad_to_multiple, device=device)


def pack_routing(prompts: Sequence[Sequence[int]], routes: Sequence[torch.Tensor], *, num_tokens: int,
                 share_prompts: bool = False, device: torch.device | str = "cpu") -> torch.Tensor:
    """The rollout engine's experts at every position of pack_prompt_responses(prompts, responses, ...)'s row:
    [num_tokens, L_moe, k], -1 where it recorded none (each sequence's last token, which it sampled and never
    ran, and the padding). routes[i]: sample i's Completion.routed_experts [P_i + R_i - 1, L_moe, k]; sharing
    prompts, a group's prompt positions take its first sample's records (as the row holds its first prompt)."""
    pieces = []
    for i, (prompt, rec) in enumerate(zip(prompts, routes)):
        first = not share_prompts or i == 0 or prompts[i] != prompts[i - 1]
        pieces += [rec if first else rec[len(prompt):], torch.full((1, *rec.shape[1:]), -1, dtype=rec.dtype)]
    row = torch.cat(pieces)
    if row.shape[0] < num_tokens:
        row = torch.cat([row, torch.full((num_tokens - row.shape[0], *row.shape[1:]), -1, dtype=row.dtype)])
    return row.to(device, non_blocking=True)


def prompt_groups(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Runs of consecutive indices whose prompts are identical (a GRPO group's n samples)."""
    groups: list[list[int]] = []
    for i, p in enumerate(prompts):
        if groups and list(prompts[groups[-1][0]]) == list(p):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _check_prompt_lens(prompt_lens, lens: np.ndarray) -> np.ndarray:
    p = np.asarray(prompt_lens, dtype=np.int64).reshape(-1)
    if len(p) != len(lens):
        raise ValueError(f"prompt_lens has {len(p)} entries for {len(lens)} sequences")
    bad = np.flatnonzero((p < 1) | (p > lens))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"sequence {i}: prompt_len {int(p[i])} must be in [1, length {int(lens[i])}]")
    return p


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated aranges [starts[k], starts[k] + lens[k]) (lens >= 0) as one int64 index array."""
    return np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(starts - (np.cumsum(lens) - lens), lens)


def _group_starts(flat: np.ndarray, lens: np.ndarray, p: np.ndarray) -> np.ndarray:
    """[B] bool: sequence i starts a new prompt group (its prompt differs from sequence i-1's)."""
    first = np.ones(len(lens), dtype=bool)
    cand = np.flatnonzero(p[1:] == p[:-1]) + 1  # same prompt length as the previous one: compare tokens
    if len(cand):
        offs = np.cumsum(lens) - lens
        n = p[cand]
        differs = flat[_ranges(offs[cand], n)] != flat[_ranges(offs[cand - 1], n)]
        first[cand] = np.add.reduceat(differs, np.cumsum(n) - n) > 0  # n >= 1: no empty reduce ranges
    return first


def _assemble(row: np.ndarray, seg_lens: np.ndarray, pos_start: np.ndarray, responses, *, pad_id: int,
              pad_to_multiple: int, device) -> PackedBatch:
    """The PackedBatch of a row of segments: row [total] int64 (the segments' tokens, concatenated),
    seg_lens / pos_start [S] (the position of each segment's first token), responses None or
    (prompt_lens, response_lens, first) [B] with S == B: segment i holds sequence i's response, after
    its prompt when first[i], else after the prompt of the nearest group start before it."""
    s = len(seg_lens)
    cu = np.zeros(s + 1, dtype=np.int64)
    np.cumsum(seg_lens, out=cu[1:])
    total = int(cu[-1])
    t = -(-total // pad_to_multiple) * pad_to_multiple
    b, r, n = 0, 0, 0
    if responses is not None:
        p, r_lens, first = responses
        b, r, n = len(r_lens), max(int(r_lens.max()), 1), int(r_lens.sum())
    # every integer array in one host buffer: int64 sections first, so each section stays aligned
    sections = {name: (t, torch.int64) for name in ("input_ids", "position_ids", "labels")}
    if responses is not None:
        sections |= {name: (b * r, torch.int64) for name in ("response_index", "response_tokens")}
        sections |= {name: (n, torch.int64) for name in ("flat_response_index", "flat_response_tokens",
                                                          "flat_response_slot")}
    sections["cu_seqlens"] = (s + 1, torch.int32)
    if responses is not None:
        sections["response_mask"] = (b * r, torch.bool)
    buf = _HostBuffer(sections, device=device)
    a = buf.arrays
    ids, pos, labels = a["input_ids"], a["position_ids"], a["labels"]
    ids[:total], ids[total:] = row, pad_id
    # positions restart per segment (at pos_start) and for the padding tail
    pos[:total] = np.arange(total) - np.repeat(cu[:-1] - pos_start, seg_lens)
    pos[total:] = np.arange(t - total)
    labels[:-1], labels[-1] = ids[1:], pad_id  # the next token; none at a segment's end or in the padding
    labels[cu[1:] - 1] = pad_id
    labels[total:] = pad_id
    a["cu_seqlens"][:] = cu
    if responses is not None:
        _fill_responses(a, ids, cu, p, r_lens, first)
    out = buf.to_device()
    for name in ("input_ids", "position_ids", "labels"):
        out[name] = out[name][None]
    for name in ("response_index", "response_tokens", "response_mask"):
        if name in out:
            out[name] = out[name].view(b, r)
    doc = host_layout(pos[None])
    doc |= copy_to_device({k: torch.from_numpy(doc[k]) for k in DEVICE_ARRAYS if k in doc}, device)
    return PackedBatch(**out, seq_lens=seg_lens.tolist(), max_seqlen=int(seg_lens.max()), num_pad=t - total,
                       layout=DocumentLayout.from_arrays(doc, device))


def _fill_responses(a: dict[str, np.ndarray], ids: np.ndarray, cu: np.ndarray, p: np.ndarray, r_lens: np.ndarray,
                    first: np.ndarray) -> None:
    """Write the response fields into the host arrays `a`, as [B, R] grids first (one broadcast each, no
    per-token index arithmetic), whose masked entries in row-major order are the flat_* lists."""
    b, r = len(r_lens), len(a["response_mask"]) // len(r_lens)
    mask, index, tokens = (a[k].reshape(b, r) for k in ("response_mask", "response_index", "response_tokens"))
    np.less(np.arange(r), r_lens[:, None], out=mask)
    # response token j of sequence i sits at start[i] + j and is predicted at the position before,
    # except j = 0: predicted by the last token of the (possibly shared) prompt, at its group's start
    start = cu[:-1] + np.where(first, p, 0)
    np.add(start[:, None], np.arange(r), out=index)
    np.take(ids, index, out=tokens, mode="clip")  # past a response's end: clipped, zeroed below
    index -= 1
    index[:, 0] = (cu[:-1] + p - 1)[np.flatnonzero(first)][np.cumsum(first) - 1]
    if len(a["flat_response_slot"]) < mask.size:  # some responses end before R: zero past each end
        index *= mask
        tokens *= mask
    flat_mask = mask.reshape(-1)  # boolean indexing: np.compress / take are several times slower here
    a["flat_response_index"][:] = index.reshape(-1)[flat_mask]
    a["flat_response_tokens"][:] = tokens.reshape(-1)[flat_mask]
    a["flat_response_slot"][:] = np.flatnonzero(flat_mask)


def copy_to_device(tensors: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """CPU tensors (any dtypes, shapes) -> contiguous copies on `device` through one pinned buffer and
    one non-blocking copy (a pageable `.to(cuda)` each would wait for the GPU once per tensor)."""
    order = sorted(tensors, key=lambda k: -tensors[k].element_size())  # widest first: aligned sections
    buf = _HostBuffer({k: (tensors[k].numel(), tensors[k].dtype) for k in order}, device=device)
    for k in order:
        buf.host[k].copy_(tensors[k].reshape(-1))
    return {k: v.view(tensors[k].shape) for k, v in buf.to_device().items()}


class _HostBuffer:
    """Named 1-D tensors carved out of one host buffer, in the order given (put wider dtypes first to
    keep every view aligned): `host` as tensors, `arrays` as numpy arrays. Pinned when the target is
    CUDA, so `to_device` is one non-blocking copy; the caching host allocator does not hand a pinned
    block out again before the copies recorded on it have run, so the buffer may be dropped right after."""

    def __init__(self, sections: dict[str, tuple[int, torch.dtype]], *, device):
        self.device = torch.device(device)
        self.sections: dict[str, tuple[int, int, torch.dtype]] = {}  # name -> (byte offset, bytes, dtype)
        at = 0
        for name, (count, dtype) in sections.items():
            self.sections[name] = (at, count * dtype.itemsize, dtype)
            at += count * dtype.itemsize
        self.data = torch.empty(at, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self.host = self._views(self.data)

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        return {name: t.numpy() for name, t in self.host.items()}

    def _views(self, data: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: data[o:o + size].view(dt) for name, (o, size, dt) in self.sections.items()}

    def to_device(self) -> dict[str, torch.Tensor]:
        """The sections as 1-D tensors on the device (views of one copy of the buffer)."""
        return self._views(self.data if self.device.type == "cpu" else self.data.to(self.device, non_blocking=True))


def gather_response_logprobs(hidden: torch.Tensor, packed: PackedBatch, token_logprobs) -> tuple:
    """Score only the response tokens: hidden [T, H] at each response token's predicting position ->
    token_logprobs(hidden_sel [N, H], labels [N]) -> (logp [N], entropy [N] | None) -> [B, R] each
    (0 past each end). Works for shared-prompt packs (where per-position labels cannot) and skips the
    LM head on prompt tokens. Differentiable; no device sync (the flat indices come from the host)."""
    if packed.flat_response_index is None:
        raise ValueError("gather_response_logprobs needs pack(..., prompt_lens=...)")
    b, r = packed.response_mask.shape
    logp, ent = token_logprobs(hidden[packed.flat_response_index], packed.flat_response_tokens)

    def spread(x):  # [N] -> [B, R]; an index_put, whose backward is a gather (masked_scatter's would sync)
        return None if x is None else x.new_zeros(b * r).index_put((packed.flat_response_slot,), x).view(b, r)

    return spread(logp), spread(ent)


def _flat(per_token: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """[1, T, ...] or [T, ...] -> [T, ...]."""
    if per_token.dim() >= 2 and per_token.shape[0] == 1 and per_token.shape[1] == packed.num_tokens:
        return per_token[0]
    if per_token.shape[0] != packed.num_tokens:
        raise ValueError(f"per-token tensor of shape {tuple(per_token.shape)} does not match the packed length "
                         f"{packed.num_tokens}")
    return per_token


def unpack(per_token: torch.Tensor, packed: PackedBatch) -> list[torch.Tensor]:
    """[1, T, ...] per-token outputs -> B tensors [L_i, ...] (padding tail dropped)."""
    x = _flat(per_token, packed)
    return list(torch.split(x[: sum(packed.seq_lens)], packed.seq_lens))


def unpack_responses(per_token: torch.Tensor, packed: PackedBatch, *, pad_value: float = 0.0) -> torch.Tensor:
    """Per-token outputs at the *predicting* positions -> response-aligned [B, R, ...].

    per_token: [1, T, ...] (e.g. log-probs of `packed.labels`, entropies, values). Entry [i, j] is
    the output for response token j of sequence i; positions past a response end hold pad_value.
    Differentiable (a gather).
    """
    if packed.response_index is None:
        raise ValueError("unpack_responses needs pack(..., prompt_lens=...) to know where responses start")
    x = _flat(per_token, packed)
    out = x[packed.response_index]  # [B, R, ...]
    m = packed.response_mask.view(*packed.response_mask.shape, *([1] * (out.dim() - 2)))
    return torch.where(m, out, torch.full_like(out, pad_value))


def responses_to_packed(x: torch.Tensor, packed: PackedBatch, *, fill: float = 0.0) -> torch.Tensor:
    """Inverse of unpack_responses: [B, R] response-aligned values -> [1, T] at the predicting
    positions (fill elsewhere); e.g. advantages for a loss computed on the packed row."""
    if packed.response_index is None:
        raise ValueError("responses_to_packed needs pack(..., prompt_lens=...)")
    out = torch.full((packed.num_tokens,), fill, dtype=x.dtype, device=x.device)
    m = packed.response_mask
    out[packed.response_index[m]] = x[m]
    return out[None]
