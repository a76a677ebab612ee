"""`MegatronRunner`: a megatron-core model behind the project's runner interface (parallel/runner.py).

    pgc = build_process_groups(mesh)
    gpt = build_megatron_model(cfg, pg_collection=pgc, pre_process=..., post_process=..., device="cuda")
    runner = MegatronRunner(gpt, pgc, mesh=mesh, attn_factory=DocumentAttention)
    opt = runner.build_optimizer(lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)  # trainable roles
    logps = runner.forward(mbs, reduce=lambda h, k: ...)           # last stage: [R_k], else None
    metrics = runner.forward_backward(mbs, loss_fn=lambda h, k: (loss, {...}))
    grad_norm = runner.optimizer_step(opt, max_norm=1.0)           # distributed optimizer: clip + Adam

Micro-batches (packed rows [1, T_k], any count, any lengths) run through megatron-core's schedule for
the layout (`get_forward_backward_func(pp_size=, vp_size=)`: no pipelining at pp = 1, 1F1B otherwise)
with an explicit `P2PCommunicator` and our `ProcessGroupCollection`. `loss_fn(hidden [1, T, H], k)`
sees the last stage's final-normed hidden states and computes its own (vocab-parallel, chunked)
log-probs from `head()`; its loss is already normalised by the caller (global token count), so the
schedule's division by the number of micro-batches is undone here.

Training uses megatron-core's DDP (fp32 grad buffers, grads averaged over DP like FSDP's) and its
distributed optimizer (fp32 master shards, clipping over the whole role group), stepping with torch's
fused AdamW over one param group (the native backend's optimizer) and a one-sync grad norm. overlap_param_gather
stays off: with it, updated parameters are gathered lazily in the next forward and a hybrid-engine
reshard in between would read stale weights. megatron-core's schedules and optimizer need CUDA;
`forward` at pp = 1 also runs on CPU (the parity tests).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from models.megatron_model import head_weight, megatron_hidden
from parallel.megatron_groups import assert_no_global_state
from parallel.megatron_weights import gather_hf_state, megatron_hf_shards, megatron_reshard_shards
from parallel.runner import add_router_loss, attention_for, router_trace, split_loss


@dataclass(slots=True)
class MegatronOptimSettings:
    lr: float
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


def require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"megatron backend: {what} needs CUDA (megatron-core's schedules, DDP buffers and "
                           "distributed optimizer allocate on the GPU); use backend: native on CPU")


@contextlib.contextmanager
def role_scoped_all_gather_object(group: dist.ProcessGroup):
    """Make megatron-core's WORLD `all_gather_object` (param-group alignment while building the optimizer)
    run over the role's group instead: with split placement the other roles' ranks never join that call,
    so the WORLD version hangs. The list it fills is sized to the world; only the role's entries are set,
    the rest repeat this rank's keys (megatron only takes the union of the gathered keys)."""
    original = dist.all_gather_object

    def scoped(object_list, obj, group=None):
        parts = [None] * dist.get_world_size(scoped_group)
        original(parts, obj, group=scoped_group)
        for i in range(len(object_list)):
            object_list[i] = parts[i] if i < len(parts) else obj

    scoped_group = group
    dist.all_gather_object = scoped
    try:
        yield
    finally:
        dist.all_gather_object = original


