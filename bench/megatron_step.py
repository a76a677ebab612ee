"""The megatron-core backend's training step for bench.train_step (`--backend megatron|both`).

Same work as the native step: `--batch` rows of `--seq` tokens, loss from final hidden states through the
chunked vocab-parallel log-prob kernel, optimizer step. megatron-core keeps bf16 parameters with fp32
master shards in its distributed optimizer (the issue's "fp32 master weights"), DDP with fp32 gradient
buffers; the whole batch is one micro-batch of its no-pipelining schedule (pp = 1) or `--microbatches`
of 1F1B (pp > 1). The model is built through parallel/backends.py like the PPO workers' (HF weights
first, each rank copying its slices); `compile` torch.compiles each megatron-core TransformerLayer
(parallel.backends.compile_megatron_layers), as the native bench compiles its decoder layers. The
distributed optimizer steps with torch's fused AdamW, as the native bench's optimizer.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict

import torch

from bench.common import H200_BF16_FLOPS, kernel_profile, peak_memory_gb, reset_peak_memory, time_steps
from models import preset_config
from models.document_attention import DocumentAttention
from ppo.algos.core_algos import policy_loss


def _build_runner(spec, args, *, device, dtype, mesh, dims):
    """(config, MegatronRunner with its optimizer) through the backend factory, like the PPO workers."""
    from models.build import build_model
    from parallel.backends import build_runner

    cfg = preset_config(args.model)
    # HF-named weights first (the factory copies this rank's slices), bf16 compute with fp32 masters
    model = build_model(cfg, dtype=torch.float32, device=device, init=False)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() >= 2 else p.fill_(1.0)
    attn = functools.partial(DocumentAttention, backend=spec.attn) if spec.mode == "ppo" else None
    runner = build_runner(model, backend="megatron", mesh=mesh, dims=dims, ac=spec.ac, param_dtype=dtype,
                          attn_factory=attn, compile=spec.compile)
    del model
    opt = runner.build_optimizer(lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0)
    return cfg, runner, opt


def run_megatron(spec, args, *, device, dtype, mesh, dims, make_batch, flops_per_token) -> dict:
    """One RunSpec with the megatron backend -> the same result keys as bench.train_step.run_one."""
    from parallel.runner import MicroBatch
    from parallel.vocab_parallel import vocab_parallel_token_logprobs

    if device.type != "cuda":
        raise RuntimeError("megatron backend: the training step needs CUDA (schedules, DDP, distributed optimizer)")
    if spec.ac == "selective":
        raise RuntimeError("megatron backend: selective activation checkpointing is not wired (use none or full)")
    cfg, runner, opt = _build_runner(spec, args, device=device, dtype=dtype, mesh=mesh, dims=dims)
    pgc = runner.pgc
    batch = make_batch(spec, args, cfg=cfg, device=device, dp_rank=mesh.get_local_rank("dp"))
    pos = batch["pos"] if batch["pos"] is not None else torch.arange(args.seq, device=device).expand(
        args.batch, args.seq).contiguous()
    # the whole batch is one micro-batch at pp = 1 (as the native step runs it); --microbatches under 1F1B
    n_mb = args.microbatches if dims.pp > 1 else 1
    if args.batch % n_mb:
        raise ValueError(f"--batch {args.batch} must be divisible by --microbatches {n_mb}")
    rows = [slice(i, i + args.batch // n_mb) for i in range(0, args.batch, args.batch // n_mb)]
    mbs = [MicroBatch(batch["ids"][r], pos[r]) for r in rows]
    denom = float(batch["mask"].sum())
    tp_group = pgc.tp if pgc.tp.size() > 1 else None

    def head_logprobs(hidden, k, with_entropy):
        w, start = runner.head("lm_head")
        targets = batch["targets"][rows[k]]
        lp, ent = vocab_parallel_token_logprobs(hidden.reshape(-1, hidden.shape[-1]), w, targets.reshape(-1),
                                                tp_group=tp_group, vocab_start=start, chunk_size=args.chunk,
                                                with_entropy=with_entropy)
        return lp.view(targets.shape), ent

    def loss_fn(hidden, k):
        logp, _ = head_logprobs(hidden, k, spec.mode == "ppo")
        r = rows[k]
        if spec.mode == "lm":
            loss = -(logp * batch["mask"][r]).sum() / denom
        else:
            loss, _ = policy_loss(logp, batch["old"][r], batch["adv"][r], batch["mask"][r], denom=denom)
        return loss, {"loss": loss.detach()}

    def logprobs():
        return runner.forward(mbs, reduce=lambda h, k: head_logprobs(h, k, False)[0])

    if spec.mode == "ppo":
        with torch.no_grad():
            old = logprobs()
        old = torch.cat(old) if old is not None else torch.zeros_like(batch["adv"])
        batch["old"] = old + 0.05 * torch.randn_like(old)
    metrics: dict = {}

    def step():
        out = runner.forward_backward(mbs, loss_fn=loss_fn)
        runner.optimizer_step(opt, max_norm=0.0)  # 0: no clipping, as the native bench's plain AdamW step
        if out:
            metrics["loss"] = torch.stack([m["loss"] for m in out]).sum()

    reset_peak_memory(device)
    times = time_steps(step, device=device, warmup=args.warmup, steps=args.steps)
    peak = peak_memory_gb(device)
    step_s = sorted(times)[len(times) // 2]
    tokens = args.batch * args.seq * dims.dp
    fpt = flops_per_token(cfg, context=batch["context"])
    loss = torch.tensor([float(metrics.get("loss", 0.0))], device=device)
    if dims.pp > 1:  # the loss lives on the last stage
        import torch.distributed as dist

        dist.all_reduce(loss, group=pgc.pp)
    res = dict(asdict(spec), backend="megatron", master="fp32", tokens_per_s=tokens / step_s,
               step_s=step_s, step_s_min=min(times), peak_mem_gb=peak,
               mfu=tokens * fpt / step_s / (dims.world_size * H200_BF16_FLOPS),
               mfu_all_params=tokens * flops_per_token(cfg, context=batch["context"], all_params=True) / step_s
               / (dims.world_size * H200_BF16_FLOPS), flops_per_token=fpt, loss=float(loss))
    if spec.mode == "ppo":
        with torch.no_grad():
            fwd = time_steps(logprobs, device=device, warmup=1, steps=args.steps)
        res["logprob_tokens_per_s"] = tokens / sorted(fwd)[len(fwd) // 2]
    if getattr(args, "profile", False):
        res["profile"] = kernel_profile(step, device=device)
    if not math.isfinite(res["loss"]):
        raise RuntimeError(f"megatron {spec}: non-finite loss {res['loss']}")
    return res
