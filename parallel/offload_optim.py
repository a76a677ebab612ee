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

Host layout: one flat buffer per parameter group, [m_0 | v_0 | m_1 | v_1 | ...], and a chunk is a
contiguous slice of it, so each chunk moves in one copy each way. The buffer is pinned with
cudaHostRegister at its exact size: torch's pinned allocator rounds every block up to a power of
two, which for 7B's 11008 x 4096 MLP shards would pin 1.5x the bytes.

On a CPU-only run the "device" is the host: the same staging copies run synchronously, which is
what the CPU tests exercise against torch.optim.AdamW.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from parallel.shard_adamw import ShardLocalAdamW, adamw_update
from parallel.shard_adamw import local as _local

DEFAULT_CHUNK_BYTES = 512 << 20  # moments (m and v) per staged chunk: about 1 GiB of device memory at most


def _pin(buf: torch.Tensor) -> bool:
    """Page-lock an existing host tensor for asynchronous copies (exact size, unlike pin_memory=True);
    it is unregistered when the tensor is freed. False (and a warning) when the driver refuses: the
    copies then still work, synchronously and slower."""
    import logging
    import weakref

    cudart = torch.cuda.cudart()
    nbytes = buf.numel() * buf.element_size()
    err = cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0)
    if int(err) != 0:
        logging.getLogger("hybridrl.offload_optim").warning(
            "cudaHostRegister of %.1f GiB of optimizer moments failed (%s): they stay in pageable host memory, "
            "so the optimizer step's copies are synchronous and slower; check the host's free memory and the "
            "locked-memory limit (ulimit -l)", nbytes / 2**30, err)
        return False
    weakref.finalize(buf, cudart.cudaHostUnregister, buf.data_ptr())
    return True


@dataclass(slots=True)
class _Slot:
    """Where one parameter's moments live in its group's flat host buffer."""

    start: int  # element offset of exp_avg; exp_avg_sq follows it
    numel: int


@dataclass(slots=True)
class _Chunk:
    """A contiguous run of a group's parameters whose moments travel in one copy each way."""

    start: int  # element range [start, end) of the flat host buffer
    end: int = 0
    params: list[torch.Tensor] = field(default_factory=list)  # those with gradients: local tensors, on the device
    grads: list[torch.Tensor] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # their exp_avg offsets relative to `start`
    steps: list[torch.Tensor] = field(default_factory=list)
    staged: torch.Tensor | None = None  # the device copy of the slice, while in flight
    loaded: object = None  # CUDA event: staging copy done
    stored: object = None  # CUDA event: moments back in host memory


