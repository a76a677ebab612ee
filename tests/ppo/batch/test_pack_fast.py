"""ppo/batch/packing.py's vectorised packers equal the per-sequence loop they replaced, field for field.

The oracle below is the original loop implementation of pack() (per-sequence torch ops, prompt
groups found by comparing token lists), kept verbatim in spirit: every PackedBatch field of the
fast packers must equal it exactly, over random shapes (shared prompts on and off, uneven groups,
single-member groups, empty responses, padding, one sequence).
"""

from __future__ import annotations

import random

import pytest
import torch

from ppo.batch.packing import copy_to_device, gather_response_logprobs, pack, pack_prompt_responses, prompt_groups


def _oracle(seqs, *, pad_id, prompt_lens, pad_to_multiple=1, share_prompts=False):
    """The pre-vectorisation pack() (CPU): returns a dict of its fields."""
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in seqs]
    if share_prompts:
        return _oracle_shared(seqs, pad_id=pad_id, prompt_lens=list(prompt_lens), pad_to_multiple=pad_to_multiple)
    lens = [int(s.numel()) for s in seqs]
    total = sum(lens)
    t = -(-total // pad_to_multiple) * pad_to_multiple
    num_pad = t - total
    ids = torch.cat(seqs + [torch.full((num_pad,), pad_id, dtype=torch.long)])
    pos = torch.cat([torch.arange(n) for n in lens] + [torch.arange(num_pad)])
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    labels = torch.roll(ids, -1)
    labels[cu[1:].long() - 1] = pad_id
    labels[total:] = pad_id
    out = dict(input_ids=ids[None], position_ids=pos[None], labels=labels[None], cu_seqlens=cu, seq_lens=lens,
               max_seqlen=max(lens), num_pad=num_pad)
    if prompt_lens is not None:
        r_lens = [n - p for n, p in zip(lens, prompt_lens)]
        r = max(max(r_lens), 1)
        j = torch.arange(r)
        start = cu[:-1].long() + torch.tensor(prompt_lens, dtype=torch.long) - 1
        resp_mask = j[None] < torch.tensor(r_lens)[:, None]
        resp_idx = torch.where(resp_mask, start[:, None] + j[None], torch.zeros((), dtype=torch.long))
        resp_tok = torch.where(resp_mask, labels[resp_idx], torch.zeros((), dtype=torch.long))
        out.update(response_index=resp_idx, response_mask=resp_mask, response_tokens=resp_tok)
    return out


def _oracle_shared(seqs, *, pad_id, prompt_lens, pad_to_multiple):
    groups = prompt_groups([s[:p].tolist() for s, p in zip(seqs, prompt_lens)])
    ids, pos, seg_lens = [], [], []
    r_lens = [s.numel() - p for s, p in zip(seqs, prompt_lens)]
    r = max(max(r_lens), 1)
    resp_idx = torch.zeros(len(seqs), r, dtype=torch.long)
    resp_tok = torch.zeros(len(seqs), r, dtype=torch.long)
    at = 0
    for g in groups:
        p = prompt_lens[g[0]]
        last_prompt = at + p - 1
        for k, i in enumerate(g):
            part = seqs[i] if k == 0 else seqs[i][p:]
            ids.append(part)
            pos.append(torch.arange(part.numel()) + (0 if k == 0 else p))
            seg_lens.append(part.numel())
            first = at + (p if k == 0 else 0)
            n = r_lens[i]
            if n:
                resp_idx[i, 0] = last_prompt
                resp_idx[i, 1:n] = torch.arange(first, first + n - 1)
                resp_tok[i, :n] = seqs[i][p:]
            at += part.numel()
    total = at
    t = -(-total // pad_to_multiple) * pad_to_multiple
    num_pad = t - total
    ids = torch.cat(ids + [torch.full((num_pad,), pad_id, dtype=torch.long)])
    pos = torch.cat(pos + [torch.arange(num_pad)])
    cu = torch.zeros(len(seg_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seg_lens), 0)
    labels = torch.roll(ids, -1)
    labels[cu[1:].long() - 1] = pad_id
    labels[total:] = pad_id
    resp_mask = torch.arange(r)[None] < torch.tensor(r_lens)[:, None]
    return dict(input_ids=ids[None], position_ids=pos[None], labels=labels[None], cu_seqlens=cu, seq_lens=seg_lens,
                max_seqlen=max(seg_lens), num_pad=num_pad, response_index=resp_idx, response_mask=resp_mask,
                response_tokens=resp_tok)


def _case(rng: random.Random, *, vocab: int = 50):
    """Random groups: (prompts, responses) token lists; uneven group sizes, empty responses, and
    neighbouring groups that sometimes share a prompt length or even a prompt prefix."""
    prompts, responses = [], []
    for _ in range(rng.randint(1, 6)):
        plen = rng.choice([1, 2, 3, 5, 8])
        prompt = [rng.randrange(vocab) for _ in range(plen)]
        if prompts and rng.random() < 0.3:  # same length as the previous prompt, one token different
            prompt = list(prompts[-1])
            prompt[rng.randrange(len(prompt))] += vocab
        for _ in range(rng.choice([1, 1, 2, 3, 8])):
            prompts.append(prompt if rng.random() < 0.5 else list(prompt))  # shared object or an equal copy
            responses.append([rng.randrange(vocab) for _ in range(rng.choice([0, 1, 2, 7, 20]))])
    return prompts, responses


def _check(fast, want):
    for name, value in want.items():
        got = getattr(fast, name)
        if torch.is_tensor(value):
            assert got.dtype == value.dtype and got.shape == value.shape, name
            assert torch.equal(got.cpu(), value), name
        else:
            assert got == value, name


@pytest.mark.parametrize("share", [False, True])
def test_fast_packers_equal_the_loop_oracle(share):
    rng = random.Random(0)
    for _ in range(300):
        prompts, responses = _case(rng)
        seqs = [p + r for p, r in zip(prompts, responses)]
        plens = [len(p) for p in prompts]
        mult = rng.choice([1, 1, 4, 7])
        want = _oracle(seqs, pad_id=-1, prompt_lens=plens, pad_to_multiple=mult, share_prompts=share)
        tensors = [torch.tensor(s, dtype=torch.long) for s in seqs]
        for fast in (pack(seqs, pad_id=-1, prompt_lens=plens, pad_to_multiple=mult, share_prompts=share),
                     pack(tensors, pad_id=-1, prompt_lens=plens, pad_to_multiple=mult, share_prompts=share),
                     pack_prompt_responses(prompts, responses, pad_id=-1, pad_to_multiple=mult, share_prompts=share)):
            _check(fast, want)
            m = fast.response_mask
            assert torch.equal(fast.flat_response_index, fast.response_index[m])
            assert torch.equal(fast.flat_response_tokens, fast.response_tokens[m])
            assert torch.equal(fast.flat_response_slot, torch.arange(m.numel()).view(m.shape)[m])


def test_pack_without_prompt_lens_equals_the_oracle():
    rng = random.Random(1)
    for _ in range(50):
        seqs = [[rng.randrange(9) for _ in range(rng.randint(1, 9))] for _ in range(rng.randint(1, 5))]
        mult = rng.choice([1, 3])
        want = _oracle(seqs, pad_id=0, prompt_lens=None, pad_to_multiple=mult)
        fast = pack(seqs, pad_id=0, pad_to_multiple=mult)
        _check(fast, want)
        assert fast.response_index is None and fast.flat_response_index is None


def test_single_sequence_and_whole_prompt_edge_cases():
    for share in (False, True):
        for seq, plen in (([4], 1), ([4, 5, 6], 3), ([4, 5, 6], 1)):
            want = _oracle([seq], pad_id=0, prompt_lens=[plen], pad_to_multiple=4, share_prompts=share)
            _check(pack([seq], pad_id=0, prompt_lens=[plen], pad_to_multiple=4, share_prompts=share), want)
            _check(pack_prompt_responses([seq[:plen]], [seq[plen:]], pad_id=0, pad_to_multiple=4,
                                         share_prompts=share), want)
    with pytest.raises(ValueError, match="prompt_len 0"):
        pack_prompt_responses([[]], [[1]], pad_id=0)
    with pytest.raises(ValueError, match="empty sequence"):
        pack([[1], []], pad_id=0)


def test_gather_response_logprobs_matches_boolean_mask_scoring_with_grads():
    """The host-indexed (sync-free) scoring gives the same values and gradients, bit for bit, as
    indexing with the boolean mask and spreading with masked_scatter."""
    rng = random.Random(2)
    prompts, responses = _case(rng)
    p = pack_prompt_responses(prompts, responses, pad_id=0, share_prompts=True)
    hidden = torch.randn(p.num_tokens, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(60, 6, dtype=torch.float64)

    def token_logprobs(h, y):
        lp = torch.log_softmax(h @ w.t(), -1)
        return lp.gather(-1, y[:, None])[:, 0], -(lp.exp() * lp).sum(-1)

    logp, ent = gather_response_logprobs(hidden, p, token_logprobs)
    (logp.sum() + ent.sum()).backward()
    g, hidden.grad = hidden.grad, None
    m = p.response_mask
    ref_lp, ref_ent = token_logprobs(hidden[p.response_index[m]], p.response_tokens[m])
    ref_lp, ref_ent = (torch.zeros(m.shape, dtype=x.dtype).masked_scatter(m, x) for x in (ref_lp, ref_ent))
    (ref_lp.sum() + ref_ent.sum()).backward()
    assert torch.equal(logp, ref_lp) and torch.equal(ent, ref_ent) and torch.equal(g, hidden.grad)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_copy_to_device_keeps_every_dtype_shape_and_value(device):
    src = {"mask": torch.rand(3, 5) > 0.5, "old_logp": torch.randn(3, 5), "adv": torch.randn(3, 5, dtype=torch.float64),
           "bf": torch.randn(2, dtype=torch.bfloat16), "n": torch.arange(7, dtype=torch.int32)}
    got = copy_to_device(src, device)
    assert list(got) == ["adv", "old_logp", "n", "bf", "mask"]  # widest first keeps every section aligned
    for k, v in src.items():
        assert got[k].device.type == device and got[k].dtype == v.dtype and got[k].is_contiguous()
        assert torch.equal(got[k].cpu(), v), k


@pytest.mark.gpu
def test_cuda_pack_is_one_pinned_copy_and_equals_the_cpu_pack():
    rng = random.Random(3)
    prompts, responses = _case(rng)
    for share in (False, True):
        cpu = pack_prompt_responses(prompts, responses, pad_id=0, share_prompts=share, pad_to_multiple=8)
        gpu = pack_prompt_responses(prompts, responses, pad_id=0, share_prompts=share, pad_to_multiple=8,
                                    device="cuda")
        base = gpu.input_ids.untyped_storage().data_ptr()
        for name in ("input_ids", "position_ids", "labels", "cu_seqlens", "response_index", "response_mask",
                     "response_tokens", "flat_response_index", "flat_response_tokens", "flat_response_slot"):
            a, b = getattr(cpu, name), getattr(gpu, name)
            assert b.is_cuda and b.untyped_storage().data_ptr() == base, name  # views of one device copy
            assert torch.equal(a, b.cpu()), name


def test_packs_carry_the_document_layout_of_their_positions():
    # the varlen attention's segments and shared-prompt keys, computed on the host by the packer, equal
    # what DocumentAttention would derive from the device positions
    from models.document_layout import DocumentLayout

    gen = torch.Generator().manual_seed(3)
    prompts = [[5, 6, 7]] * 3 + [[9, 9]] * 2 + [[4]]
    responses = [torch.randint(1, 50, (int(n),), generator=gen).tolist() for n in (4, 0, 6, 2, 3, 5)]
    for share in (False, True):
        packed = pack_prompt_responses(prompts, responses, pad_id=0, share_prompts=share, pad_to_multiple=8)
        want = DocumentLayout.from_positions(packed.position_ids)
        got = packed.layout
        assert (got.max_len, got.continues, got.max_k) == (want.max_len, want.continues, want.max_k) and \
            got.continues == share
        for name in ("cu_seqlens", "key_index", "cu_seqlens_k", "own_index", "prefix_rows", "prefix_copies"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), name
