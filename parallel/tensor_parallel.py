"""Tensor parallelism with DTensor: `apply_tp(model, tp_mesh, *, loss_parallel=False)`.

The plan follows parallel/sharding.py (the table training, generation and resharding
share): q/k/v/gate/up are column parallel (output features, weight and bias dim 0),
o/down row parallel (input features, dim 1), embed_tokens and lm_head are vocab
parallel (dim 0), norms replicated (as Replicate DTensors: every parameter is a DTensor;
Qwen3's per-head q/k norms too, their gradients summed over the TP group).
Between the column and row projections activations stay local tensors of heads/tp
heads, so the model's `-1`-heads reshapes run unchanged. The only collectives are one
all-reduce after o_proj, one after down_proj, one after the embedding lookup and (unless
loss_parallel) an all-gather of the logits.

With `loss_parallel=True` the logits stay a DTensor sharded on the vocab dim: use it
under `torch.distributed.tensor.parallel.loss_parallel()` for cross-entropy, or skip the
head and call parallel.vocab_parallel.vocab_parallel_token_logprobs on
`lm_head.weight.to_local()`.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from parallel.sharding import tp_shard_dim


class ReplicateParallel(ParallelStyle):
    """Replicated parameters (norms) as Replicate DTensors, local tensors in and out.

    Keeps every parameter of a TP model a DTensor, so foreach/fused optimizers and grad-norm
    code never see a mix of Tensor and DTensor. The norm runs on DTensors (its input is wrapped,
    its output unwrapped). `input_shard_dim=None`: the input is the same on every rank
    (hidden-size norms), no collective either way. `input_shard_dim=d`: the input is this rank's
    part along dim d (Qwen3's q/k norms see the local heads, dim 1 of [B, H, T, D]); the weight's
    gradient is then a sum over every rank's heads, which DTensor all-reduces in backward, where a
    Replicate input would silently keep this rank's partial sum.
    """

    def __init__(self, *, input_shard_dim: int | None = None):
        super().__init__()
        self.input_placement = Replicate() if input_shard_dim is None else Shard(input_shard_dim)

    def _partition(self, name, module, mesh):
        for pname, p in list(module.named_parameters(recurse=False)):
            param = nn.Parameter(distribute_tensor(p, mesh, [Replicate()]))
            if isinstance(self.input_placement, Shard):
                param.register_post_accumulate_grad_hook(_reduce_partial_grad)
            module.register_parameter(pname, param)

    def _inputs(self, module, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [self.input_placement], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    @staticmethod
    def _outputs(module, outputs, mesh):
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._inputs, self._outputs)


def _reduce_partial_grad(param: nn.Parameter) -> None:
    """A Replicate weight applied to sharded inputs gets a Partial(sum) gradient: all-reduce it once, here,
    so optimizers and grad-norm code see Replicate gradients like every other norm's (FSDP2, which
    re-registers parameters, does the same reduction in its own post-backward)."""
    if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
        param.grad = param.grad.redistribute(placements=param.placements)


class _AllReduceSum(torch.autograd.Function):
    """Sum of per-rank partials in forward; identity in backward (every rank needs the full gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _vocab_embed_forward(module: nn.Embedding, ids: torch.Tensor, *, mesh) -> torch.Tensor:
    w = module.weight.to_local()  # differentiable: the gradient lands on the Shard(0) DTensor
    rows = w.shape[0]
    local = ids - mesh.get_local_rank() * rows
    owned = (local >= 0) & (local < rows)
    out = F.embedding(local.clamp(0, rows - 1), w) * owned[..., None].to(w.dtype)
    return _AllReduceSum.apply(out, mesh.get_group())


class VocabParallel(ParallelStyle):
    """A ParallelStyle like ColwiseParallel: embedding rows split over the TP group (weight a Shard(0)
    DTensor), ids and output local. (rollout.local_model.VocabParallelEmbedding is the engine's module.)

    Each rank looks up the ids it owns, zeros the rest and the partials are all-reduced. Hand
    written instead of RowwiseParallel because a DTensor redistribute on this output fails in
    backward when the decoder layers after it are torch.compiled (torch 2.13).
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight, device_mesh, [Shard(0)])))
        module.forward = functools.partial(_vocab_embed_forward, module, mesh=device_mesh)
        return module


def tp_plan(model: nn.Module, *, loss_parallel: bool = False) -> dict[str, object]:
    """Fully qualified module name -> ParallelStyle for every present module of `model`.

    Works on pipeline stages too (absent embed/norm/head and deleted layers are skipped).
    """
    plan: dict[str, object] = {}
    trunk = model.model
    if trunk.embed_tokens is not None:
        # vocab-parallel lookup: each rank embeds the ids it owns, the partial sums are all-reduced
        plan["model.embed_tokens"] = VocabParallel()
    for key in trunk.layers:
        p = f"model.layers.{key}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{p}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{p}.{name}"] = RowwiseParallel()
        for name in ("input_layernorm", "post_attention_layernorm"):
            plan[f"{p}.{name}"] = ReplicateParallel()
        if trunk.layers[key].self_attn.q_norm is not None:  # Qwen3: [D] weights over [B, H/tp, T, D] heads
            for name in ("self_attn.q_norm", "self_attn.k_norm"):
                plan[f"{p}.{name}"] = ReplicateParallel(input_shard_dim=1)
    if trunk.norm is not None:
        plan["model.norm"] = ReplicateParallel()
    if getattr(model, "lm_head", None) is not None:
        plan["lm_head"] = ColwiseParallel(
            output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel)
    return plan


def _check_plan_matches_table(model: nn.Module) -> None:
    """Every parameter's DTensor shard dim must be the one parallel/sharding.py promises."""
    for name, p in model.named_parameters():
        want = tp_shard_dim(name)
        if isinstance(p, DTensor):
            shards = [pl.dim for pl in p.placements if isinstance(pl, Shard)]
            got = shards[0] if shards else None
        else:
            got = None
        if got != want:
            raise AssertionError(f"TP plan shards {name} on dim {got} but parallel/sharding.py says {want}")


def apply_tp(model: nn.Module, tp_mesh, *, loss_parallel: bool = False) -> nn.Module:
    """Shard `model` (a LlamaForCausalLM or a pipeline stage of one) over the 1-D `tp_mesh` in place.

    Requires tp to divide the head counts, intermediate size and vocab size.
    """
    cfg = model.config
    tp = tp_mesh.size()
    for what, n in (("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads", cfg.num_key_value_heads),
                    ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)):
        if n % tp:
            raise ValueError(f"tp({tp}) must divide {what}({n}); choose a tp that divides it")
    parallelize_module(model, tp_mesh, tp_plan(model, loss_parallel=loss_parallel))
    if cfg.tie_word_embeddings and hasattr(model, "tie_weights"):
        # the plan distributed the shared [V, H] weight twice; both modules shard it on dim 0 (vocab rows),
        # so one Shard(0) DTensor serves both and the lookup's and the head's gradients add up in it
        model.tie_weights()
    _check_plan_matches_table(model)
    return model
