"""Model-side kernels of the PPO update: chunked log-probs vs full logits, packed-row attention.

    python -m bench.logprobs --model llama-1b --tokens 16384 --device cuda --chunks 1024,4096
    python -m bench.logprobs --model llama3-8b --tokens 16384 --device cuda --parts logprobs
    python -m bench.logprobs --model tiny --tokens 512 --device cpu          # CPU smoke run

logprobs: `compute_token_logprobs` (chunked, recomputing backward; with its fused Triton kernels and,
as chunked_*_torch, without them) against log_softmax over full
fp32 logits, forward+backward (w.r.t. hidden and lm_head weight) with the log-prob and entropy
terms of the PPO loss: time, peak memory, max |diff| of log-probs/entropy/grads, and MFU counting
the useful 6*N*V*H FLOPs (the chunked version does 8: it recomputes the logits in backward).
packed: one training forward+backward of the model on rows packed with uneven documents, through
DocumentAttention (varlen flash on GPU, mask on CPU) against the [B,1,T,T]-mask SDPA path and
against plain causal attention over the same tokens (the speed ceiling: same FLOPs minus the
cross-document ones). MFU uses 6*params + 6*layers*hidden*T_doc FLOPs per token (causal attention
over document lengths). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import (
    H200_BF16_FLOPS,
    add_device_args,
    emit_json,
    peak_memory_gb,
    reset_peak_memory,
    resolve_device,
    run_info,
    time_steps,
)
from models import DocumentAttention, build_model, compute_token_logprobs, preset_config, triton_logprobs


def _naive(hidden, weight, targets):
    logp_all = torch.log_softmax((hidden @ weight.t()).float(), dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def bench_logprobs(cfg, *, tokens: int, chunks: list[int], device, dtype, steps: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    h, v = cfg.hidden_size, cfg.vocab_size
    hidden = torch.randn(tokens, h, device=device, dtype=dtype, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, device=device, dtype=dtype, generator=gen) * h**-0.5).requires_grad_()
    targets = torch.randint(0, v, (tokens,), device=device, generator=gen)
    coef = torch.randn(tokens, device=device, generator=gen)
    impls = {f"chunked_{c}": (lambda c=c: compute_token_logprobs(hidden, weight, targets, chunk_size=c,
                                                                 with_entropy=True)) for c in chunks}
    if triton_logprobs.available(device):  # the torch path beside the fused kernels: what they buy
        impls |= {f"chunked_{c}_torch": (lambda c=c: compute_token_logprobs(
            hidden, weight, targets, chunk_size=c, with_entropy=True, fused=False)) for c in chunks}
    impls["naive"] = lambda: _naive(hidden, weight, targets)
    out, results = {}, {}
    for name, fn in impls.items():
        def step(fn=fn):
            hidden.grad = weight.grad = None
            lp, ent = fn()
            ((lp * coef).sum() + 0.01 * ent.sum()).backward()

        reset_peak_memory(device)
        try:
            times = time_steps(step, device=device, warmup=1, steps=steps)
        except torch.OutOfMemoryError:
            results[name] = {"oom": True}
            continue
        lp, ent = fn()
        out[name] = (lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
        sec = sorted(times)[len(times) // 2]
        results[name] = {"ms": sec * 1e3, "peak_gb": peak_memory_gb(device),
                         "mfu": 6 * tokens * v * h / sec / H200_BF16_FLOPS}
    chunked = f"chunked_{chunks[0]}"
    if chunked in out and "naive" in out:
        names = ("logprobs", "entropy", "grad_hidden", "grad_weight")
        results["max_abs_diff"] = {n: (a.float() - b.float()).abs().max().item()
                                   for n, a, b in zip(names, out[chunked], out["naive"])}
    return {"tokens": tokens, "vocab": v, "hidden": h, **results}


def _packed_batch(cfg, *, tokens: int, device, seed: int = 0):
    """One row of `tokens` tokens packed with documents of uneven length (64 .. tokens/4)."""
    gen = torch.Generator().manual_seed(seed)
    lengths, left = [], tokens
    while left > 0:
        n = min(left, int(torch.randint(64, max(65, tokens // 4), (1,), generator=gen)))
        lengths.append(n)
        left -= n
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids.to(device), pos.to(device), lengths


def bench_packed(cfg, *, tokens: int, device, dtype, steps: int) -> dict:
    model = build_model(cfg, dtype=dtype, device=device, seed=0)
    ids, pos, lengths = _packed_batch(cfg, tokens=tokens, device=device)
    n_params = cfg.matmul_params()  # lm_head matmul
    per_t2 = 6 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim  # causal: half of 12*L*d*T^2
    flops_doc = 6 * n_params * tokens + per_t2 * sum(n * n for n in lengths)
    flops_causal = 6 * n_params * tokens + per_t2 * tokens * tokens  # the ceiling attends across documents
    variants = {
        "document_" + ("varlen" if device.type == "cuda" else "mask"): lambda: DocumentAttention(pos),
        "document_mask": lambda: DocumentAttention(pos, backend="mask"),
        "causal_unpacked_ceiling": lambda: None,
    }
    results, outs = {"num_docs": len(lengths), "tokens": tokens}, {}
    for name, make_attn in variants.items():

        def step(make_attn=make_attn):
            model.zero_grad(set_to_none=True)
            logits = model(ids, pos, attn=make_attn())
            logits.float().logsumexp(-1).mean().backward()

        reset_peak_memory(device)
        try:
            times = time_steps(step, device=device, warmup=1, steps=steps)
        except torch.OutOfMemoryError:
            results[name] = {"oom": True}
            continue
        sec = sorted(times)[len(times) // 2]
        flops = flops_doc if name.startswith("document") else flops_causal
        results[name] = {"ms": sec * 1e3, "peak_gb": peak_memory_gb(device), "mfu": flops / sec / H200_BF16_FLOPS,
                         "tokens_per_s": tokens / sec}
        if name.startswith("document"):
            with torch.no_grad():
                outs[name] = model(ids, pos, attn=make_attn()).float()
    if len(outs) == 2:
        a, b = outs.values()
        results["max_abs_diff_vs_mask"] = (a - b).abs().max().item()
    return results


def main() -> None:
    p = add_device_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per log-prob batch / packed row")
    p.add_argument("--chunks", default="1024", help="comma list of chunk sizes to time, e.g. 512,1024,4096")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--parts", default="logprobs,packed", help="comma list of: logprobs, packed")
    args = p.parse_args()
    device, dtype = resolve_device(args)
    torch.manual_seed(0)
    cfg = preset_config(args.model)
    parts = set(args.parts.split(","))
    result = {"bench": "logprobs", "model": args.model, "dtype": str(dtype).removeprefix("torch.")}
    if "logprobs" in parts:
        chunks = [int(c) for c in args.chunks.split(",")]
        result["logprobs"] = bench_logprobs(cfg, tokens=args.tokens, chunks=chunks, device=device, dtype=dtype,
                                            steps=args.steps)
        print("logprobs:", result["logprobs"], flush=True)
    if "packed" in parts:
        result["packed"] = bench_packed(cfg, tokens=args.tokens, device=device, dtype=dtype, steps=args.steps)
        print("packed:", result["packed"], flush=True)
    emit_json({**result, **run_info(device)})


if __name__ == "__main__":
    main()
