"""Packed (varlen) attention of a PPO update micro-batch: FlashAttention-2 (what torch's varlen_attn runs)
against cuDNN's ragged attention (aten._cudnn_attention_forward/backward with cumulative lengths), the
CUTLASS memory-efficient kernel (varlen, causal from the bottom right), FlexAttention over the packed
sequence, and SDPA's fused kernels (cuDNN, FA2, memory-efficient) on the responses as one dense batch
(dense_rows), forward and backward, with the numerics of each against FA2.

    python -m bench.varlen_attention --groups 11 --prompt-len 128 --response-len 256 --samples 8

The layout is trainer.share_prompts' packing of GRPO groups: each prompt a causal segment of its own, each
of its `samples` responses a continuation segment whose queries see the prompt's keys and their own (keys
[prompt + response], causal aligned bottom-right). 16 query heads of 128, K/V expanded to them (as the
model does on torches without enable_gqa), bf16; FlexAttention (flex_row) instead reads the prompt's keys in
place and keeps 8 grouped K/V heads. TFLOP/s counts the causal work only (each query's keys up to itself).
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch


def layout(groups: int, prompt_len: int, response_len: int, samples: int) -> tuple[list[int], list[int]]:
    """Query and key lengths of every segment: per group its prompt, then its responses."""
    q, k = [], []
    for _ in range(groups):
        q.append(prompt_len)
        k.append(prompt_len)
        q += [response_len] * samples
        k += [prompt_len + response_len] * samples
    return q, k


def causal_flops(q_lens: list[int], k_lens: list[int], heads: int, dim: int) -> float:
    """Forward FLOPs of QK^T and PV over the keys each query sees (bottom-right causal)."""
    pairs = sum(sum(kl - ql + i + 1 for i in range(ql)) for ql, kl in zip(q_lens, k_lens))
    return 4.0 * pairs * heads * dim


def cumulative(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def flash(q, k, v, cq, ck, mq, mk, scale):
    out, lse, rng, _, _ = torch.ops.aten._flash_attention_forward(q, k, v, cq, ck, mq, mk, 0.0, True, False,
                                                                  scale=scale)
    return out, (lse, rng)


def flash_backward(g, q, k, v, out, saved, cq, ck, mq, mk, scale):
    lse, rng = saved
    unused = torch.empty(0, device=q.device)
    return torch.ops.aten._flash_attention_backward(g, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True, rng, unused,
                                                    scale=scale)


def cudnn(q, k, v, cq, ck, mq, mk, scale):
    r = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cq, ck, mq, mk, True, 0.0, True, False, scale=scale)
    return r[0], (r[1], r[6], r[7])


def cudnn_backward(g, q, k, v, out, saved, cq, ck, mq, mk, scale):
    lse, seed, offset = saved
    bias = torch.empty(0, device=q.device)
    return torch.ops.aten._cudnn_attention_backward(g, q, k, v, out, lse, seed, offset, bias, cq, ck, mq, mk, 0.0,
                                                    True, scale=scale)


def efficient(q, k, v, cq, ck, mq, mk, scale):
    """The CUTLASS memory-efficient kernel (SDPA's "efficient" backend), varlen with a batch of one and
    custom_mask_type 2 (causal from the bottom right)."""
    out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
        q[None], k[None], v[None], None, cq, ck, mq, mk, 0.0, 2, True, scale=scale)
    return out[0], (lse, seed, offset, out)


def efficient_backward(g, q, k, v, out, saved, cq, ck, mq, mk, scale):
    lse, seed, offset, out4 = saved
    dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
        g[None], q[None], k[None], v[None], None, out4, cq, ck, mq, mk, lse, 0.0, seed, offset, 2, False, scale=scale)
    return dq[0], dk[0], dv[0]


def rates(fwd_ms: float, bwd_ms: float, flops: float) -> dict:
    """Median times and the causal work's TFLOP/s (the backward does 2.5x the forward's FLOPs)."""
    return {"fwd_ms": round(fwd_ms, 4), "bwd_ms": round(bwd_ms, 4), "fwd_tflops": round(flops / fwd_ms / 1e9, 1),
            "bwd_tflops": round(2.5 * flops / bwd_ms / 1e9, 1)}


def time_backend(fwd, bwd, q, k, v, g, args: tuple, ref_out, ref_grads, flops: float) -> dict:
    """Errors against FA2's output and gradients, and the median forward / backward times."""
    import triton.testing

    out, saved = fwd(q, k, v, *args)
    grads = bwd(g, q, k, v, out, saved, *args)
    torch.cuda.synchronize()
    row = {"max_abs_err_out_vs_flash": (out.float() - ref_out.float()).abs().max().item(),
           "max_abs_err_grads_vs_flash": max((a.float() - b.float()).abs().max().item()
                                             for a, b in zip(grads, ref_grads))}
    fwd_ms = triton.testing.do_bench(lambda: fwd(q, k, v, *args), rep=200)
    bwd_ms = triton.testing.do_bench(lambda: bwd(g, q, k, v, out, saved, *args), rep=200)
    return row | rates(fwd_ms, bwd_ms, flops)


