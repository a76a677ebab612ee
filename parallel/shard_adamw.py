"""`ShardLocalAdamW`: torch.optim.AdamW that steps DTensor parameters through their local shards.

    opt = ShardLocalAdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
    loss.backward()
    opt.step(grad_scale=clip)   # torch.optim.AdamW's update from the gradients x clip, on the local shards

Why: FSDP2 and tensor parallelism make every parameter, gradient and Adam moment a DTensor, and
torch's AdamW then sends its one fused call over ~150 x 4 DTensors through DTensor's dispatcher:
sharding propagation on the host, a 5.2 ms gap per step for a 1B model on the H200 machine, during
which the device idles (the step follows the gradient norm's host sync; bench.train_step's
profile of the fp32-master step shows the gap). AdamW is elementwise, so each rank's update of its
shard is the whole update: here the fused kernel runs on the local tensors (aliases of the
DTensors' data), and the state stays AdamW's ("step", "exp_avg", "exp_avg_sq" per parameter,
the moments DTensors laid out like their parameter), so checkpoints, distributed state dicts and
LR schedulers treat it as an AdamW. Plain tensors pass through unchanged.

On CUDA the update is one Triton kernel over every tensor (parallel/triton_adamw.py, `kernel`), which also
applies the clip coefficient as it reads each gradient, so clipping makes no pass of its own; its step
counts live on the host. Elsewhere, or with kernel=False, torch's functional AdamW runs it (fused on CUDA:
bit for bit torch.optim.AdamW(fused=True)) after an in-place scaling of the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw

from parallel import triton_adamw


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (an alias: in-place updates reach the DTensor), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def like(ref: torch.Tensor, local_tensor: torch.Tensor) -> torch.Tensor:
    """`local_tensor` (on `ref`'s local device) as a DTensor with `ref`'s mesh, placements and global shape when
    `ref` is one, else as it is: the inverse of `local`."""
    local_tensor = local_tensor.to(local(ref).device)
    if not hasattr(ref, "device_mesh"):
        return local_tensor
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local_tensor, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape,
                              stride=ref.stride())


@dataclass
class Stepped:
    """One parameter's tensors for an update (local shards): AdamW steps `weight` (the parameter, or its fp32
    master) from `grad`, then `copy` (the 16-bit parameter of a master; None otherwise) takes its rounding."""
    grad: torch.Tensor
    weight: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    copy: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.grad, self.weight, self.exp_avg, self.exp_avg_sq, self.copy) if t is not None]


class ShardLocalAdamW(torch.optim.AdamW):
    """AdamW (decoupled weight decay, no amsgrad) whose step runs on local shards.

    kernel: the Triton update (parallel/triton_adamw.py); None: where it runs natively, i.e. every parameter on
    CUDA with triton installed. fused (torch's path): None: torch's fused kernel where every parameter is on
    CUDA, else the single-tensor loop (AdamW's own choice for CPU tensors without foreach)."""

    def __init__(self, params, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, fused: bool | None = None, kernel: bool | None = None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        on_cuda = all(local(p).is_cuda for g in self.param_groups for p in g["params"])
        self.kernel = bool(on_cuda and triton_adamw.available("cuda")) if kernel is None else kernel
        if fused is None:
            fused = on_cuda
        for g in self.param_groups:
            # with the kernel the step counts live on the host, as the single-tensor loop keeps them
            g["fused"] = bool(fused) and not self.kernel
        self._fused = [g["fused"] for g in self.param_groups]

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0):
        """One AdamW step from every gradient x `grad_scale` (the clip coefficient; torch's path scales the
        gradients in place, the kernel as it reads them)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            self._step_group(gi, group, grad_scale)
        return loss

    def _step_group(self, gi: int, group: dict, grad_scale: float) -> None:
        """One parameter group's update (subclasses place the moments elsewhere: parallel/offload_optim.py)."""
        stepped = []
        for p in group["params"]:
            if p.grad is None:  # as AdamW: no gradient, no state and no step
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            state = self.state[p]
            if not state:
                init_moments(state, p, group)
            stepped.append(Stepped(local(p.grad), local(p), local(state["exp_avg"]), local(state["exp_avg_sq"]),
                                   state["step"]))
        self._step_tensors(stepped, group, grad_scale)

    def _step_tensors(self, stepped: list[Stepped], group: dict, grad_scale: float) -> None:
        """AdamW over `stepped`: the kernel for each (dtypes, step) bucket where it runs, torch's path for the rest."""
        buckets: dict[tuple, list[Stepped]] = {}
        rest = []
        if self.kernel:
            fit = []  # (entry, its dtypes)
            for x in stepped:
                ts = x.tensors()
                if all(t.is_contiguous() for t in ts):
                    fit.append((x, tuple(t.dtype for t in ts)))
                else:
                    rest.append(x)
            if fit:
                # host tensors: the kernel reads the bias corrections as arguments (two host ops, not two per tensor)
                counts = [x.step for x, _ in fit]
                torch._foreach_add_(counts, 1.0)
                for (x, dtypes), n in zip(fit, torch.stack(counts).tolist()):
                    buckets.setdefault((*dtypes, x.copy is not None, int(n)), []).append(x)
        else:
            rest = stepped
        for key, xs in buckets.items():
            triton_adamw.adamw_([x.grad for x in xs], [x.weight for x in xs], [x.exp_avg for x in xs],
                                [x.exp_avg_sq for x in xs], [x.copy for x in xs] if xs[0].copy is not None else None,
                                lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                weight_decay=group["weight_decay"], step=key[-1], grad_scale=grad_scale)
        if not rest:
            return
        # a 16-bit gradient of an fp32 master steps as its fp32 copy (exact)
        grads = [x.grad if x.grad.dtype == x.weight.dtype else x.grad.to(x.weight.dtype) for x in rest]
        if grad_scale != 1.0:
            # a few fused launches, not one per parameter, on the local shards
            torch._foreach_mul_(grads, grad_scale)
        adamw_update([x.weight for x in rest], grads, [x.exp_avg for x in rest], [x.exp_avg_sq for x in rest],
                     [x.step for x in rest], group)
        copies = [x for x in rest if x.copy is not None]
        if copies:  # one fused cast-copy into the 16-bit weights the forward reads
            torch._foreach_copy_([x.copy for x in copies], [x.weight for x in copies])

    def load_state_dict(self, state_dict: dict) -> None:
        """AdamW's loader, then each step count placed where this optimizer reads it (the loaded groups carry the
        saving run's "fused": the device for torch's fused kernel, else the host)."""
        super().load_state_dict(state_dict)
        for g, fused in zip(self.param_groups, self._fused):
            g["fused"] = fused
            for p in g["params"]:
                if "step" in (st := self.state.get(p, {})):
                    st["step"] = st["step"].to(local(p).device if fused else "cpu", torch.float32, copy=True)


def init_moments(state: dict, like_tensor: torch.Tensor, group: dict) -> None:
    """AdamW's lazy state: "step" and zero moments laid out like `like_tensor` (DTensors for DTensors)."""
    # the fused kernel reads and bumps the step on the device; the loop keeps it on the host
    state["step"] = torch.zeros((), dtype=torch.float32, device=local(like_tensor).device if group["fused"] else "cpu")
    state["exp_avg"] = torch.zeros_like(like_tensor, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(like_tensor, memory_format=torch.preserve_format)


def adamw_update(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, steps: list, group: dict) -> None:
    """torch's functional AdamW over plain (local) tensors with one parameter group's hyperparameters:
    the fused kernel when the group says so, else the single-tensor loop."""
    beta1, beta2 = group["betas"]
    adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps,
          foreach=False, fused=group["fused"], capturable=False, differentiable=False,
          amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
          eps=group["eps"], maximize=False)
