"""Training-step throughput of the parallelized model: LM loss or the PPO update's shape, MFU on H200.

    python -m bench.train_step --model llama-1b --seq 2048 --batch 4 --compile --device cuda
    python -m bench.train_step --model llama-1b --seq 2048 --batch 4 --sweep          # 4 configs, one process
    python -m bench.train_step --model llama-1b --sweep lm:compile:none:bf16,ppo:compile:selective:fp32
    torchrun --nproc_per_node 2 -m bench.train_step --model llama-1b --tp 2 --compile  # or --dp 2
    torchrun --nproc_per_node 2 -m bench.train_step --model llama-1b --pp 2 --batch 8 --microbatches 4
    python -m bench.train_step --model tiny --device cpu --steps 2 --sweep             # CPU check
    python -m bench.train_step --model llama-1b --seq 2048 --batch 4 --master fp32 --backend both  # native vs megatron

One step = forward + backward + AdamW step on `--batch` rows of `--seq` tokens per
data-parallel rank. The loss never forms [N, V] fp32 logits: final hidden states go
through the chunked (vocab-parallel under TP) log-prob kernel of parallel/vocab_parallel.py.

- lm: next-token NLL over every position, plain causal SDPA (flash, is_causal, no mask).
- ppo: rows packed with several prompt+response sequences of uneven length (positions
  restart per sequence; models.document_attention.DocumentAttention: varlen flash attention on CUDA,
  masked SDPA elsewhere), loss = clipped-ratio policy loss (ppo.algos.core_algos.policy_loss)
  on response tokens, entropy as a metric. Also times the forward-only log-prob
  recompute (`logprob_tokens_per_s`), the PPO step's other trainer stage.

Weights (`--master`): bf16 = bf16 parameters, grads and AdamW moments (fused AdamW);
fp32 = the trainer's mixed precision: fp32 master weights and moments. With dp > 1 FSDP2 holds
the fp32 shards and all-gathers bf16 compute copies; with dp = 1 the model is bf16 with fp32 main
grads and the optimizer keeps the fp32 masters (parallel/master_weights.py); `--fsdp` forces FSDP2's
layout at dp = 1 too (how the trainer runs with an offloaded optimizer).

MFU = FLOPs / (step time x GPUs x the spec peak, 989 TFLOP/s bf16 dense on an H200; `mfu_measured_ceiling`
divides by the measured 790 TFLOP/s instead), FLOPs per token = 6 N + 12 L W C (ppo.metrics.flops),
N = parameters without the input embedding (the lookup does no matmul; the head counts;
`mfu_all_params` counts every parameter, the other common convention),
C = causal attention context per token, (len + 1) / 2 averaged over the packed sequences
(a token attends only to the earlier tokens of its own sequence). Last stdout line: one
JSON object with every config's result.

`--backend megatron` (or `both`: each config on the native backend, then on megatron-core, in one process)
runs the step with megatron-core's GPTModel, DDP, distributed optimizer (bf16 params, fp32 master shards)
and schedules: bench/megatron_step.py. Each result carries its `backend`.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
from dataclasses import asdict, dataclass

import torch

from bench.common import (
    H200_BF16_FLOPS,
    H200_MATMUL_CEILING_FLOPS,
    add_device_args,
    emit_json,
    init_distributed,
    kernel_profile,
    peak_memory_gb,
    reset_peak_memory,
    resolve_device,
    run_info,
    synchronize,
    time_steps,
)
from models import build_model, preset_config
from models.config import ModelConfig
from models.document_attention import DocumentAttention
from parallel.apply import head_shard, parallelize_model
from parallel.dims import ParallelDims, build_mesh
from parallel.runner import forward_hidden
from parallel.vocab_parallel import vocab_parallel_token_logprobs
from ppo.algos.core_algos import policy_loss
from ppo.metrics.flops import attention_context
from ppo.metrics.flops import flops_per_token as model_flops_per_token

DEFAULT_SWEEP = ("lm:eager:none:bf16,lm:compile:none:bf16,lm:compile:none:fp32,"
                 "ppo:compile:none:bf16:auto,ppo:compile:none:bf16:mask")


@dataclass(slots=True)
class RunSpec:
    mode: str = "lm"  # lm | ppo
    compile: bool = False
    ac: str = "none"  # none | full | selective
    master: str = "bf16"  # bf16 | fp32
    attn: str = "auto"  # ppo only, DocumentAttention backend: auto | varlen | dense | mask

    @classmethod
    def parse(cls, text: str) -> RunSpec:
        """'ppo:compile:selective:fp32:varlen' (mode:eager|compile:ac:master:attn; trailing fields optional)."""
        parts = text.strip().split(":")
        allowed = (("lm", "ppo"), ("eager", "compile"), ("none", "full", "selective"), ("bf16", "fp32"),
                   ("auto", "varlen", "dense", "mask"))
        if len(parts) > len(allowed) or any(v not in ok for v, ok in zip(parts, allowed)):
            raise SystemExit(f"bad sweep entry {text!r}; expected " + ":".join("|".join(a) for a in allowed))
        spec = cls(mode=parts[0])
        if len(parts) > 1:
            spec.compile = parts[1] == "compile"
        if len(parts) > 2:
            spec.ac = parts[2]
        if len(parts) > 3:
            spec.master = parts[3]
        if len(parts) > 4:
            spec.attn = parts[4]
        return spec


def flops_per_token(cfg: ModelConfig, *, context: float, all_params: bool = False) -> float:
    """A trained token's FLOPs by the project's one formula (ppo.metrics.flops.flops_per_token: 6 N +
    12 L W C, C causal). N: the matmul parameters (decoder layers + the head, whose matmul runs even when
    tied; not the embedding lookup), or every parameter with all_params. W is the width of q.k and p.v,
    heads x head_dim: the hidden size in PaLM, twice it in Qwen3-0.6B."""
    n = cfg.num_params(include_embedding=True) if all_params else cfg.matmul_params()
    return model_flops_per_token(n, layers=cfg.num_hidden_layers, attn_width=cfg.num_attention_heads * cfg.head_dim,
                                 context=context, train=True)


def pack_rows(batch: int, seq: int, *, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Rows of `seq` tokens holding sequences of seq/8 .. seq/2 tokens (the last one cut to fit).

    Returns position_ids [B, T], response mask [B, T] (the second part of each sequence,
    minus its last token, which has no next token), and all sequence lengths.
    """
    pos = torch.empty(batch, seq, dtype=torch.long)
    resp = torch.zeros(batch, seq, dtype=torch.bool)
    lengths = []
    lo, hi = max(2, seq // 8), max(3, seq // 2)
    for r in range(batch):
        t = 0
        while t < seq:
            n = min(int(torch.randint(lo, hi + 1, (1,), generator=gen)), seq - t)
            pos[r, t:t + n] = torch.arange(n)
            prompt = max(1, n // 4)
            resp[r, t + prompt:t + n - 1] = True
            lengths.append(n)
            t += n
    return pos, resp, lengths


def _init_on_device(model: torch.nn.Module, *, seed: int) -> None:
    """normal(0, 0.02) matrices, ones for norms, generated where the weights live (fast for 1B+)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() >= 2 else p.fill_(1.0)


def _build(spec: RunSpec, args, *, device, dtype, mesh, dims):
    """(config, model or PipelineRunner when pp > 1, AdamW over this rank's parameters)."""
    cfg = preset_config(args.model)
    mixed = spec.master == "fp32" and dtype != torch.float32
    storage = torch.float32 if spec.master == "fp32" else dtype
    model = build_model(cfg, dtype=storage, device=device, init=False)
    _init_on_device(model, seed=0)
    attn_factory = functools.partial(DocumentAttention, backend=spec.attn) if spec.mode == "ppo" else None
    model = parallelize_model(model, mesh=mesh, dims=dims, ac=spec.ac, compile=spec.compile,
                              param_dtype=dtype if mixed else None, fsdp=True if args.fsdp else None,
                              n_microbatches=args.microbatches, pp_schedule=args.pp_schedule,
                              stages_per_rank=args.stages_per_rank, attn_factory=attn_factory)
    opt = model.build_optimizer(lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0)  # the trainer's AdamW
    if dims.pp == 1:
        model = model.module  # the tensor-level pp = 1 path below calls the module itself
    return cfg, model, opt


def _make_batch(spec: RunSpec, args, *, cfg, device, dp_rank):
    gen = torch.Generator().manual_seed(1234 + dp_rank)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)
    targets = torch.roll(ids, -1, dims=1)
    if spec.mode == "lm":
        mask = torch.ones(args.batch, args.seq, dtype=torch.bool)
        mask[:, -1] = False
        return dict(ids=ids.to(device), pos=None, targets=targets.to(device), mask=mask.to(device),
                    context=attention_context([args.seq] * args.batch))
    pos, resp, lengths = pack_rows(args.batch, args.seq, gen=gen)
    context = attention_context(lengths)
    adv = torch.randn(args.batch, args.seq, generator=gen)
    return dict(ids=ids.to(device), pos=pos.to(device), targets=targets.to(device), mask=resp.to(device),
                adv=adv.to(device), context=context, n_seqs=len(lengths))


def _attn(spec: RunSpec, batch, *, cfg, device, dtype):
    """(models.document_attention.DocumentAttention backend, max |varlen - masked SDPA| on random q/k/v or None)."""
    if spec.mode == "lm":
        return None, None
    backend = DocumentAttention(batch["pos"], backend=spec.attn)
    if device.type != "cuda" or spec.attn == "mask":
        return backend, None
    # check the fast path against the reference masked SDPA on this batch's packing before timing it
    b, t = batch["pos"].shape
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, cfg.num_attention_heads, t, cfg.head_dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(b, cfg.num_key_value_heads, t, cfg.head_dim, device=device, dtype=dtype, generator=g)
    v = torch.randn_like(k)
    with torch.no_grad():
        ref = DocumentAttention(batch["pos"], backend="mask")(0, q, k, v).float()
        diff = (backend(0, q, k, v).float() - ref).abs().max().item()
    if diff > 0.05:
        raise RuntimeError(f"document attention ({spec.attn}) differs from masked SDPA by {diff:.3g}")
    return backend, diff


def _pipeline_step_fns(spec: RunSpec, args, runner, batch, *, tp_group, metrics):
    """(train step, forward-only log-prob pass) for a PipelineRunner: the last stage owns the loss."""
    pos = batch["pos"] if batch["pos"] is not None else torch.arange(args.seq, device=batch["ids"].device).expand(
        args.batch, args.seq).contiguous()
    ids = batch["ids"] if runner.has_first else None
    denom = float(batch["mask"].sum())  # whole-batch token count: micro-batch losses add up to the batch loss

    def head_logprobs(hidden, targets, with_entropy):
        w, start = head_shard(runner.last_module)
        return vocab_parallel_token_logprobs(hidden, w, targets, tp_group=tp_group, vocab_start=start,
                                             chunk_size=args.chunk, with_entropy=with_entropy)

    def loss_fn(hidden, mb):
        logp, _ = head_logprobs(hidden, mb["targets"], spec.mode == "ppo")
        if spec.mode == "lm":
            return -(logp * mb["mask"]).sum() / denom
        return policy_loss(logp, mb["old"], mb["adv"], mb["mask"], denom=denom)

    def logprobs():
        hidden = runner.forward_rows(ids, position_ids=pos)
        return head_logprobs(hidden, batch["targets"], False)[0] if runner.has_last else None

    if spec.mode == "ppo":
        with torch.no_grad():
            old = logprobs()
        batch["old"] = old + 0.05 * torch.randn_like(old) if old is not None else torch.zeros_like(batch["adv"])
    extras = {k: batch[k] for k in ("targets", "mask", "old", "adv") if k in batch}

    def step():
        losses = runner.forward_backward_rows(ids, position_ids=pos, extras=extras, loss_fn=loss_fn)
        if losses:
            metrics["loss"] = torch.stack([x.detach() for x in losses]).sum()
            clip = [m["clipfrac"] for m in runner.last_metrics if "clipfrac" in m]
            metrics["clipfrac"] = sum(clip) / len(clip) if clip else None

    return step, logprobs


def run_one(spec: RunSpec, args, *, device, dtype, mesh, dims, tp_group) -> dict:
    cfg, model, opt = _build(spec, args, device=device, dtype=dtype, mesh=mesh, dims=dims)
    batch = _make_batch(spec, args, cfg=cfg, device=device, dp_rank=mesh.get_local_rank("dp"))
    if dims.pp > 1:
        return _run_pipeline(spec, args, cfg=cfg, runner=model, opt=opt, batch=batch, device=device, dims=dims,
                             tp_group=tp_group)
    attn, attn_diff = _attn(spec, batch, cfg=cfg, device=device, dtype=dtype)

    def token_logprobs(with_entropy: bool):
        hidden = forward_hidden(model, batch["ids"], batch["pos"], attn=attn)
        w, start = head_shard(model)
        return vocab_parallel_token_logprobs(hidden, w, batch["targets"], tp_group=tp_group, vocab_start=start,
                                             chunk_size=args.chunk, with_entropy=with_entropy)

    if spec.mode == "ppo":
        with torch.no_grad():
            # behaviour log-probs near the current policy, so ratios and clip fractions look like a real update
            old, _ = token_logprobs(False)
            batch["old"] = old + 0.05 * torch.randn_like(old)
    metrics: dict = {}

    def step():
        if spec.mode == "lm":
            logp, _ = token_logprobs(False)
            m = batch["mask"]
            loss = -(logp * m).sum() / m.sum()
        else:
            logp, ent = token_logprobs(True)
            # as the trainer's update (ppo/roles/build.py): no host sync before backward, metrics read after the step
            loss, pm = policy_loss(logp, batch["old"], batch["adv"], batch["mask"], sync_metrics=False)
            metrics.update(pm)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        metrics["loss"] = loss.detach()

    reset_peak_memory(device)
    times = time_steps(step, device=device, warmup=args.warmup, steps=args.steps)
    peak = peak_memory_gb(device)
    step_s = sorted(times)[len(times) // 2]  # median: robust to a stray slow step
    world = dims.world_size
    tokens = args.batch * args.seq * dims.dp
    fpt = flops_per_token(cfg, context=batch["context"])
    res = dict(asdict(spec), tokens_per_s=tokens / step_s, step_s=step_s, step_s_min=min(times),
               peak_mem_gb=peak, mfu=tokens * fpt / step_s / (world * H200_BF16_FLOPS),
               mfu_measured_ceiling=tokens * fpt / step_s / (world * H200_MATMUL_CEILING_FLOPS),
               mfu_all_params=tokens * flops_per_token(cfg, context=batch["context"], all_params=True) / step_s
               / (world * H200_BF16_FLOPS),
               flops_per_token=fpt, loss=float(metrics["loss"]))
    if args.profile:
        res["profile"] = kernel_profile(step, device=device, top=args.profile_top)
    if spec.mode == "ppo":
        res["clipfrac"] = float(metrics["clipfrac"])
        res["attn_check_maxdiff"] = attn_diff
        res["seqs_per_row"] = batch["n_seqs"] / args.batch
        with torch.no_grad():
            fwd = time_steps(lambda: token_logprobs(False), device=device, warmup=1, steps=args.steps)
        res["logprob_tokens_per_s"] = tokens / sorted(fwd)[len(fwd) // 2]
    if not math.isfinite(res["loss"]):
        raise RuntimeError(f"{spec}: non-finite loss {res['loss']}")
    return res


def _run_pipeline(spec: RunSpec, args, *, cfg, runner, opt, batch, device, dims, tp_group) -> dict:
    metrics: dict = {}
    train, logprobs = _pipeline_step_fns(spec, args, runner, batch, tp_group=tp_group, metrics=metrics)

    def step():
        train()
        opt.step()
        opt.zero_grad(set_to_none=True)

    reset_peak_memory(device)
    times = time_steps(step, device=device, warmup=args.warmup, steps=args.steps)
    step_s = sorted(times)[len(times) // 2]
    tokens = args.batch * args.seq * dims.dp
    fpt = flops_per_token(cfg, context=batch["context"])
    # the loss lives on the last stage's ranks: sum over the pipeline group brings it to every rank
    import torch.distributed as dist

    stats = torch.tensor([float(metrics.get("loss", 0.0)), float(metrics.get("clipfrac") or 0.0)], device=device)
    dist.all_reduce(stats, group=runner.pp_group)
    loss, metrics["clipfrac"] = stats.tolist()
    res = dict(asdict(spec), tokens_per_s=tokens / step_s, step_s=step_s, step_s_min=min(times),
               peak_mem_gb=peak_memory_gb(device), mfu=tokens * fpt / step_s / (dims.world_size * H200_BF16_FLOPS),
               mfu_measured_ceiling=tokens * fpt / step_s / (dims.world_size * H200_MATMUL_CEILING_FLOPS),
               mfu_all_params=tokens * flops_per_token(cfg, context=batch["context"], all_params=True) / step_s
               / (dims.world_size * H200_BF16_FLOPS),
               flops_per_token=fpt, pp=dims.pp, microbatches=args.microbatches, pp_schedule=runner.schedule,
               loss=loss)
    if spec.mode == "ppo":
        res["clipfrac"] = metrics.get("clipfrac")
        with torch.no_grad():
            fwd = time_steps(logprobs, device=device, warmup=1, steps=args.steps)
        res["logprob_tokens_per_s"] = tokens / sorted(fwd)[len(fwd) // 2]
    if not math.isfinite(res["loss"]):
        raise RuntimeError(f"{spec}: non-finite loss {res['loss']}")
    return res


def _backend_summary(results: list[dict]) -> dict:
    """Best MFU per backend and megatron's fraction of native's (the issue's >= 90% goal), when both ran."""
    best = {}
    for r in results:
        if "mfu" in r and r["mfu"] > best.get(r["backend"], {}).get("mfu", -1.0):
            best[r["backend"]] = r
    out = {f"best_mfu_{b}": r["mfu"] for b, r in best.items()}
    if "native" in best and "megatron" in best:
        out["megatron_over_native_mfu"] = best["megatron"]["mfu"] / best["native"]["mfu"]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = add_device_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="rows per data-parallel rank per step")
    p.add_argument("--mode", choices=("lm", "ppo"), default="lm")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    p.add_argument("--ac", choices=("none", "full", "selective"), default="none")
    p.add_argument("--master", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 even at dp = 1 (fp32 masters as its sharded parameters)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=None, help="default: world size / (tp x pp)")
    p.add_argument("--microbatches", type=int, default=None, help="pipeline micro-batches (default: --batch)")
    p.add_argument("--pp-schedule", choices=("1f1b", "interleaved_1f1b", "gpipe"), default="1f1b")
    p.add_argument("--stages-per-rank", type=int, default=1, help=">1: interleaved 1F1B over looped stages")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--chunk", type=int, default=None, help="log-prob token chunk (default 4096 cuda, 256 cpu)")
    p.add_argument("--attn", choices=("auto", "varlen", "mask"), default="auto",
                   help="ppo attention: varlen flash (cuda) or masked SDPA")
    p.add_argument("--profile", action="store_true",
                   help="after timing, one step under torch.profiler: top kernels and GEMM share per config")
    p.add_argument("--profile-top", type=int, default=15, help="kernels listed per profiled config")
    p.add_argument("--backend", choices=("native", "megatron", "both"), default="native",
                   help="training backend; both: every config on native then on megatron-core (bench/megatron_step.py)")
    p.add_argument("--sweep", nargs="?", const=DEFAULT_SWEEP, default=None,
                   help=f"comma list of mode:eager|compile:ac:master (default list: {DEFAULT_SWEEP})")
    args = p.parse_args(argv)
    device, dtype = resolve_device(args)
    if args.chunk is None:
        args.chunk = 4096 if device.type == "cuda" else 256
    torch.set_float32_matmul_precision("high")
    rank, world = init_distributed(device)
    dp = args.dp or world // (args.tp * args.pp)
    dims = ParallelDims(tp=args.tp, pp=args.pp, dp=dp)
    if dims.world_size != world:
        raise SystemExit(f"tp({args.tp}) x pp({args.pp}) x dp({dp}) = {dims.world_size} != world size {world}; "
                         "fix --tp/--pp/--dp")
    if args.microbatches is None:
        args.microbatches = args.batch
    mesh = build_mesh(dims, list(range(world)), device_type=device.type)
    tp_group = mesh["tp"].get_group() if args.tp > 1 else None
    specs = ([RunSpec.parse(s) for s in args.sweep.split(",")] if args.sweep
             else [RunSpec(args.mode, args.compile, args.ac, args.master, args.attn)])
    results = []
    backends = ("native", "megatron") if args.backend == "both" else (args.backend,)
    measured_megatron = set()
    for spec, backend in ((s, b) for s in specs for b in backends):
        if backend == "megatron":  # megatron always keeps fp32 masters: bf16/fp32 master variants are one config
            key = (spec.mode, spec.compile, spec.ac, spec.attn)
            if key in measured_megatron:
                continue
            measured_megatron.add(key)
        try:
            if backend == "megatron":
                from bench.megatron_step import run_megatron

                results.append(run_megatron(spec, args, device=device, dtype=dtype, mesh=mesh, dims=dims,
                                            make_batch=_make_batch, flops_per_token=flops_per_token))
            else:
                results.append(dict(run_one(spec, args, device=device, dtype=dtype, mesh=mesh, dims=dims,
                                            tp_group=tp_group), backend="native"))
        except Exception as e:  # noqa: BLE001 - one failing config must not cost the other measurements
            if world > 1:
                raise  # the other ranks may be stuck in a collective: fail loudly instead of hanging
            msg = (str(e).strip().splitlines() or [""])[0][:300]
            results.append(dict(asdict(spec), backend=backend, error=f"{type(e).__name__}: {msg}"))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()
        if rank == 0:
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in results[-1].items()}, flush=True)
    synchronize(device)
    ok = [r for r in results if "mfu" in r]
    best = max(ok, key=lambda r: r["mfu"]) if ok else {}
    summary = dict(bench="train_step", model=args.model, seq=args.seq, batch=args.batch, tp=args.tp, pp=args.pp, dp=dp,
                   world=world, dtype=str(dtype).removeprefix("torch."), fsdp_forced=args.fsdp,
                   ceiling_flops_per_gpu=H200_BF16_FLOPS,
                   best_mfu=best.get("mfu"), best_tokens_per_s=best.get("tokens_per_s"),
                   best_config={k: best[k] for k in ("mode", "compile", "ac", "master", "backend")} if best else None,
                   **_backend_summary(results),
                   results=results, **run_info(device))
    if rank == 0:
        emit_json(summary)
    import torch.distributed as dist

    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
    main()