def build_megatron_training(gpt: nn.Module, pgc, optim: MegatronOptimSettings):
    """(DDP-wrapped model, distributed optimizer) for a trainable role. Collective over the role group."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    require_cuda("training (DDP + distributed optimizer)")
    assert_no_global_state()
    cfg = gpt.config
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            overlap_param_gather=False, use_distributed_optimizer=True,
                                            average_in_collective=False)
    ddp = DistributedDataParallel(cfg, ddp_cfg, gpt, pg_collection=pgc)
    opt_cfg = OptimizerConfig(optimizer="adam", lr=optim.lr, min_lr=0.0, weight_decay=optim.weight_decay,
                              adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_eps=optim.eps,
                              clip_grad=optim.grad_clip, bf16=cfg.bf16, fp16=cfg.fp16, params_dtype=cfg.params_dtype,
                              use_distributed_optimizer=True)
    with role_scoped_all_gather_object(pgc.intra_dist_opt):
        # config_overrides={}: one param group, weight decay on every parameter like the native AdamW. (megatron's
        # default groups mark biases and 1-D params wd_mult=0, which only its own LR scheduler applies; ours
        # would silently decay them anyway, so the groups would only mislead.)
        opt = get_megatron_optimizer(opt_cfg, [ddp], config_overrides={}, use_gloo_process_groups=False,
                                     pg_collection=pgc)
    for dist_opt in megatron_optimizers(opt):
        use_fused_adamw(dist_opt.optimizer)
        dist_opt.get_grad_norm = functools.partial(grad_norm_one_sync, dist_opt)
    # the schedules reduce gradients (DP, tied embeddings, layer norms) through these hooks once per pass
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = ddp.no_sync
    return ddp, opt


def megatron_optimizers(opt) -> list:
    """The DistributedOptimizer(s) inside what get_megatron_optimizer returned: it always wraps them in a
    ChainedOptimizer (one for the dense params; a second one for expert params at ep > 1). Ranks whose
    stage has no trainable parameters hold a stub without a torch optimizer: skipped."""
    chained = getattr(opt, "chained_optimizers", [opt])
    return [o for o in chained if not getattr(o, "is_stub_optimizer", False) and o.optimizer is not None]


def grad_norm_one_sync(dist_opt) -> float:
    """L2 norm of the distributed optimizer's gradients over its grad-stats group, as megatron's
    get_grad_norm_fp32 computes it (the same gradients: no TP duplicates, no shared copies) but with one
    host sync: without Transformer Engine / apex megatron falls back to a per-tensor norm that converts each
    one to a Python float (a GPU sync per parameter tensor, ~150 for a 1B model, every step)."""
    grads = dist_opt.get_main_grads_for_grad_norm()
    if grads:
        sq = torch.stack(torch._foreach_norm(grads)).float().square().sum()
    else:
        sq = torch.zeros((), device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
    dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=dist_opt.get_grad_stats_parallel_group())
    return float(sq) ** 0.5


def use_fused_adamw(opt: torch.optim.Optimizer) -> None:
    """Switch megatron's torch AdamW (built without fused/foreach flags when neither Transformer Engine nor
    apex is installed: the multi-tensor foreach path, 2.3x slower than the fused kernel on an H200, 22.5 vs
    9.6 ms for 1.2B params) to torch's fused AdamW, the kernel the native backend uses. Done before any state
    exists: fused AdamW keeps `step` on the device, which is also what it loads a checkpoint's step into."""
    if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return  # TE / apex FusedAdam: already fused
    if len(opt.state):
        raise RuntimeError("use_fused_adamw must run before the optimizer's first step")
    if not all(p.device.type in ("cuda", "cpu") and p.is_floating_point()
               for g in opt.param_groups for p in g["params"]):
        return  # torch's fused kernel covers CUDA and CPU floating-point params (megatron's are CUDA fp32)
    for group in [opt.defaults, *opt.param_groups]:
        group["fused"], group["foreach"] = True, False


