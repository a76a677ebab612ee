"""`ShardLocalAdamW`: torch.optim.AdamW that steps DTensor parameters through their local shards.

    opt = ShardLocalAdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
    loss.backward()
    opt.step()      # the same update as torch.optim.AdamW(..., fused=True) on the same parameters

Why: FSDP2 and tensor parallelism make every parameter, gradient and Adam moment a DTensor, and
torch's AdamW then sends its one fused call over ~150 x 4 DTensors through DTensor's dispatcher:
sharding propagation on the host, a 5.2 ms gap per step for a 1B model on the H200 machine, during
which the device idles (the step follows the gradient norm's host sync; bench.train_step's
profile of the fp32-master step shows the gap). AdamW is elementwise, so each rank's update of its
shard is the whole update: here the fused kernel runs on the local tensors (aliases of the
DTensors' data), and the state stays AdamW's ("step", "exp_avg", "exp_avg_sq" per parameter,
the moments DTensors laid out like their parameter), so checkpoints, distributed state dicts and
LR schedulers treat it as an AdamW. Plain tensors pass through unchanged.
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw


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


class ShardLocalAdamW(torch.optim.AdamW):
    """AdamW (decoupled weight decay, no amsgrad) whose step runs on local shards.

    fused None: torch's fused kernel where every parameter is on CUDA, else the single-tensor loop
    (AdamW's own choice for CPU tensors without foreach)."""

    def __init__(self, params, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, fused: bool | None = None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        if fused is None:
            fused = all(local(p).is_cuda for g in self.param_groups for p in g["params"])
        for g in self.param_groups:
            g["fused"] = bool(fused)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            self._step_group(gi, group)
        return loss

    def _step_group(self, gi: int, group: dict) -> None:
        """One parameter group's update (subclasses place the moments elsewhere: parallel/offload_optim.py)."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:  # as AdamW: no gradient, no state and no step
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            state = self.state[p]
            if not state:
                init_moments(state, p, group)
            params.append(local(p))
            grads.append(local(p.grad))
            exp_avgs.append(local(state["exp_avg"]))
            exp_avg_sqs.append(local(state["exp_avg_sq"]))
            steps.append(state["step"])
        if params:
            adamw_update(params, grads, exp_avgs, exp_avg_sqs, steps, group)


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
