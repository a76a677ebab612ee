"""`HostOffloadAdamW`: AdamW whose moments (exp_avg, exp_avg_sq) live in pinned host memory.

    opt = HostOffloadAdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
    loss.backward()
    opt.step()      # the same update as torch.optim.AdamW(..., fused=True) on CUDA, bit for bit

Why: Adam's two fp32 moments are 8 bytes per parameter, the largest item of a trained model's
memory (a 7B actor: 54 GB of moments beside 27 GB of fp32 master weights and 27 GB of fp32
gradients). Between steps the moments are touched by nothing, so they can wait in host memory
and visit the GPU one chunk at a time during `step()`.

How a step runs (per parameter group), with two copy streams beside the compute stream:

    host->device  | m,v of chunk i+1 |  m,v of chunk i+2 | ...
    compute       |   AdamW on chunk i  |  AdamW on chunk i+1 | ...
    device->host  | m,v of chunk i-1 |  m,v of chunk i   | ...

PCIe is full duplex, so the step costs about max(bytes up, bytes down) / bandwidth: 54 GB each
way for 7B, ~1.1 s at 50 GB/s. Device memory holds at most two chunks of moments at a time
(`chunk_bytes` each, the chunk being updated and the next one). The update itself is torch's own AdamW
(the functional `torch.optim.adamw.adamw`, fused on CUDA) over the staged moments, so the arithmetic is AdamW's.
Parameters and gradients stay where they are (device; DTensor shards are updated through their
local tensors), and so does the step counter (fused AdamW reads it on the device).

On a CPU-only run the "device" is the host: the same staging copies run synchronously, which is
what the CPU tests exercise against torch.optim.AdamW.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.optim.adamw import adamw

DEFAULT_CHUNK_BYTES = 512 << 20  # moments (m and v) per staged chunk: 1 GiB of device memory at most


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (an alias: in-place updates reach the DTensor), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass(slots=True)
class _Chunk:
    """A run of parameters whose moments travel together."""

    params: list[torch.Tensor] = field(default_factory=list)  # local tensors, on the device
    grads: list[torch.Tensor] = field(default_factory=list)
    host: list[torch.Tensor] = field(default_factory=list)  # [m_0, v_0, m_1, v_1, ...] in host memory
    steps: list[torch.Tensor] = field(default_factory=list)
    staged: list[torch.Tensor] = field(default_factory=list)  # device copies of `host`, while in flight
    loaded: object = None  # CUDA event: staging copy done
    stored: object = None  # CUDA event: moments back in host memory
    nbytes: int = 0


class HostOffloadAdamW(torch.optim.AdamW):
    """torch.optim.AdamW with exp_avg / exp_avg_sq kept in (pinned) host memory between steps.

    params: as for AdamW (tensors or DTensors on one device). chunk_bytes: moments (both) per
    staged chunk. amsgrad, maximize, capturable, differentiable and foreach/fused choices are
    not offered: fused AdamW runs on CUDA, the single-tensor loop elsewhere (torch's own defaults).
    The state_dict has AdamW's layout ("step", "exp_avg", "exp_avg_sq" per parameter), so
    checkpoints and LR schedulers treat it as an AdamW.
    """

    states_on_host = True  # checkpoint loaders: hand the moments over as saved, never place them on the device

    def __init__(self, params, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be >= 1")
        self.chunk_bytes = chunk_bytes
        devices = {_local(p).device for g in self.param_groups for p in g["params"]}
        if len(devices) != 1:
            raise ValueError(f"HostOffloadAdamW needs every parameter on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.cuda = self.device.type == "cuda"
        self._h2d = torch.cuda.Stream(self.device) if self.cuda else None
        self._d2h = torch.cuda.Stream(self.device) if self.cuda else None

    # ---- state ----
    def _host_zeros(self, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.cuda)

    def _state_of(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            local = _local(p)
            # fused AdamW reads and bumps the step on the device; the single-tensor loop keeps it on the host
            state["step"] = torch.zeros((), dtype=torch.float32, device=self.device if self.cuda else "cpu")
            state["exp_avg"] = self._host_zeros(local)
            state["exp_avg_sq"] = self._host_zeros(local)
        return state

    def host_bytes(self) -> int:
        """Bytes of moments held in host memory."""
        return sum(v.numel() * v.element_size() for s in self.state.values()
                   for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))

    def load_state_dict(self, state_dict: dict) -> None:
        """AdamW's loader, except that the moments go to (pinned) host memory, never to the device:
        torch's loader would cast them to each parameter's device (8 bytes/param of device memory)."""
        moments = {pid: {k: s[k] for k in ("exp_avg", "exp_avg_sq") if k in s}
                   for pid, s in state_dict["state"].items()}
        rest = {pid: {k: v for k, v in s.items() if k not in ("exp_avg", "exp_avg_sq")}
                for pid, s in state_dict["state"].items()}
        super().load_state_dict({"state": rest, "param_groups": state_dict["param_groups"]})
        ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            for k, v in moments.get(pid, {}).items():
                host = self._host_zeros(_local(p))
                host.copy_(_local(v))
                self.state[p][k] = host
            if pid in moments:  # the step counter where this optimizer's kernels expect it
                self.state[p]["step"] = self.state[p]["step"].to(self.device if self.cuda else "cpu",
                                                                 torch.float32)

    # ---- the step ----
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _chunks(self, group: dict) -> list[_Chunk]:
        chunks = [_Chunk()]
        for p in group["params"]:
            if p.grad is None:  # as AdamW: no gradient, no state and no step
                continue
            if p.grad.is_sparse:
                raise RuntimeError("HostOffloadAdamW does not support sparse gradients")
            state = self._state_of(p)
            c = chunks[-1]
            if c.params and c.nbytes >= self.chunk_bytes:
                c = _Chunk()
                chunks.append(c)
            c.params.append(_local(p))
            c.grads.append(_local(p.grad))
            c.host += [state["exp_avg"], state["exp_avg_sq"]]
            c.steps.append(state["step"])
            c.nbytes += 2 * state["exp_avg"].numel() * state["exp_avg"].element_size()
        return [c for c in chunks if c.params]

    def _stage(self, c: _Chunk) -> None:
        """Moments of `c` to the device (on the host->device stream)."""
        # allocated on the compute stream, where they are used; the copy stream waits for that point
        c.staged = [torch.empty_like(h, device=self.device) for h in c.host]
        if not self.cuda:
            for d, h in zip(c.staged, c.host):
                d.copy_(h)
            return
        self._h2d.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._h2d):
            for d, h in zip(c.staged, c.host):
                d.copy_(h, non_blocking=True)
            c.loaded = torch.cuda.Event()
            c.loaded.record(self._h2d)

    def _update(self, c: _Chunk, group: dict) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(c.loaded)
        beta1, beta2 = group["betas"]
        adamw(
            c.params, c.grads, c.staged[0::2], c.staged[1::2], [], c.steps,
            foreach=False, fused=self.cuda, capturable=False, differentiable=False,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=False)

    def _unstage(self, c: _Chunk) -> None:
        """Updated moments back to host memory (on the device->host stream); the staging is released."""
        if not self.cuda:
            for d, h in zip(c.staged, c.host):
                h.copy_(d)
            c.staged = []
            return
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h):
            for d, h in zip(c.staged, c.host):
                h.copy_(d, non_blocking=True)
                d.record_stream(self._d2h)  # the allocator may reuse the block only after this copy
            c.stored = torch.cuda.Event()
            c.stored.record(self._d2h)
        c.staged = []

    def _step_group(self, group: dict) -> None:
        chunks = self._chunks(group)
        returning: deque[_Chunk] = deque()
        if chunks:
            self._stage(chunks[0])
        for i, c in enumerate(chunks):
            if i + 1 < len(chunks):
                # bound device memory to chunks i and i+1: chunk i-1's moments are home before i+1 is staged
                # (its copy ran beside chunk i's; i+1's host->device copy then runs beside i's device->host)
                while returning and self.cuda:
                    returning.popleft().stored.synchronize()
                self._stage(chunks[i + 1])
            self._update(c, group)
            self._unstage(c)
            returning.append(c)
        # the host copies are read by the next step's staging (another stream) and by state_dict()
        for c in returning:
            if c.stored is not None:
                c.stored.synchronize()


def build_host_offload_adamw(params: list[nn.Parameter], *, lr: float, betas: tuple[float, float],
                             weight_decay: float) -> HostOffloadAdamW:
    """The actor/critic optimizer of `<role>.offload_optimizer: true` (same hyper-parameters as AdamW)."""
    return HostOffloadAdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
