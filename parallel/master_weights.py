"""Megatron's mixed-precision layout for a model that is not data-sharded: 16-bit parameters, fp32
gradient accumulation (`p.main_grad`) and fp32 master weights inside the optimizer.

    model.to(torch.bfloat16); attach_main_grads(model)   # after TP, before the optimizer
    for mb in micro_batches:
        loss(mb).backward()          # each parameter's bf16 .grad is summed into p.main_grad (fp32), then freed
    opt = MasterWeightAdamW(params, lr=1e-6)             # fp32 masters and moments in its state
    opt.step(grad_scale=clip)        # AdamW on the masters from main_grad x clip, the bf16 params written
    opt.zero_grad()                  # main_grad = None: the next backward starts it from its first gradient

Why: on one data-parallel rank FSDP2's mixed precision (fp32 parameters, bf16 compute copies)
shards nothing but still casts every parameter to bf16 before each micro-batch's forward, through
per-parameter Python work that takes longer than a layer's forward on the H200 machine (the
fp32-master train step: 16 host gaps of 0.65-0.95 ms per step, `bench.train_step --profile`).
Here the forward reads the bf16 parameters as they are; the gradient still accumulates in fp32
across micro-batches (as FSDP's reduce_dtype=fp32 and megatron's grad_reduce_in_fp32 do), and the
fp32 -> bf16 copy happens once per optimizer step instead of once per micro-batch. parallel/apply.py
chooses this layout for mixed precision when nothing is data-sharded (dp = 1) and FSDP2 otherwise.

A main grad holding one micro-batch's gradient keeps it in the 16-bit dtype it came in (exactly the
fp32 sum of one term); the second gradient converts it to fp32 before adding. On CUDA the optimizer's
step is one Triton kernel (parallel/triton_adamw.py) that reads either dtype, applies the clip
coefficient, updates the fp32 master and moments and writes the bf16 weight: a step with one
micro-batch makes no cast, scale or copy pass over the parameters of its own.

Numerics: the same as FSDP2's mixed precision at dp = 1 (compute on the bf16 rounding of the fp32
master, bf16 gradients summed into fp32, AdamW in fp32): tests/parallel/test_master_weights.py
checks the two layouts bit for bit. Weights loaded into the bf16 model start the masters at their
bf16 rounding (Hugging Face checkpoints of these models are bf16 already); a resumed run restores
the fp32 masters from the optimizer's state (tests/ppo/test_trainer.py resumes bit for bit). The Hugging
Face export (`runner.export_state_dict`) writes the bf16 weights the model computes with; the fp32
masters are in the run's checkpoints only.
"""

from __future__ import annotations

import torch
from torch import nn

from parallel import triton_multi_tensor
from parallel.shard_adamw import ShardLocalAdamW, Stepped, init_moments, like, local

HALF = (torch.bfloat16, torch.float16)


def attach_main_grads(module: nn.Module) -> int:
    """Give every trainable 16-bit parameter of `module` an fp32 `main_grad` (None until its first gradient)
    fed by a post-accumulate-grad hook. Call after tensor parallelism (which replaces the parameters) and
    after hooks that fix a gradient's placement (they must run first). Returns the count."""
    n, accumulate = 0, _Accumulator()
    for p in module.parameters():
        if p.requires_grad and p.dtype in HALF and not hasattr(p, "main_grad"):
            p.main_grad = None
            p.register_post_accumulate_grad_hook(accumulate)
            n += 1
    return n


class _Accumulator:
    """The post-accumulate-grad hook of a model's parameters. The first gradient of a step becomes the main grad
    as it is (its fp32 sum of one term, exactly). A later one waits in a bucket that is added into the fp32 main
    grads (their local shards: no DTensor dispatch) by one multi-tensor launch (`accumulate`) once it holds
    BUCKET_BYTES, and at the end of the backward: a separate add_ launched from Python per parameter left the GPU
    waiting on the host before most of them (2,809 of the 10,105 idle gaps of the Qwen3 recipe's update on an
    H200)."""

    BUCKET_BYTES = 64 << 20

    def __init__(self):
        self.pending: list[torch.Tensor] = []
        self.bytes = 0
        self.task: int | None = None  # the backward (autograd graph task) whose end-of-backward flush is queued

    def __call__(self, p: torch.Tensor) -> None:
        if p.main_grad is None:
            p.main_grad, p.grad = p.grad, None
            return
        task = torch._C._current_graph_task_id()
        if task != self.task:
            # a backward that raised (a CUDA OOM the update retries after zero_grad) never ran its flush: what it
            # left pending is dropped with it
            self.pending, self.bytes, self.task = [], 0, task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self.pending.append(p)
        self.bytes += p.grad.numel() * p.grad.element_size()
        if self.bytes >= self.BUCKET_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            accumulate(fp32_grads(self.pending), [local(p.grad) for p in self.pending])
            for p in self.pending:
                p.grad = None
        self.pending, self.bytes = [], 0

    def _end_of_backward(self) -> None:
        self.task = None
        self.flush()