class MegatronRunner:
    """One megatron-core model chunk (this rank's pipeline stage) of a role, behind parallel.runner's
    `ModelRunner` interface (forward / forward_backward over packed micro-batches, heads, HF-named
    shards, export, the backend's optimizer)."""

    backend = "megatron"
    microbatches = None  # megatron-core's schedules take any count, each micro-batch its own length

    def __init__(self, gpt: nn.Module, pgc, *, mesh=None, attn_factory: Callable | None = None):
        assert_no_global_state()
        self.gpt, self.pgc, self.mesh = gpt, pgc, mesh
        self.attn_factory = attn_factory
        self.pp = pgc.pp.size()
        self.ddp = self.optimizer = None
        self._p2p = None

    # ---- layout
    @property
    def modules(self) -> list[nn.Module]:
        return [self.gpt]

    @property
    def model_config(self):
        """The Hugging Face-side ModelConfig (GPTModel.config is megatron's TransformerConfig)."""
        return self.gpt.hf_config

    @property
    def has_first(self) -> bool:
        return bool(self.gpt.pre_process)

    @property
    def has_last(self) -> bool:
        return bool(self.gpt.post_process)

    @property
    def is_exporter(self) -> bool:
        return self.pgc.pp.rank() == 0 and self.pgc.tp.rank() == 0 and self.pgc.dp.rank() == 0

    def head(self, name: str = "lm_head") -> tuple[torch.Tensor, int]:
        """(this rank's [V / tp, H] LM head rows, their first vocab id), or the [L, H] `score` head (TP-replicated)."""
        if not self.has_last:
            raise RuntimeError("only the last pipeline stage holds the heads")
        if name == "score":
            return self.gpt.score.weight, 0
        w = head_weight(self.gpt)
        return w, self.pgc.tp.rank() * w.shape[0]

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, this rank's TP shard): views of megatron's parameters where the fused layout allows
        (read-only use: export, inspection; checkpoints go through `checkpoint_state`)."""
        yield from megatron_hf_shards(self.gpt, self.pgc).items()

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.gpt.parameters() if p.requires_grad]

    def training_shards(self) -> dict[str, torch.Tensor]:
        """Training shards in the reshard planner's convention (see megatron_reshard_shards)."""
        return megatron_reshard_shards(self.gpt, self.pgc)

    def load_hf_weights(self, path, *, strict: bool = True) -> None:
        """This rank's slices of an HF checkpoint into the stage (then the optimizer's fp32 masters)."""
        from parallel.megatron_weights import load_megatron_weights

        load_megatron_weights(self.gpt, self.pgc, path, strict=strict)
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    def export_state_dict(self) -> dict[str, torch.Tensor] | None:
        """{HF name: full CPU tensor} on the exporter rank, None elsewhere (collective over the role group)."""
        mine = gather_hf_state(self.gpt, self.pgc)  # TP all-gather inside each stage
        if self.pgc.tp.rank() or self.pgc.dp.rank():
            return None
        if self.pp == 1:
            return mine
        parts = [None] * self.pp
        dst = dist.get_global_rank(self.pgc.pp, 0)
        dist.gather_object(mine, parts if dist.get_rank() == dst else None, dst=dst, group=self.pgc.pp)
        return {k: v for part in parts for k, v in part.items()} if self.is_exporter else None

    # ---- compute
    def _hidden(self, mb, *, hidden_in=None, trace=None) -> torch.Tensor:
        """One micro-batch through this stage: [T, 1, H] (sequence-first, megatron's p2p layout). trace: a mixture
        of experts' models.moe.RouterTrace (parallel.runner.router_trace: the engine's experts, replayed or
        compared)."""
        attn = attention_for(self.attn_factory, mb)
        return megatron_hidden(self.gpt, mb.input_ids if self.has_first else None, mb.position_ids, attn=attn,
                               hidden_in=hidden_in, routing=trace)

    @torch.no_grad()
    def forward(self, batches: Sequence, *, reduce: Callable) -> list | None:
        """No grad; `reduce(hidden [1, T_k, H], k)` on the last stage per micro-batch -> [R_k], None elsewhere."""
        if self.pp == 1:  # no schedule needed (and this path also runs on CPU)
            cfg = self.model_config
            return [reduce(self._hidden(mb, trace=router_trace(cfg, mb)).transpose(0, 1), k)
                    for k, mb in enumerate(batches)]
        results = self._run_schedule(batches, fn=reduce, forward_only=True)
        return results if self.has_last else None

    def forward_backward(self, batches: Sequence, *, loss_fn: Callable) -> list[dict]:
        """One gradient-accumulating pass over the micro-batches with megatron-core's schedule; DP and
        tied-embedding gradient reductions run once at its end (finalize_model_grads). Gradients land in
        DDP's fp32 buffers; the losses are used unscaled (loss_fn normalises). Metrics on the last stage."""
        if self.optimizer is None:
            raise RuntimeError("forward_backward needs the megatron optimizer: call build_optimizer first")
        metrics = self._run_schedule(batches, fn=loss_fn, forward_only=False)
        return metrics if self.has_last else []

    def _run_schedule(self, batches: Sequence, *, fn: Callable, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        require_cuda("megatron-core pipeline schedules")
        n = len(batches)
        out: list = [None] * n
        cfg = self.model_config

        def forward_step(data_iterator, model):
            k = next(data_iterator)
            trace = router_trace(cfg, batches[k])
            output = self._hidden(batches[k], trace=trace)

            def loss_func(output_tensor):
                hidden = output_tensor.transpose(0, 1)  # [1, T, H]
                if forward_only:
                    out[k] = fn(hidden, k)
                    return hidden.new_zeros(()), {}
                loss, metrics = split_loss(fn(hidden, k))
                if trace is not None:  # a mixture of experts: the load-balancing loss joins, as in LocalRunner
                    loss, metrics = add_router_loss(cfg, trace, loss, metrics, scale=1.0 / n)
                out[k] = metrics
                # the schedule divides each micro-batch loss by n; ours is already normalised by the caller
                return loss * n, metrics

            return output, loss_func

        if self._p2p is None and self.pp > 1:
            self._p2p = P2PCommunicator(pp_group=self.pgc.pp, config=self.gpt.config)
        longest = max(mb.position_ids.shape[1] for mb in batches)
        fb = get_forward_backward_func(pp_size=self.pp, vp_size=None)
        fb(forward_step_func=forward_step, data_iterator=iter(range(n)), model=[self.ddp or self.gpt],
           num_microbatches=n, seq_length=longest, micro_batch_size=1, forward_only=forward_only,
           p2p_communicator=self._p2p, pg_collection=self.pgc)
        return out

    # ---- optimizer (the backend's: DDP + distributed optimizer)
    def build_optimizer(self, *, lr: float, betas: tuple[float, float], weight_decay: float,
                        grad_clip: float = 1.0, stream_from_host: bool = False):
        """Wrap the stage in megatron-core DDP and build its distributed optimizer (collective over the role
        group). Returns the torch optimizer megatron drives (its param_groups carry the LR a scheduler
        sets; its state is the fp32 master shards' Adam moments). stream_from_host (host-resident moments) is
        not wired here: refused, never ignored (launcher.config.validation refuses it before launch too)."""
        if stream_from_host:
            raise ValueError("megatron backend: an optimizer streamed from host memory (<role>.offload_optimizer) "
                             "is not supported (native backend only)")
        settings = MegatronOptimSettings(lr=lr, grad_clip=grad_clip, weight_decay=weight_decay, betas=tuple(betas))
        self.ddp, self.optimizer = build_megatron_training(self.gpt, self.pgc, settings)
        self.ddp.zero_grad_buffer()
        return self.optimizer.optimizer

    def optimizer_step(self, optimizer, *, max_norm: float) -> float:
        """Clip to max_norm (global norm over the role group, inside megatron's step), Adam on the fp32
        master shards, gather the updated parameters (not lazily: a reshard next reads them), zero the
        gradient buffers. Returns the pre-clip grad norm; NaN without stepping when a gradient anywhere in the
        role group is not finite (megatron checks only under a loss scaler: agreed here over the role's groups)."""
        if not self._grads_finite():
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            return float("nan")
        self.optimizer.config.clip_grad = max_norm
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:  # a loss scaler's inf check (not used: bf16/fp32), the same skip
            grad_norm = float("nan")
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        return float(grad_norm) if grad_norm is not None else 0.0

    def _grads_finite(self) -> bool:
        """Every rank's DDP gradient buffers finite, agreed over the role's tp x pp x dp ranks (one pass over the
        buffers; a MIN over each group in turn is the MIN over their product; a stage without parameters has
        no buffers and agrees with the others)."""
        buffers = self._grad_buffers()
        device = buffers[0].grad_data.device if buffers else next(self.gpt.parameters()).device
        ok = torch.ones((), device=device)
        for b in buffers:
            ok = ok * torch.isfinite(b.grad_data).all()
        for group in (self.pgc.tp, self.pgc.pp, self.pgc.dp):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        return bool(ok > 0)

    def adapter_state_dict(self) -> dict | None:
        """The runner contract's LoRA adapters: none (empty on the exporter rank, None elsewhere)."""
        return {} if self.is_exporter else None

    @property
    def lora_modules(self) -> dict:
        """No LoRA adapters: the launcher refuses actor.lora with the megatron backend (the runner contract's
        query, e.g. the supervised warm-up's "merge the adapters into the base" step)."""
        return {}

    # ---- around generation (hybrid engine)
    def release_gradients(self) -> None:
        """Free DDP's fp32 gradient buffers (storage resized to 0, 4 bytes per parameter) while generating;
        they are zero between optimizer steps, so nothing is copied."""
        if self.ddp is not None:
            for buf in self._grad_buffers():
                buf.offload_to_cpu(move_params=False, move_grads=True)

    def restore_gradients(self) -> None:
        if self.ddp is not None:
            for buf in self._grad_buffers():
                buf.reload_from_cpu(move_params=False, move_grads=True)  # re-allocated and zeroed

    def _grad_buffers(self) -> list:
        """DDP's gradient buffers: the dense parameters', then a mixture of experts' (expert-data-parallel) ones."""
        return [*self.ddp.buffers, *getattr(self.ddp, "expert_parallel_buffers", [])]

    # ---- checkpoints (per rank; ppo/run/checkpoint.py writes them atomically)
    def checkpoint_state(self, optimizer=None) -> dict:
        """This rank's model shard (megatron names), its `layout` (coordinates, head), and per distributed optimizer
        (megatron chains one per param kind) its fp32 master shards with their flat `range` in the parameter and
        their Adam state (step, moments) keyed by parameter name, all cloned to CPU (the layout and ranges let
        parallel/megatron_checkpoint.py convert the checkpoint for the native backend). Param-group
        hyperparameters are not saved: they come from the config, and the LR from the scheduler's own state.
        (`optimizer`: what build_optimizer returned; this runner holds its wrapper.)"""
        from parallel.megatron_checkpoint import rank_layout

        # layout (and each master shard's flat range): what converting the checkpoint for the native backend needs
        # (parallel/megatron_checkpoint.py)
        state = {"params": {n: p.detach().cpu().clone() for n, p in self.gpt.named_parameters()},
                 "layout": rank_layout(self.pgc, self.gpt.head_kind)}
        opts = megatron_optimizers(self.optimizer) if self.optimizer is not None else []
        # before its first step the optimizer has no Adam state: the masters then equal the parameters, which is
        # what a fresh optimizer starts from
        if opts and all(len(o.optimizer.state) > 0 for o in opts):
            names = {p: n for n, p in self.gpt.named_parameters()}
            state["dist_optim"] = [_clone_cpu(_master_shards(o, names)) for o in opts]
        return state

    @torch.no_grad()
    def load_checkpoint_state(self, optimizer, state: dict) -> None:
        """Inverse of checkpoint_state on the same layout: parameters, then master shards and Adam state."""
        params = dict(self.gpt.named_parameters())
        if set(state["params"]) != set(params):
            raise KeyError("checkpoint was written for another layout or model: megatron parameter names differ "
                           f"({sorted(set(state['params']) ^ set(params))[:4]}); resume with the same plan")
        for n, p in params.items():
            p.copy_(state["params"][n])
        if self.optimizer is None:
            return
        self.optimizer.reload_model_params()  # masters from the parameters (overwritten below when saved)
        if "dist_optim" not in state:
            return
        opts = megatron_optimizers(self.optimizer)
        if len(opts) != len(state["dist_optim"]):
            raise KeyError(f"checkpoint holds {len(state['dist_optim'])} megatron optimizers, this run builds "
                           f"{len(opts)}")
        names = {p: n for n, p in self.gpt.named_parameters()}
        for opt, shards in zip(opts, state["dist_optim"]):
            _load_master_shards(opt, shards, names=names)


def _bucket_params(opt):
    """The model parameters whose fp32 master shard (and Adam moments) this DP rank holds, in bucket order."""
    for gbuf_range_maps in opt.gbuf_ranges:
        for buckets in gbuf_range_maps.values():
            for bucket in buckets:
                yield from bucket["param_map"]


def _main_params(opt) -> dict:
    """{model param: the fp32 master shard the torch optimizer steps for it}, from the distributed optimizer's own
    parallel group lists (16-bit params with their fp32 copies, fp32 params with their shard views). Not through
    `model_param_group_index_map`: its positions count the params in bucket order, while each torch param group
    lists the fp32 params' shards first, then the 16-bit params' masters, so with both kinds in a model (our
    bf16 stages keep their norms in fp32) a position names another parameter's master."""
    out = {}
    for models, mains in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                          (opt.model_fp32_groups, opt.shard_fp32_groups)):
        for model_group, main_group in zip(models, mains):
            out.update(zip(model_group, main_group))
    return out


