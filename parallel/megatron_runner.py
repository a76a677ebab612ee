"""`MegatronRunner`: a megatron-core model driven through the project's runner interface.

    pgc = build_process_groups(mesh)
    gpt = build_megatron_model(cfg, pg_collection=pgc, pre_process=..., post_process=..., device="cuda")
    runner = MegatronRunner(gpt, pgc, attn_factory=DocumentAttention,
                            optim=MegatronOptimSettings(lr=1e-6, grad_clip=1.0))   # optim: trainable roles
    hidden = runner.forward(ids, position_ids=pos)                 # [B, T, H] on the last stage, else None
    losses = runner.forward_backward(ids, position_ids=pos, loss_fn=fn, extras={"adv": adv})
    grad_norm = runner.step()                                      # distributed optimizer: clip + Adam

Rows of the [B, T] batch are split into micro-batches (one per row unless `n_microbatches` says
otherwise) and run by megatron-core's schedule for the layout (`get_forward_backward_func(pp_size=,
vp_size=)`: no pipelining at pp = 1, 1F1B otherwise) with an explicit `P2PCommunicator` and our
`ProcessGroupCollection`. `loss_fn(hidden_mb [b, T, H], extras_mb) -> loss | (loss, metrics)` sees the
last stage's final-normed hidden states and computes its own (vocab-parallel, chunked) log-probs from
`head_shard()`; its loss is already normalised by the caller (global token count), so the schedule's
division by the number of micro-batches is undone here.

Training uses megatron-core's DDP (fp32 grad buffers, grads averaged over DP like FSDP's) and its
distributed optimizer (fp32 master shards, clipping over the whole role group). overlap_param_gather
stays off: with it, updated parameters are gathered lazily in the next forward and a hybrid-engine
reshard in between would read stale weights. megatron-core's schedules and optimizer need CUDA;
`forward` at pp = 1 also runs on CPU (the parity tests).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from models.megatron_model import head_weight, megatron_hidden
from parallel.megatron_groups import assert_no_global_state
from parallel.megatron_weights import megatron_hf_shards, megatron_reshard_shards


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
        opt = get_megatron_optimizer(opt_cfg, [ddp], use_gloo_process_groups=False, pg_collection=pgc)
    # the schedules reduce gradients (DP, tied embeddings, layer norms) through these hooks once per pass
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = ddp.no_sync
    return ddp, opt


class MegatronRunner:
    """One megatron-core pipeline stage (model chunk) of a role, behind the runner interface."""

    backend = "megatron"

    def __init__(self, gpt: nn.Module, pgc, *, attn_factory: Callable | None = None,
                 optim: MegatronOptimSettings | None = None, n_microbatches: int | None = None):
        assert_no_global_state()
        self.gpt, self.pgc = gpt, pgc
        self.attn_factory = attn_factory
        self.n_microbatches = n_microbatches
        self.pp = pgc.pp.size()
        self.ddp, self.optimizer = build_megatron_training(gpt, pgc, optim) if optim is not None else (None, None)
        self.last_metrics: list[dict] = []
        self._p2p = None

    # ---- layout
    @property
    def modules(self) -> list[nn.Module]:
        return [self.gpt]

    @property
    def has_first(self) -> bool:
        return bool(self.gpt.pre_process)

    @property
    def has_last(self) -> bool:
        return bool(self.gpt.post_process)

    def head_shard(self) -> tuple[torch.Tensor, int]:
        """(this rank's [V / tp, H] LM head rows, first vocab id of those rows) for vocab-parallel log-probs."""
        w = head_weight(self.gpt)
        return w, self.pgc.tp.rank() * w.shape[0]

    def score_weight(self) -> torch.Tensor:
        """[width, H] value / reward head (replicated over TP), last stage only."""
        return self.gpt.score.weight

    def hf_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, this rank's TP shard) of every parameter of the stage; views of the parameters where the
        layout allows (export, checkpoints of HF names)."""
        yield from megatron_hf_shards(self.gpt, self.pgc).items()

    def reshard_shards(self) -> dict[str, torch.Tensor]:
        """Training shards in the reshard planner's convention (see megatron_reshard_shards)."""
        return megatron_reshard_shards(self.gpt, self.pgc)

    # ---- compute
    def _attn(self, position_ids: torch.Tensor):
        return self.attn_factory(position_ids) if self.attn_factory is not None else None

    def _split(self, position_ids: torch.Tensor) -> list[slice]:
        b = position_ids.shape[0]
        n = self.n_microbatches or b
        if b % n:
            raise ValueError(f"batch({b}) must be divisible by n_microbatches({n})")
        step = b // n
        return [slice(i, i + step) for i in range(0, b, step)]

    def _check_inputs(self, input_ids, position_ids):
        if self.has_first and input_ids is None:
            raise ValueError("this rank holds the first stage: pass the input ids")
        if position_ids is None or position_ids.dim() != 2:
            raise ValueError("pass position_ids [B, T] on every pipeline rank (RoPE and document masks need them)")

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor | None, *, position_ids: torch.Tensor, attn=None) -> torch.Tensor | None:
        """[B, T] ids -> the last stage's final-normed hidden [B, T, H]; None on other stages."""
        self._check_inputs(input_ids, position_ids)
        if self.pp == 1:
            return megatron_hidden(self.gpt, input_ids, position_ids,
                                   attn=attn if attn is not None else self._attn(position_ids)).transpose(0, 1)
        outs = self._run_schedule(input_ids, position_ids, loss_fn=None, extras=None, forward_only=True)
        return torch.cat(outs, dim=0) if self.has_last else None

    def forward_backward(self, input_ids: torch.Tensor | None, *, position_ids: torch.Tensor, loss_fn: Callable,
                         extras: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """One training pass over the micro-batches; gradients accumulate in megatron's DDP buffers and are
        reduced (DP, tied embeddings) at the end of the pass. Returns per-micro-batch losses on the last stage."""
        require_cuda("forward_backward (megatron-core pipeline schedules)")
        self._check_inputs(input_ids, position_ids)
        return self._run_schedule(input_ids, position_ids, loss_fn=loss_fn, extras=extras or {}, forward_only=False)

    def _run_schedule(self, input_ids, position_ids, *, loss_fn, extras, forward_only: bool) -> list[torch.Tensor]:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        require_cuda("megatron-core pipeline schedules")
        parts = self._split(position_ids)
        n = len(parts)
        results: list[torch.Tensor] = []
        self.last_metrics = [{} for _ in range(n)]

        def forward_step(data_iterator, model):
            k = next(data_iterator)
            sl = parts[k]
            ids = input_ids[sl] if self.has_first else None
            out = megatron_hidden(self.gpt, ids, position_ids[sl], attn=self._attn(position_ids[sl]))

            def loss_func(output):
                hidden = output.transpose(0, 1)
                if loss_fn is None:  # forward only: keep the hidden states
                    results.append(hidden.detach())
                    return hidden.new_zeros(()), {}
                res = loss_fn(hidden, {**{key: v[sl] for key, v in extras.items()}, "mb_index": k})
                loss, metrics = res if isinstance(res, tuple) else (res, {})
                self.last_metrics[k] = metrics
                results.append(loss.detach())
                # the schedule divides each micro-batch loss by n; ours is already globally normalised
                return loss * n, metrics

            return out, loss_func

        if self._p2p is None and self.pp > 1:
            self._p2p = P2PCommunicator(pp_group=self.pgc.pp, config=self.gpt.config)
        fb = get_forward_backward_func(pp_size=self.pp, vp_size=None)
        fb(forward_step_func=forward_step, data_iterator=iter(range(n)), model=[self.ddp or self.gpt],
           num_microbatches=n, seq_length=position_ids.shape[1], micro_batch_size=parts[0].stop - parts[0].start,
           forward_only=forward_only, p2p_communicator=self._p2p, pg_collection=self.pgc)
        return results if self.has_last else []

    # ---- optimizer
    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> float | None:
        """Clip (global norm over the role group) and apply Adam; returns the pre-clip grad norm (None when
        clipping is off: megatron-core then does not compute it)."""
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("megatron optimizer skipped the step (non-finite gradients)")
        return float(grad_norm) if grad_norm is not None else None

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def weights_loaded(self) -> None:
        """After writing new weights into the model (HF load, reshard back): refresh the fp32 master copies."""
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    # ---- offload around generation (hybrid engine)
    def _state_tensors(self):
        """(holder, key) of every optimizer tensor that may leave the GPU: Adam moments always; the fp32
        master shards only when the model is half precision (with fp32 params they are views of the model's
        own parameter buffer, which stays where it is)."""
        inner = self.optimizer.optimizer  # the torch optimizer megatron-core wraps
        for st in inner.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    yield st, k
        if self.gpt.config.params_dtype != torch.float32:
            for g in inner.param_groups:
                for p in g["params"]:
                    yield p, None

    def offload_training_state(self) -> None:
        """Optimizer state to CPU and DDP grad buffers freed (their storage resized to 0) while generating."""
        if self.optimizer is None:
            return
        for holder, key in self._state_tensors():
            if key is None:
                holder.data = holder.data.cpu()
            else:
                holder[key] = holder[key].cpu()
        for buf in self.ddp.buffers:
            buf.offload_to_cpu(move_params=False, move_grads=True)
        torch.cuda.empty_cache()

    def reload_training_state(self) -> None:
        if self.optimizer is None:
            return
        dev = torch.device("cuda", torch.cuda.current_device())
        for holder, key in self._state_tensors():
            if key is None:
                holder.data = holder.data.to(dev)
            else:
                holder[key] = holder[key].to(dev)
        for buf in self.ddp.buffers:
            buf.reload_from_cpu(move_params=False, move_grads=True)

    # ---- checkpoints (per rank; ppo/checkpoint.py writes them atomically)
    def state_dict(self) -> dict:
        """This rank's model shard (megatron names), the optimizer's scalar state and the distributed
        optimizer's fp32 master + Adam shards (bucket space of this DP rank), all cloned to CPU."""
        state = {"params": {n: p.detach().cpu().clone() for n, p in self.gpt.named_parameters()}}
        if self.optimizer is not None:
            state["optim"] = _clone_cpu(self.optimizer.state_dict())
            state["dist_optim"] = _clone_cpu(self.optimizer.get_parameter_state_dp_reshardable())
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        params = dict(self.gpt.named_parameters())
        if set(state["params"]) != set(params):
            raise KeyError("checkpoint was written for another layout or model: megatron parameter names differ "
                           f"({sorted(set(state['params']) ^ set(params))[:4]}); resume with the same plan")
        for n, p in params.items():
            p.copy_(state["params"][n])
        if self.optimizer is None:
            return
        self.optimizer.reload_model_params()
        if "optim" in state:
            self.optimizer.load_state_dict(state["optim"])
        if "dist_optim" in state:
            dist_state = state["dist_optim"]
            for gbuf in (v for k, v in dist_state.items() if isinstance(k, int)):
                for buckets in gbuf.values():
                    for bucket in buckets:
                        for entry in bucket:
                            entry.setdefault("padding", False)  # the getter never writes the key the loader reads
            self.optimizer.load_parameter_state_from_dp_reshardable(dist_state)


def _clone_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _clone_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_cpu(v) for v in obj)
    return obj