def fp32_grad(p: torch.Tensor) -> torch.Tensor:
    """The local fp32 tensor that accumulates `p`'s main grad (a 16-bit one is converted first, in place of the
    old); `p.grad`'s local tensor for a parameter without main grads."""
    return fp32_grads([p])[0]


def fp32_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32_grad of each parameter, the 16-bit main grads among them converted by one foreach copy."""
    out = [local(p.main_grad) if hasattr(p, "main_grad") else local(p.grad) for p in params]
    half = [k for k, g in enumerate(out) if g.dtype != torch.float32 and hasattr(params[k], "main_grad")]
    if half:
        bufs = [torch.empty_like(out[k], dtype=torch.float32) for k in half]
        # the foreach copy casts with vectorized loads: `g.to(float32)` ran CUDA's unrolled casting kernel at
        # ~1.9 TB/s on the H200 machine (4 ms per step for 1.2 B parameters: bench.train_step --profile)
        torch._foreach_copy_(bufs, [out[k] for k in half])
        for k, buf in zip(half, bufs, strict=True):
            params[k].main_grad, out[k] = like(params[k].main_grad, buf), buf
    return out


def accumulate(accs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """accs[i] += grads[i] (fp32 accumulators, gradients of one dtype): one multi-tensor Triton launch where it runs
    and the gradients are 16-bit (torch's `_foreach_add_` runs one kernel per tensor for mixed dtypes), else torch's
    foreach add (fused for one dtype)."""
    both = (*accs, *grads)
    if grads and grads[0].dtype in HALF and {x.dtype for x in accs} == {torch.float32} \
            and {x.dtype for x in grads} == {grads[0].dtype} and len({x.device for x in both}) == 1 \
            and triton_multi_tensor.available(grads[0].device) and all(x.is_contiguous() for x in both):
        triton_multi_tensor.accumulate_(accs, grads)
    else:
        torch._foreach_add_(accs, grads)


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer steps: `main_grad` for a parameter that has one (fp32, or 16-bit while it holds
    one micro-batch's gradient), else `.grad`."""
    return p.main_grad if hasattr(p, "main_grad") else p.grad


def clear_grad(p: torch.Tensor) -> None:
    """Drop a parameter's gradient storage (both kinds)."""
    p.grad = None
    if hasattr(p, "main_grad"):
        p.main_grad = None


class MasterWeightAdamW(ShardLocalAdamW):
    """AdamW over fp32 master copies of 16-bit parameters, stepping their `main_grad`s.

    The state per parameter is AdamW's ("step", "exp_avg", "exp_avg_sq", fp32 and laid out like the
    parameter: DTensors for DTensors) plus "master", the fp32 weight. The runner's checkpoints save the
    masters as the parameters and put them back with `set_masters` (parallel/runner.py), so they have
    FSDP2's format. A parameter without main_grad (a plain fp32 one) is stepped as ShardLocalAdamW
    would, in place. On CUDA the Triton update reads each main grad in its dtype and writes the master, the
    moments and the 16-bit weight at once; torch's path steps fp32 copies of 16-bit main grads, then one
    foreach copy writes the 16-bit weights."""

    def _step_group(self, gi: int, group: dict, grad_scale: float) -> None:
        stepped = []
        for p in group["params"]:
            g = grad_of(p)
            if g is None:  # as AdamW: no gradient, no state and no step
                continue
            state = self.state[p]
            if p.dtype in HALF and "master" not in state:
                # first step, or a state loaded without masters: the master starts from the 16-bit weight
                state["master"] = p.detach().to(torch.float32)
            if "step" not in state:
                init_moments(state, state.get("master", p), group)
            master = state.get("master")
            stepped.append(Stepped(local(g), local(master if master is not None else p), local(state["exp_avg"]),
                                   local(state["exp_avg_sq"]), state["step"],
                                   copy=local(p) if master is not None else None))
        self._step_tensors(stepped, group, grad_scale)

    def masters(self) -> dict[torch.Tensor, torch.Tensor]:
        """{16-bit parameter: its fp32 master} for the parameters that have stepped (or were given one)."""
        return {p: st["master"] for p, st in self.state.items() if "master" in st}

    def set_masters(self, masters: dict[torch.Tensor, torch.Tensor]) -> None:
        """Put full-precision weights (e.g. a checkpoint's parameters) in as the 16-bit parameters' masters."""
        for p, w in masters.items():
            if p.dtype in HALF:
                self.state[p]["master"] = w.detach().to(dtype=torch.float32, copy=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                if getattr(p, "main_grad", None) is None:
                    continue
                if set_to_none:
                    p.main_grad = None
                else:
                    local(p.main_grad).zero_()

    def load_state_dict(self, state_dict: dict) -> None:
        """AdamW's loader casts every floating state tensor to its parameter's dtype, which would round the
        fp32 masters and moments to bf16: they are put back from `state_dict` at full precision."""
        super().load_state_dict(state_dict)
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        live = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved, live):
            for k, v in state_dict["state"].get(i, {}).items():
                if k != "step" and torch.is_tensor(v) and v.is_floating_point():
                    self.state[p][k] = v.to(device=local(p).device, dtype=torch.float32, copy=True)