def _legacy_main_param(opt, model_param) -> torch.Tensor:
    """The master a checkpoint written before shards recorded their `range` filed under this param's name (by
    `model_param_group_index_map`, see _main_params): such checkpoints load back through the same lookup, which
    is self-consistent at the layout that wrote them."""
    group_index, group_order = opt.model_param_group_index_map[model_param]
    return opt.optimizer.param_groups[group_index]["params"][group_order]


def _shard_ranges(opt) -> dict:
    """{model param: [start, end)} of the flattened (TP-local) parameter that this DP rank's master shard covers
    (megatron's bucket `param_map[p]["param"]` Range)."""
    return {p: [int(entry["param"].start), int(entry["param"].end)]
            for gbuf_range_maps in opt.gbuf_ranges for buckets in gbuf_range_maps.values() for bucket in buckets
            for p, entry in bucket["param_map"].items()}


def _master_shards(opt, names: dict) -> dict[str, dict[str, torch.Tensor]]:
    """{megatron param name: {param (fp32 master shard), range ([start, end) of the flat parameter it covers), step,
    exp_avg, exp_avg_sq}} of one distributed optimizer.
    Keyed by name, never by position: megatron's own pair (state_dict / load_state_dict plus the dp_reshardable
    getter / loader) matches entries by their order in the param groups and buckets, which differs between two
    builds of the same model (seen on the H200: a [1048576] master given a [256] parameter's Adam state)."""
    out, mains = {}, _main_params(opt)
    for p, flat_range in _shard_ranges(opt).items():
        main = mains[p]
        out[names[p]] = {"param": main, "range": flat_range, **opt.optimizer.state[main]}
    return out


