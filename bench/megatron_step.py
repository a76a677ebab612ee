"""The megatron-core backend's training step for bench.train_step (`--backend megatron|both`).

Same work as the native step: `--batch` rows of `--seq` tokens, loss from final hidden states through the
chunked vocab-parallel log-prob kernel, optimizer step. megatron-core keeps bf16 parameters with fp32
master shards in its distributed optimizer (the issue's "fp32 master weights"), DDP with fp32 gradient
buffers; the whole batch is one micro-batch of its no-pipelining schedule (pp = 1) or `--microbatches`
of 1F1B (pp > 1). `compile` is not wired for megatron (the config validation refuses it), so specs
with compile run eager and say so.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict

import torch

from bench.common import H200_BF16_FLOPS, peak_memory_gb, reset_peak_memory, time_steps
from models import preset_config
from models.llama import DocumentAttention
from ppo.core_algos import policy_loss


def _build_runner(spec, args, *, device, dtype, mesh):
    from models.megatron_model import build_megatron_model
    from parallel.megatron_groups import build_process_groups
    from parallel.megatron_runner import MegatronOptimSettings, MegatronRunner

    cfg = preset_config(args.model)
    pgc = build_process_groups(mesh)
    gpt = build_megatron_model(cfg, pg_collection=pgc, pre_process=pgc.pp.rank() == 0,
                               post_process=pgc.pp.rank() == pgc.pp.size() - 1, params_dtype=dtype, device=device,
                               **({"recompute_granularity": "full", "recompute_method": "uniform",
                                   "recompute_num_layers": 1} if spec.ac == "full" else {}))
    attn = functools.partial(DocumentAttention, backend=spec.attn) if spec.mode == "ppo" else None
    # grad_clip=0: no clipping, as the native bench's AdamW step (megatron then skips the norm too)
    runner = MegatronRunner(gpt, pgc, attn_factory=attn, optim=MegatronOptimSettings(lr=1e-5, grad_clip=0.0),
                            n_microbatches=args.microbatches if pgc.pp.size() > 1 else 1)
    return cfg, runner, pgc


def run_megatron(spec, args, *, device, dtype, mesh, dims, make_batch, flops_per_token) -> dict:
    """One RunSpec with the megatron backend -> the same result keys as bench.train_step.run_one."""
    from parallel.vocab_parallel import vocab_parallel_token_logprobs

    if device.type != "cuda":
        raise RuntimeError("megatron backend: the training step needs CUDA (schedules, DDP, distributed optimizer)")
    if spec.ac == "selective":
        raise RuntimeError("megatron backend: selective activation checkpointing is not wired (use none or full)")
    cfg, runner, pgc = _build_runner(spec, args, device=device, dtype=dtype, mesh=mesh)
    batch = make_batch(spec, args, cfg=cfg, device=device, dp_rank=mesh.get_local_rank("dp"))
    pos = batch["pos"] if batch["pos"] is not None else torch.arange(args.seq, device=device).expand(
        args.batch, args.seq).contiguous()
    ids = batch["ids"] if runner.has_first else None
    denom = float(batch["mask"].sum())
    tp_group = pgc.tp if pgc.tp.size() > 1 else None

    def head_logprobs(hidden, targets, with_entropy):
        w, start = runner.head_shard()
        h = hidden.reshape(-1, hidden.shape[-1])
        lp, ent = vocab_parallel_token_logprobs(h, w, targets.reshape(-1), tp_group=tp_group, vocab_start=start,
                                                chunk_size=args.chunk, with_entropy=with_entropy)
        return lp.view(targets.shape), ent

    def loss_fn(hidden, mb):
        logp, _ = head_logprobs(hidden, mb["targets"], spec.mode == "ppo")
        if spec.mode == "lm":
            return -(logp * mb["mask"]).sum() / denom
        return policy_loss(logp, mb["old"], mb["adv"], mb["mask"], denom=denom)

    def logprobs():
        hidden = runner.forward(ids, position_ids=pos)
        return head_logprobs(hidden, batch["targets"], False)[0] if runner.has_last else None

    if spec.mode == "ppo":
        with torch.no_grad():
            old = logprobs()
        batch["old"] = old + 0.05 * torch.randn_like(old) if old is not None else torch.zeros_like(batch["adv"])
    extras = {k: batch[k] for k in ("targets", "mask", "old", "adv") if k in batch}
    metrics: dict = {}

    def step():
        runner.zero_grad()
        losses = runner.forward_backward(ids, position_ids=pos, loss_fn=loss_fn, extras=extras)
        runner.step()
        if losses:
            metrics["loss"] = torch.stack(losses).sum()

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
    res = dict(asdict(spec), backend="megatron", master="fp32", compile=False, tokens_per_s=tokens / step_s,
               step_s=step_s, step_s_min=min(times), peak_mem_gb=peak,
               mfu=tokens * fpt / step_s / (dims.world_size * H200_BF16_FLOPS),
               mfu_all_params=tokens * flops_per_token(cfg, context=batch["context"], all_params=True) / step_s
               / (dims.world_size * H200_BF16_FLOPS), flops_per_token=fpt, loss=float(loss))
    if spec.mode == "ppo":
        with torch.no_grad():
            fwd = time_steps(logprobs, device=device, warmup=1, steps=args.steps)
        res["logprob_tokens_per_s"] = tokens / sorted(fwd)[len(fwd) // 2]
    if not math.isfinite(res["loss"]):
        raise RuntimeError(f"megatron {spec}: non-finite loss {res['loss']}")
    return res