def flex_row(q_lens: list[int], samples: int, q, k_heads: int, g, flops: float, scale: float) -> dict:
    """FlexAttention (Triton, compiled) over the packed sequence itself: each response's queries see its
    prompt's keys in place (no gathered copies) and the K/V heads stay grouped (enable_gqa, no expansion).
    Checked against FA2 on the gathered, expanded layout of the same K/V."""
    import triton.testing
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    t, h, d = q.shape
    seg, grp, prompt, gather, k_lens = [], [], [], [], []
    at = 0
    for i, ql in enumerate(q_lens):  # per packed token: its segment, its group, whether a prompt token
        is_prompt = i % (samples + 1) == 0
        if is_prompt:
            prompt_at = list(range(at, at + ql))
        seg += [i] * ql
        grp += [i // (samples + 1)] * ql
        prompt += [is_prompt] * ql
        own = list(range(at, at + ql))
        gather += own if is_prompt else prompt_at + own  # FA2's keys of this segment
        k_lens.append(ql if is_prompt else len(prompt_at) + ql)
        at += ql
    seg, grp, prompt = (torch.tensor(x, device="cuda") for x in (seg, grp, prompt))

    def mask_mod(b, hh, qi, ki):
        own = (seg[qi] == seg[ki]) & (ki <= qi)
        return own | ((grp[qi] == grp[ki]) & prompt[ki] & ~prompt[qi])

    block_mask = create_block_mask(mask_mod, None, None, t, t, device="cuda")
    mask_ms = triton.testing.do_bench(lambda: create_block_mask(mask_mod, None, None, t, t, device="cuda"), rep=100)
    kv = [torch.randn(1, k_heads, t, d, device="cuda", dtype=q.dtype, requires_grad=True) for _ in range(2)]
    qp = q.transpose(0, 1)[None].detach().clone().requires_grad_()
    flex = torch.compile(flex_attention)

    def fwd():
        return flex(qp, *kv, block_mask=block_mask, enable_gqa=True, scale=scale)

    out = fwd()
    idx = torch.tensor(gather, device="cuda")
    kx, vx = (x[0].transpose(0, 1)[idx].repeat_interleave(h // k_heads, dim=1) for x in kv)
    ref, _ = flash(q, kx.detach(), vx.detach(), cumulative(q_lens), cumulative(k_lens), max(q_lens), max(k_lens),
                   scale)
    err = (out[0].transpose(0, 1).float() - ref.float()).abs().max().item()
    fwd_ms = triton.testing.do_bench(fwd, rep=200)
    gp = g.transpose(0, 1)[None].contiguous()
    bwd_ms = triton.testing.do_bench(lambda: out.backward(gp, retain_graph=True), rep=200, grad_to_none=[qp, *kv])
    return {"max_abs_err_out_vs_flash": err, **rates(fwd_ms, bwd_ms, flops), "block_mask_ms": round(mask_ms, 3),
            "kv_heads": k_heads}


def dense_rows(q, k, v, g, q_lens: list[int], k_lens: list[int], samples: int, ref_out, flops: float,
               scale: float) -> dict:
    """The responses as one dense batch for SDPA's fused kernels: each row's queries are [its prompt's; its
    own] and its keys the segment's [prompt; own], square and causal, so the first response of each group
    also yields its prompt's outputs (the other copies' prompt rows get no gradient). Needs equal response
    lengths. Rows: cuDNN and dense FA2 at 16 K/V heads, cuDNN with 8 grouped heads (enable_gqa), and cuDNN
    with only the response queries (its causal alignment shows in the error against FA2's bottom-right)."""
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cq, ck = cumulative(q_lens).tolist(), cumulative(k_lens).tolist()
    qs, ks, vs, gs, refs = [], [], [], [], []
    for i in range(len(q_lens)):
        if i % (samples + 1) == 0:
            p, first = i, True
            continue
        qs.append(torch.cat([q[cq[p]:cq[p + 1]], q[cq[i]:cq[i + 1]]]))
        ks.append(k[ck[i]:ck[i + 1]])
        vs.append(v[ck[i]:ck[i + 1]])
        gp = g[cq[p]:cq[p + 1]] if first else torch.zeros_like(g[cq[p]:cq[p + 1]])
        gs.append(torch.cat([gp, g[cq[i]:cq[i + 1]]]))
        refs.append(ref_out[cq[i]:cq[i + 1]])
        first = False
    prompt = q_lens[0]
    qd, kd, vd, gd = (torch.stack(x).transpose(1, 2) for x in (qs, ks, vs, gs))  # [B, H, S, D], BSHD strides
    ref = torch.stack(refs).transpose(1, 2)
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    cases = {"cudnn_dense": ("cudnn", False, False), "flash_dense": ("flash", False, False),
             "efficient_dense": ("efficient", False, False), "cudnn_dense_gqa": ("cudnn", True, False),
             "cudnn_dense_responses_only": ("cudnn", False, True)}
    rows = {}
    for name, (backend, gqa, responses_only) in cases.items():
        try:
            qx = (qd[:, :, prompt:] if responses_only else qd).detach().clone().requires_grad_()
            kx, vx = ((x[:, ::2] if gqa else x).detach().clone().requires_grad_() for x in (kd, vd))
            gx = gd[:, :, prompt:] if responses_only else gd

            def fwd(qx=qx, kx=kx, vx=vx, backend=backend, gqa=gqa):
                with sdpa_kernel([backends[backend]]):
                    return torch.nn.functional.scaled_dot_product_attention(qx, kx, vx, is_causal=True, scale=scale,
                                                                            enable_gqa=gqa)

            out = fwd()
            got = out if responses_only else out[:, :, prompt:]
            row = {}
            if not gqa:
                row["max_abs_err_response_out_vs_flash"] = (got.float() - ref.float()).abs().max().item()
            else:  # against the same kernel on explicitly expanded heads
                with sdpa_kernel([backends[backend]]):
                    exp = torch.nn.functional.scaled_dot_product_attention(
                        qx, kx.repeat_interleave(2, 1), vx.repeat_interleave(2, 1), is_causal=True, scale=scale)
                row["max_abs_err_vs_expanded"] = (out.float() - exp.float()).abs().max().item()
            with torch.no_grad():
                fwd_ms = triton.testing.do_bench(fwd, rep=200)
            bwd_ms = triton.testing.do_bench(lambda out=out, gx=gx: out.backward(gx, retain_graph=True), rep=200,
                                             grad_to_none=[qx, kx, vx])
            row |= rates(fwd_ms, bwd_ms, flops) | {"shape_q": list(qx.shape), "shape_k": list(kx.shape)}
        except Exception as e:  # noqa: BLE001 - a backend that rejects the layout is reported, not fatal
            row = {"error": f"{type(e).__name__}: {e}"[:400]}
        rows[name] = row
        print(name, row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=11)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    h, d = args.heads, args.head_dim
    q_lens, k_lens = layout(args.groups, args.prompt_len, args.response_len, args.samples)
    cq, ck = cumulative(q_lens), cumulative(k_lens)
    mq, mk = max(q_lens), max(k_lens)
    q = torch.randn(sum(q_lens), h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(k_lens), h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    g = torch.randn_like(q)
    scale = d ** -0.5
    flops = causal_flops(q_lens, k_lens, h, d)
    ref_out, ref_saved = flash(q, k, v, cq, ck, mq, mk, scale)
    ref_grads = flash_backward(g, q, k, v, ref_out, ref_saved, cq, ck, mq, mk, scale)
    result = {"bench": "varlen_attention", "device_name": torch.cuda.get_device_name(), "dtype": "bfloat16",
              "heads": h, "head_dim": d, "segments": len(q_lens), "q_tokens": sum(q_lens), "k_tokens": sum(k_lens),
              "layout": vars(args), "causal_fwd_gflop": round(flops / 1e9, 1), "kernels": {}}
    args_ = (cq, ck, mq, mk, scale)
    for name, fwd, bwd in (("flash", flash, flash_backward), ("cudnn", cudnn, cudnn_backward),
                           ("efficient", efficient, efficient_backward)):
        try:
            row = time_backend(fwd, bwd, q, k, v, g, args_, ref_out, ref_grads, flops)
        except Exception as e:  # noqa: BLE001 - a backend that rejects the layout is reported, not fatal
            row = {"error": f"{type(e).__name__}: {e}"[:400]}
        result["kernels"][name] = row
        print(name, row, flush=True)
    if args.samples:
        try:
            row = flex_row(q_lens, args.samples, q, h // 2, g, flops, scale)
        except Exception as e:  # noqa: BLE001
            row = {"error": f"{type(e).__name__}: {e}"[:400]}
        result["kernels"]["flex"] = row
        print("flex", row, flush=True)
        result["kernels"] |= dense_rows(q, k, v, g, q_lens, k_lens, args.samples, ref_out, flops, scale)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