def _load_master_shards(opt, shards: dict, *, names: dict) -> None:
    """Each master shard and its Adam state set by name; the state is rebuilt per parameter (own step tensor,
    placed as torch places a loaded step: on the parameter's device for fused/capturable groups, else CPU)."""
    mine, mains = {names[p]: p for p in _bucket_params(opt)}, _main_params(opt)
    if set(mine) != set(shards):
        raise KeyError("checkpoint's optimizer shards were written for another layout: parameters differ "
                       f"({sorted(set(mine) ^ set(shards))[:4]}); resume with the same plan")
    step_on_device = {id(q): bool(g.get("fused") or g.get("capturable"))
                      for g in opt.optimizer.param_groups for q in g["params"]}
    for name, p in mine.items():
        saved = shards[name]
        main = mains[p] if "range" in saved else _legacy_main_param(opt, p)
        if saved["param"].shape != main.shape:
            raise KeyError(f"checkpoint's master shard of {name} has shape {tuple(saved['param'].shape)}, this run "
                           f"holds {tuple(main.shape)}; resume with the same plan")
        with torch.no_grad():
            main.copy_(saved["param"])
        st = {}
        for k, v in saved.items():
            if k in ("param", "range"):  # range: where the shard sits (for the native conversion), not Adam state
                continue
            if k == "step":
                st[k] = v.to(dtype=torch.float32, device=main.device if step_on_device[id(main)] else "cpu").clone()
            else:
                st[k] = v.to(device=main.device, dtype=main.dtype).clone()
        opt.optimizer.state[main] = st


def _clone_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _clone_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_cpu(v) for v in obj)
    return obj