class HostOffloadAdamW(ShardLocalAdamW):
    """torch.optim.AdamW with exp_avg / exp_avg_sq kept in (pinned) host memory between steps.

    params: as for AdamW (tensors or DTensors on one device, one dtype per parameter group).
    chunk_bytes: moments (both) per staged chunk. amsgrad, maximize, capturable, differentiable
    and foreach/fused choices are not offered: fused AdamW runs on CUDA, the single-tensor loop
    elsewhere (torch's own defaults). The state_dict has AdamW's layout ("step", "exp_avg",
    "exp_avg_sq" per parameter; the moments are views of the flat host buffer), so checkpoints and
    LR schedulers treat it as an AdamW.
    """

    states_on_host = True  # checkpoint loaders: hand the moments over as saved, never place them on the device

    def __init__(self, params, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        # torch's functional AdamW over each staged chunk (the Triton update reads its moments in place)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, kernel=False)
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be >= 1")
        self.chunk_bytes = chunk_bytes
        locals_ = [_local(p) for g in self.param_groups for p in g["params"]]
        devices = {t.device for t in locals_}
        if len(devices) != 1:
            raise ValueError(f"HostOffloadAdamW needs every parameter on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.cuda = self.device.type == "cuda"
        self._h2d = torch.cuda.Stream(self.device) if self.cuda else None
        self._d2h = torch.cuda.Stream(self.device) if self.cuda else None
        # flat host buffers, one per group, allocated (zeroed: AdamW's initial moments) at the first step
        self._flat: list[torch.Tensor | None] = [None] * len(self.param_groups)
        self._slots: dict[torch.Tensor, _Slot] = {}
        self.pinned = self.cuda  # every flat buffer page-locked (asynchronous copies)
        for g in self.param_groups:
            dtypes = {_local(p).dtype for p in g["params"]}
            if len(dtypes) > 1:
                raise ValueError(f"HostOffloadAdamW keeps one flat buffer per parameter group, which needs one dtype; "
                                 f"got {sorted(map(str, dtypes))}: split the parameters into groups by dtype")

    # ---- state ----
    def _flat_of(self, gi: int) -> torch.Tensor:
        if self._flat[gi] is None:
            params = self.param_groups[gi]["params"]
            start = 0
            for p in params:
                n = _local(p).numel()
                self._slots[p] = _Slot(start, n)
                start += 2 * n
            buf = torch.zeros(start, dtype=_local(params[0]).dtype)
            if self.cuda:
                self.pinned = _pin(buf) and self.pinned
            self._flat[gi] = buf
        return self._flat[gi]

    def _state_of(self, p: torch.Tensor, flat: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:  # as AdamW: created at the parameter's first gradient, moments zero
            slot, shape = self._slots[p], _local(p).shape
            # fused AdamW reads and bumps the step on the device; the single-tensor loop keeps it on the host
            state["step"] = torch.zeros((), dtype=torch.float32, device=self.device if self.cuda else "cpu")
            state["exp_avg"] = flat[slot.start:slot.start + slot.numel].view(shape)
            state["exp_avg_sq"] = flat[slot.start + slot.numel:slot.start + 2 * slot.numel].view(shape)
        return state

    def host_bytes(self) -> int:
        """Bytes of host memory holding moments."""
        return sum(f.numel() * f.element_size() for f in self._flat if f is not None)

    def load_state_dict(self, state_dict: dict) -> None:
        """AdamW's loader, except that the moments are copied into the flat host buffers, never to the
        device: torch's loader would cast them to each parameter's device (8 bytes/param of device memory)."""
        moments = {pid: {k: s[k] for k in ("exp_avg", "exp_avg_sq") if k in s}
                   for pid, s in state_dict["state"].items()}
        rest = {pid: {k: v for k, v in s.items() if k not in ("exp_avg", "exp_avg_sq")}
                for pid, s in state_dict["state"].items()}
        super().load_state_dict({"state": rest, "param_groups": state_dict["param_groups"]})
        self.state.clear()  # rebuilt below on the flat buffers
        for gi, (saved, group) in enumerate(zip(state_dict["param_groups"], self.param_groups)):
            flat = self._flat_of(gi)
            for pid, p in zip(saved["params"], group["params"]):
                if pid not in moments:
                    continue
                state = self._state_of(p, flat)
                state["step"].copy_(rest[pid]["step"])
                for k, v in moments[pid].items():
                    state[k].copy_(_local(v))

    # ---- the step (ShardLocalAdamW.step calls _step_group per group) ----
    def _chunks(self, gi: int, group: dict) -> list[_Chunk]:
        flat = self._flat_of(gi)
        chunks: list[_Chunk] = []
        for p in group["params"]:
            if p.grad is None:  # as AdamW: no gradient, no state and no step (its slot stays zero)
                continue
            if p.grad.is_sparse:
                raise RuntimeError("HostOffloadAdamW does not support sparse gradients")
            state, slot = self._state_of(p, flat), self._slots[p]
            c = chunks[-1] if chunks else None
            if c is None or (c.end - c.start) * flat.element_size() >= self.chunk_bytes:
                c = _Chunk(start=slot.start)
                chunks.append(c)
            c.params.append(_local(p))
            c.grads.append(_local(p.grad))
            c.offsets.append(slot.start - c.start)
            c.steps.append(state["step"])
            c.end = slot.start + 2 * slot.numel
        return chunks

    def _stage(self, c: _Chunk, flat: torch.Tensor) -> None:
        """The chunk's slice of moments to the device (on the host->device stream)."""
        # allocated on the compute stream, where it is used; the copy stream waits for that point
        c.staged = torch.empty(c.end - c.start, dtype=flat.dtype, device=self.device)
        if not self.cuda:
            c.staged.copy_(flat[c.start:c.end])
            return
        self._h2d.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._h2d):
            c.staged.copy_(flat[c.start:c.end], non_blocking=True)
            c.loaded = torch.cuda.Event()
            c.loaded.record(self._h2d)

    def _update(self, c: _Chunk, group: dict) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(c.loaded)
        ms, vs = [], []
        for p, off in zip(c.params, c.offsets):
            n = p.numel()
            ms.append(c.staged[off:off + n].view(p.shape))
            vs.append(c.staged[off + n:off + 2 * n].view(p.shape))
        adamw_update(c.params, c.grads, ms, vs, c.steps, group)

    def _unstage(self, c: _Chunk, flat: torch.Tensor) -> None:
        """Updated moments back to host memory (on the device->host stream); the staging is released."""
        if not self.cuda:
            flat[c.start:c.end].copy_(c.staged)
            c.staged = None
            return
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h):
            flat[c.start:c.end].copy_(c.staged, non_blocking=True)
            c.staged.record_stream(self._d2h)  # the allocator may reuse the block only after this copy
            c.stored = torch.cuda.Event()
            c.stored.record(self._d2h)
        c.staged = None

    def _step_group(self, gi: int, group: dict, grad_scale: float) -> None:
        chunks = self._chunks(gi, group)
        if grad_scale != 1.0:  # the clip coefficient, in place on the gradients (local shards)
            torch._foreach_mul_([g for c in chunks for g in c.grads], grad_scale)
        flat = self._flat[gi]
        returning: deque[_Chunk] = deque()
        if chunks:
            self._stage(chunks[0], flat)
        for i, c in enumerate(chunks):
            if i + 1 < len(chunks):
                # bound device memory to chunks i and i+1: chunk i-1's moments are home before i+1 is staged
                # (its copy ran beside chunk i's; i+1's host->device copy then runs beside i's device->host)
                while returning and self.cuda:
                    returning.popleft().stored.synchronize()
                self._stage(chunks[i + 1], flat)
            self._update(c, group)
            self._unstage(c, flat)
            returning.append(c)
        # the host copies are read by the next step's staging (another stream) and by state_dict()
        for c in returning:
            if c.stored is not None:
                c.stored.synchronize()
