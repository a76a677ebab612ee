"""The only part of the engine that touches the device: the local-TP model (rollout/local_model.py),
KV cache, prefill (rollout/prefill_runner.py), graphed decode (rollout/decode_graphs.py).

Decode rows (token, position, RNG key, sampling params, active flag) live on the device, one per KV
slot; a step reads rows [0, B) and advances them in place, so consecutive steps need no host input and
the engine can enqueue step k+1 before reading step k's tokens. Each step runs as one CUDA graph per
(batch bucket, KV-length bucket, filtered-sampling, shared-prompt tile width) key, captured lazily into
one shared pool (and optionally torch.compile'd once, dynamic in B and KV length); results come back in
one async D2H copy.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch
import torch._dynamo
import torch.distributed as dist

from models.config import ModelConfig
from models.llama import rotary_cos_sin
from models.lora import LoRASpec
from models.moe import RouterTrace
from rollout import triton_sampling
from rollout.base import RolloutConfig
from rollout.continuation_graphs import ContinuationGraphs
from rollout.decode_graphs import DecodeGraphsMixin
from rollout.engine_lora import EngineAdapters
from rollout.kv_cache import (
    FP8,
    DecodeAttention,
    KVCache,
    decode_kernels,
    fastest_decode_kernel,
    kv_bytes_per_token,
)
from rollout.local_model import build_local_model, fuse_projections
from rollout.prefill_runner import PrefillMixin
from rollout.sampler import sample, uniform_from_counter
from rollout.shared_prefix import member_widths, members_for, members_per_entry, shared_prefix_tables, table_entries

log = logging.getLogger(__name__)


class _DynamicRows:
    """Calls a compiled function with every dim of its tensor arguments marked dynamic (decode: rows B and
    KV length; prefill: prompt rows and padded length) and without duck sizing (B == kv_len on the first
    call must not become a guard), so new shapes never recompile. If compilation fails the engine keeps
    working eagerly (CUDA graphs still apply) and says so loudly."""

    def __init__(self, compiled, eager):
        self.fn, self.eager, self.error = compiled, eager, None

    def __call__(self, *args):
        if self.error is not None:
            return self.eager(*args)
        for a in args:
            if isinstance(a, torch.Tensor):
                for dim in range(a.dim()):
                    torch._dynamo.maybe_mark_dynamic(a, dim)
        try:
            with torch.fx.experimental._config.patch(use_duck_shape=False):
                return self.fn(*args)
        except Exception as e:  # noqa: BLE001 - a compiler failure must not stop generation
            self.error = f"{type(e).__name__}: {e}"[:500]
            log.warning("torch.compile of %s failed; running eagerly: %s", self.eager.__name__, self.error)
            return self.eager(*args)


class EngineModelRunner(PrefillMixin, DecodeGraphsMixin):
    def __init__(self, cfg: ModelConfig, *, config: RolloutConfig, tp_group=None, device="cpu",
                 dtype=torch.float32, lora: LoRASpec | None = None):
        """lora: LoRA adapters applied inside the GEMMs (rollout/engine_lora.py), loaded by their HF names
        ("<module>.lora_A" / ".lora_B") beside the base weights; None: plain weights only."""
        self.cfg, self.config, self.dtype = cfg, config, dtype
        self.kv_dtype = FP8 if config.kv_cache_dtype == "fp8" else dtype  # rollout/kv_cache.py: the fp8 layout
        self.device = torch.device(device)
        self.tp_group = tp_group
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self.model = build_local_model(cfg, tp=self.tp, tp_rank=self.tp_rank, tp_group=tp_group,
                                       device=self.device, dtype=dtype)
        self.fused = fuse_projections(self.model, device=self.device, dtype=dtype, fold_norms=config.fold_norms) \
            if config.fuse_projections else []
        self.fused_of = {id(p): g for g in self.fused for p in g.members}
        self.adapters = EngineAdapters(self.model, lora, device=self.device, dtype=dtype) if lora else None
        # a mixture of experts: each step records the experts of every token it runs (Completion.routed_experts)
        self.moe_layers = cfg.moe_layers if cfg.is_moe else []
        self.params = dict(self.model.named_parameters(remove_duplicate=False))
        self.name_of = {id(p): n for n, p in self.params.items()}
        # rollout.fold_norms: norm weights folded into projections (rollout/folded_norms.py); what was loaded
        # since the last fold: projections not yet scaled, and norm weights
        self.folded_norms = {id(g.norm) for g in self.fused if g.norm is not None}
        self.unfolded: set[int] = set()
        self.norms_loaded: set[int] = set()
        self.shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        self.loaded: set[int] = set()  # ids of parameters loaded since the last allocation
        self.shared: set[int] = set()  # ids of parameters aliasing a caller's tensor (from_model)
        self.use_graphs = config.enable_cuda_graph and self.device.type == "cuda"
        self.ungraphed_steps = 0  # CUDA decode steps launched kernel by kernel (no graph of their shape or none may be)
        # False while decoding runs beside training (rollout/beside.py): a capture there could meet the trainer's
        # allocator freeing cached blocks, which no capture may see; shapes without a graph then replay one of more rows
        self.may_capture = True
        self.graph_error: str | None = None
        # the last prefill's forwards by kind (fresh rows from position 0; continuations onto kept KV): device
        # seconds (CUDA events; host seconds on a CPU) and rows (NativeEngine.stats sums them)
        self.last_prefill: dict[str, float] = {}
        self.kernel_for: dict[tuple[int, int], str] = {}  # (rows, kv_len) -> decode attention kernel ("auto")
        self._kernel = "sdpa"
        # rows per shared-prompt table entry (0: off); see rollout/shared_prefix.py
        self.prefix_members = members_per_entry(cfg.num_attention_heads // cfg.num_key_value_heads) \
            if config.share_prompt_kv else 0
        self._prefix_groups: list | None = None  # what the device tables hold now
        # the tables' members in use now (shared_prefix.members_for); 0 while no rows share a prompt: the decode
        # then runs the unshared kernel (no idle prompt programs, and its own tile)
        self._prefix_width = 0
        self._widths_written: set[int] = set()  # the widths whose member tables hold _prefix_groups
        self._decode, self._prefill, self._continue = self._decode_fn, self._prefill_fn, self._continue_fn
        # what a continuation graph captures (rollout/continuation_graphs.py): the trunk to the rows' last hidden states
        self._continue_trunk = self._continue_hidden
        if config.compile:
            # one graph, dynamic in rows and KV length (marked per call); a bigger cache limit so a
            # surprise recompile never silently falls back to eager
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self._decode = _DynamicRows(torch.compile(self._decode_fn), self._decode_fn)
            self._prefill = _DynamicRows(torch.compile(self._prefill_fn), self._prefill_fn)
            self._continue = _DynamicRows(torch.compile(self._continue_fn), self._continue_fn)
            # compiled too before its capture: an eager trunk is ~550 unfused kernels per wave, which the graph
            # replays without host cost but not without device cost (~15 ms a wave on an H100, against ~1.5 ms of
            # GEMMs: bench.agent_turns --profile)
            self._continue_trunk = _DynamicRows(torch.compile(self._continue_hidden), self._continue_hidden)
        self.cache: KVCache | None = None
        self._allocate_runtime()

    # ---- memory ----
    def _num_slots(self, slot_len: int) -> tuple[int, int]:
        """(decode slots, park slots) the KV cache holds: max_num_seqs and max_parked_seqs, as memory allows."""
        per_tok = kv_bytes_per_token(num_layers=self.cfg.num_hidden_layers, head_dim=self.cfg.head_dim,
                                     num_kv_heads=self.cfg.num_key_value_heads // self.tp, dtype=self.kv_dtype)
        if self.config.kv_cache_tokens is not None:
            tokens = self.config.kv_cache_tokens
        elif self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            # blocks this process's caching allocator holds unused (e.g. the last update's activations) are
            # free for the cache too: on a failed cudaMalloc the allocator releases them and retries
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            # weights dropped at sleep come back with the next load_weights, after this allocation: keep their room
            # (a conservative count: a weight later aliased with share=True takes none)
            free = max(0, free - self.absent_weight_bytes())
            tokens = int(free * self.config.gpu_memory_fraction) // per_tok
            if self.tp > 1:  # every rank must agree on the slot count (same schedule, same collectives)
                t = torch.tensor([tokens], device=self.device)
                dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp_group)
                tokens = int(t.item())
        else:
            # CPU: as many slots as sequences allowed
            tokens = (self.config.max_num_seqs + self.config.max_parked_seqs) * slot_len
        slots = min(self.config.max_num_seqs, tokens // slot_len)
        if slots < 1:
            raise RuntimeError(f"KV cache of {tokens} tokens ({tokens * per_tok / 2**30:.2f} GiB) holds no slot of "
                               f"max_model_len={self.config.max_model_len}; raise gpu_memory_fraction / "
                               f"kv_cache_tokens or lower max_model_len")
        return slots, min(self.config.max_parked_seqs, tokens // slot_len - slots)

    def _dynamic_slots(self, t: torch.Tensor, dim: int) -> None:
        if self.config.compile and t.numel():
            torch._dynamo.maybe_mark_dynamic(t, dim)

    def absent_weight_bytes(self) -> int:
        """Bytes of the engine's weights that are not on the device now (dropped by sleep, or never loaded)."""
        item = torch.empty(0, dtype=self.dtype).element_size()
        return sum(math.prod(self.shapes[n]) * item for n, p in self.params.items() if p.numel() == 0)

    def _allocate_runtime(self) -> None:
        slot_len = self.config.max_model_len
        slots, self.park_slots = self._num_slots(slot_len)
        self.cache = KVCache(num_layers=self.cfg.num_hidden_layers, num_slots=slots + self.park_slots,
                             slot_len=slot_len,
                             num_kv_heads=self.cfg.num_key_value_heads // self.tp, head_dim=self.cfg.head_dim,
                             dtype=self.kv_dtype, device=self.device)
        self.num_slots = slots  # decode rows: slots [0, slots); park slots follow them in the cache
        # the slot count follows the memory free at each wake-up (the first step's is larger: no optimizer state
        # yet), so the compiled graphs take it as a dynamic dim: a re-sized cache must not recompile them
        self._dynamic_slots(self.cache.data, 2)
        self._dynamic_slots(self.cache.scales, 2)
        # static decode rows per slot: token, position, key, top_k, active (int64) / temperature, top_p (fp32)
        self.meta_i = torch.zeros(5, slots, dtype=torch.int64, device=self.device)
        self.meta_f = torch.ones(2, slots, dtype=torch.float32, device=self.device)
        self.out = torch.zeros(2 * slots, dtype=torch.float64, device=self.device)
        self.kv_index = torch.arange(slot_len, device=self.device)
        if self.prefix_members:  # static device tables of the decode rows that share a prompt's KV
            entries = table_entries(slots)
            self.row_prefix = torch.zeros(slots, dtype=torch.int32, device=self.device)
            self.row_entry = torch.full((slots,), -1, dtype=torch.int32, device=self.device)
            # one members table per width members_for can pick (powers of two up to the cap), each contiguous: the
            # decode takes a row slice of one as an argument, so a new width is a new size of a dynamic dim (and
            # of the Triton tile), never a recompile of the compiled decode (a width read from `self` was a guard)
            self.prefix_tables = {w: torch.full((entries, w), -1, dtype=torch.int32, device=self.device)
                                  for w in member_widths(self.prefix_members)}
            self.prefix_len = torch.zeros(entries, dtype=torch.int32, device=self.device)
            # the decode kernel's arrival counters per (entry, KV head): zero, and left zero by every launch
            self.prefix_counts = torch.zeros(entries, self.cfg.num_key_value_heads // self.tp, dtype=torch.int32,
                                             device=self.device)
            self._prefix_groups, self._prefix_width = [], 0
        self.u_table = torch.full((slots + 1, slot_len + 1), 0.5, dtype=torch.float32, device=self.device)
        # two host buffers: step k's result is read while step k+1 (launched before) runs
        pin = self.device.type == "cuda"
        self._host_out = [torch.zeros(2 * slots, dtype=torch.float64, pin_memory=pin) for _ in range(2)]
        if self.moe_layers:  # each decode row's experts [L_moe, k], written by the (graphed) step, copied out
            shape = (slots, len(self.moe_layers), self.cfg.num_experts_per_tok)
            self.routes_out = torch.zeros(shape, dtype=torch.int16, device=self.device)
            self._dynamic_slots(self.routes_out, 0)
            self._host_routes = [torch.zeros(shape, dtype=torch.int16, pin_memory=pin) for _ in range(2)]
        self._flip = 0
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.graph_pool = None
        self._capture_stream = torch.cuda.Stream(self.device) if self.use_graphs else None
        # kept-KV continuation waves replay graphs of their bucket (a mixture of experts runs them un-graphed: its
        # experts per token would need a static buffer per bucket)
        self.continuations = ContinuationGraphs(
            self._continue_trunk, device=self.device, spare_slot=self.cache.num_slots, slot_len=slot_len,
            stream=self._capture_stream, pool=self._graph_pool) if self.use_graphs and not self.moe_layers else None

    @property
    def slot_len(self) -> int:
        return self.cache.slot_len

    def free_runtime(self, *, drop_weights: bool) -> None:
        self._drop_graphs()
        self.continuations = None
        self.cache = self.meta_i = self.meta_f = self.out = self._host_out = self.u_table = None
        self.routes_out = self._host_routes = None
        self.row_prefix = self.row_entry = self.prefix_tables = self.prefix_len = self.prefix_counts = None
        self._prefix_groups = None
        if drop_weights:
            for p in self.params.values():
                p.data = torch.empty(0, dtype=self.dtype, device=self.device)
            for g in self.fused:
                g.drop(device=self.device, dtype=self.dtype)
            self.loaded.clear()
            self.shared.clear()
            self.unfolded.clear()
            self.norms_loaded.clear()

    def wake(self) -> None:
        """Re-allocate the KV cache and decode buffers; dropped weights come back with load_weights."""
        self._allocate_runtime()

    # ---- weights ----
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, share: bool = False) -> None:
        """Copy (or alias, when `share` and device/dtype match) HF-named local shards into the model."""
        changed = False  # new storage under a parameter invalidates the captured graphs' pointers
        for name, t in named_tensors:
            if self.adapters is not None and name in self.adapters:  # static buffers, written in place
                self.adapters.load(name, t.detach())
                continue
            p = self.params.get(name)
            if p is None:
                if name.endswith("inv_freq"):
                    continue
                raise KeyError(f"rollout engine has no parameter {name!r} (expected HF names such as "
                               f"'model.layers.0.self_attn.q_proj.weight')")
            if tuple(t.shape) != self.shapes[name]:
                raise ValueError(f"{name}: got shape {tuple(t.shape)}, this rank's tp({self.tp}) shard is "
                                 f"{self.shapes[name]}; pass parallel/sharding.tp_slices(name, full_shape, "
                                 f"rank={self.tp_rank}, world={self.tp}) of the full tensor")
            group = self.fused_of.get(id(p))
            with torch.no_grad():
                if group is not None:  # a view of a fused GEMM weight: always copied, never aliased
                    if p.numel() == 0:
                        group.bind(device=self.device, dtype=self.dtype)
                        changed = True
                    p.data.copy_(t.detach())
                elif share and t.device == self.device and t.dtype == self.dtype:
                    if p.data_ptr() != t.data_ptr():
                        p.data, changed = t.detach(), True
                    self.shared.add(id(p))
                elif p.numel() == 0 or id(p) in self.shared:
                    # own storage again (never write through an alias into the trainer's weights)
                    p.data, changed = t.detach().to(device=self.device, dtype=self.dtype, copy=True), True
                    self.shared.discard(id(p))
                else:
                    p.data.copy_(t.detach())
            self.loaded.add(id(p))
            if group is not None and group.norm is not None:
                self.unfolded.add(id(p))
            if id(p) in self.folded_norms:
                self.norms_loaded.add(id(p))
        if changed:
            self._drop_graphs()

    def holds_weights(self) -> bool:
        """Whether every base weight is loaded now (kept across sleep with rollout drop_weights_on_sleep=False)."""
        return all(id(p) in self.loaded for p in self.params.values())

    def finish_loading(self) -> None:
        """Before a generate: every weight must have been loaded since wake_up/creation; the norm weights are
        folded into the projections loaded since the last call (rollout.fold_norms), in place."""
        missing = [n for n, p in self.params.items() if id(p) not in self.loaded]
        if missing:
            raise RuntimeError(f"{len(missing)} weights not loaded since wake_up/creation (e.g. {missing[:3]}); "
                               f"call update_weights with every parameter before generate")
        if self.adapters is not None:
            self.adapters.finish(self.fused)
        if not self.unfolded and not self.norms_loaded:
            return
        with torch.no_grad():
            for g in self.fused:
                if g.norm is None:
                    continue
                fresh = [p for p in g.members if id(p) in self.unfolded]
                if id(g.norm) in self.norms_loaded and len(fresh) < len(g.members):
                    stale = [self.name_of[id(p)] for p in g.members if id(p) not in self.unfolded]
                    raise RuntimeError(f"{self.name_of[id(g.norm)]} was updated without {stale}, which hold it "
                                       f"folded in (rollout.fold_norms): update them together, or set "
                                       f"rollout.fold_norms=false")
                g.fold(fresh)
        self.unfolded.clear()
        self.norms_loaded.clear()

    # ---- compute ----
    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, H] final-normed -> logits [N, V] over the full vocabulary (all-gathered under TP)."""
        local = self.model.lm_head(h)
        if self.tp == 1:
            return local
        n, vl = local.shape
        if self.device.type == "cuda":
            full = torch.empty(self.tp * n, vl, dtype=local.dtype, device=local.device)
            dist.all_gather_into_tensor(full, local.contiguous(), group=self.tp_group)
            parts = full.view(self.tp, n, vl).unbind(0)
        else:
            parts = [torch.empty_like(local) for _ in range(self.tp)]
            dist.all_gather(parts, local.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def _routes(self, trace: RouterTrace | None, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The experts a forward's MoE layers chose, [*shape, L_moe, k] int16 (None for a dense model)."""
        if trace is None:
            return None
        return torch.stack([trace.chosen[layer] for layer in self.moe_layers], dim=1).to(torch.int16).view(
            *shape, len(self.moe_layers), -1)

    # ---- decode: device-resident rows, advanced inside the graph ----
    def set_rows(self, rows: dict[int, tuple[tuple[int, ...], tuple[float, float]]]) -> None:
        """Overwrite decode rows: slot -> ((token, position, key, top_k, active), (temperature, top_p))."""
        if not rows:
            return
        slots = list(rows)
        # one pinned, asynchronous upload per dtype: a copy from pageable memory would wait for the decode step
        # already enqueued (CUDA syncs the stream first), draining the one-step-ahead pipeline at every change
        ints = self._upload(torch.tensor([(s, *rows[s][0]) for s in slots], dtype=torch.int64))
        idx = ints[:, 0]
        self.meta_i[:, idx] = ints[:, 1:].T
        self.meta_f[:, idx] = self._upload(torch.tensor([rows[s][1] for s in slots], dtype=torch.float32)).T
        # the row's uniforms for every position, once per (re)assignment: ~40 tiny hash kernels per decode
        # step become one gather
        positions = torch.arange(self.u_table.shape[1], device=self.device)
        self.u_table[idx] = uniform_from_counter(self.meta_i[2, idx][:, None], positions[None, :])

    def set_shared_prompts(self, groups: list[tuple[int, list[int]]]) -> None:
        """(prompt length, slots) of the decode rows whose prompt KV is identical (Scheduler.shared_prompts);
        the next decode launches read each group's prompt once. Stream-ordered: a decode step already
        enqueued keeps reading the tables it was launched with."""
        if not self.prefix_members or groups == self._prefix_groups:
            return
        if not groups:  # the unshared kernel from now on: the device tables are not read
            self._prefix_groups, self._prefix_width = groups, 0
            return
        width = members_for(groups, cap=self.prefix_members)
        row_prefix, row_entry, members, group_len = shared_prefix_tables(groups, rows=self.num_slots,
                                                                         members_per_entry=width)
        for dst, src in zip((self.row_prefix, self.row_entry, self.prefix_tables[width], self.prefix_len),
                            (row_prefix, row_entry, members, group_len), strict=True):
            self._upload(src, into=dst)
        self._prefix_groups, self._prefix_width, self._widths_written = groups, width, {width}

    def _write_members(self, width: int) -> None:
        """The current groups' member table at a wider `width` too (a graph captured at that width reads it): no
        group splits below the width members_for chose, so the row and entry tables are the same at any wider one."""
        if width not in self._widths_written:
            _, _, members, _ = shared_prefix_tables(self._prefix_groups, rows=self.num_slots, members_per_entry=width)
            self._upload(members, into=self.prefix_tables[width])
            self._widths_written.add(width)

    def _upload(self, host: torch.Tensor, *, into: torch.Tensor | None = None) -> torch.Tensor:
        """A host tensor on the device (a new tensor, or copied into `into`) without a host sync: through
        pinned memory, asynchronously, on CUDA (torch's pinned-memory cache keeps the staging block until the
        copy is done)."""
        pin = self.device.type == "cuda"
        src = host.pin_memory() if pin else host
        if into is None:
            return src.to(self.device, non_blocking=pin)
        return into.copy_(src, non_blocking=pin)

    def _decode_fn(self, ids: torch.Tensor, pos: torch.Tensor, kv_index: torch.Tensor,
                   *prefix: torch.Tensor) -> torch.Tensor:
        """Forward of one token per row [B] -> logits [B, V]; what torch.compile sees (sampling stays out:
        Inductor's Triton backend cannot split the vocab-long cumsum, "NYI TritonSplitDimKernel"). prefix: the
        rows' shared-prompt tables (_prefix_args), or none: arguments, so their sizes are dynamic dims."""
        return self.decode_forward(ids, pos, kv_index, self.cache.data, prefix=prefix or None, mode=self._kernel,
                                   scales=self.cache.scales)

    def _prefix_args(self, b: int) -> tuple[torch.Tensor, ...]:
        """The shared-prompt tables a decode over rows [0, b) reads (row_prefix, row_entry, members, group_len,
        counts), views of the static tables; () without shared prompts or off the Triton kernel."""
        if self._kernel != "triton" or not self._prefix_width:
            return ()
        # entries fill from 0: at most b // 2 are used; at least 2 (unused ones have length 0), since a dim of
        # size 1 would be specialised by Dynamo: a recompile when the last rows share one prompt
        entries = min(max(2, (b + 1) // 2), self.prefix_len.shape[0])
        return (self.row_prefix[:b], self.row_entry[:b], self.prefix_tables[self._prefix_width][:entries],
                self.prefix_len[:entries], self.prefix_counts[:entries])

    def decode_forward(self, ids: torch.Tensor, pos: torch.Tensor, kv_index: torch.Tensor, cache: torch.Tensor, *,
                       prefix: tuple[torch.Tensor, ...] | None, mode: str,
                       scales: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, V] of one token per row of `cache` (the engine's cache, or a view of some of its slots)
        with decode kernel `mode` and the rows' shared-prompt tables `prefix` (triton only); `scales`: an fp8
        cache's row scales (the same view of KVCache.scales)."""
        rope = None
        if mode == "triton":  # the kernel applies RoPE: the model's own cos/sin at each row's position
            cos, sin = rotary_cos_sin(self.model.model.inv_freq, pos[:, None], self.dtype)  # [B, 1, 1, D]
            rope = (cos[:, 0, 0], sin[:, 0, 0])
        attn = DecodeAttention(cache, positions=pos, kv_index=kv_index, mode=mode, rope=rope, prefix=prefix,
                               scales=scales)
        if not self.moe_layers:
            return self._logits(self.model.hidden_states(ids[:, None], pos[:, None], attn=attn)[:, 0])
        trace = RouterTrace(keep_choice=True)  # the rows' experts into the static buffer the step copies out
        h = self.model.hidden_states(ids[:, None], pos[:, None], attn=attn, routing=trace)
        self.routes_out[: ids.shape[0]].copy_(self._routes(trace, (ids.shape[0],)))
        return self._logits(h[:, 0])

    def _decode_step(self, b: int, kv_len: int, filtered: bool) -> None:
        """One graph-capturable decode over cache rows [0, b): reads the static rows, writes self.out[:2b]
        (tokens then logprobs), then advances every active row in place (token <- sampled, position += 1)."""
        ids, pos, active = self.meta_i[0, :b], self.meta_i[1, :b], self.meta_i[4, :b]
        self._kernel = self._pick_kernel(b, kv_len)
        logits = self._decode(ids, pos, self.kv_index[:kv_len], *self._prefix_args(b))
        if not filtered and self.device.type == "cuda" and triton_sampling.available(self.device):
            # the draw and the rows' advance below as one Triton kernel (~12 kernels and their launch gaps per
            # step otherwise): same draws as sample() up to CDF-boundary rounding; CPU keeps sample()
            triton_sampling.decode_tail(logits, self.meta_i, self.meta_f[0], self.u_table, self.out,
                                        max_position=self.cache.slot_len - 1)
            return
        u = self.u_table[:b].gather(1, (pos + 1)[:, None])[:, 0]  # the uniform of the new token's position
        tok, lp = sample(logits, temperature=self.meta_f[0, :b], top_p=self.meta_f[1, :b],
                         top_k=self.meta_i[3, :b], uniforms=u, filtered=filtered)
        self.out[:b].copy_(tok)
        self.out[b: 2 * b].copy_(lp)
        # clamp: a row that finished on the step before runs once more (pipelining) and must stay in its slot
        next_pos = torch.clamp(pos + active, max=self.cache.slot_len - 1)
        ids.copy_(torch.where(active > 0, tok, torch.zeros_like(tok)))
        pos.copy_(next_pos)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _pick_kernel(self, b: int, kv_len: int) -> str:
        """The decode attention kernel for rows [0, b) over kv_len positions (timed once per shape)."""
        mode = self.config.decode_attention
        if mode != "auto":
            return mode
        if self.device.type != "cuda":
            return "sdpa"
        if self.config.compile:  # one traced kernel, no retracing: the Triton kernel when there is one
            return "triton" if "triton" in decode_kernels(self.device, self.cfg.head_dim) else "sdpa"
        if (b, kv_len) not in self.kernel_for:
            if not self.may_capture:  # beside training: no timing (it syncs the device); timed when alone
                return "sdpa"
            self.kernel_for[(b, kv_len)] = self._time_kernels(b, kv_len)
        return self.kernel_for[(b, kv_len)]

    def _time_kernels(self, b: int, kv_len: int) -> str:
        best, times = fastest_decode_kernel(self.cache, rows=b, kv_index=self.kv_index[:kv_len],
                                            num_heads=self.cfg.num_attention_heads // self.tp, sync=self._sync)
        log.info("decode attention B=%d kv=%d: %s (ms: %s)", b, kv_len, best, times)
        return best

    def move_slots(self, moves: list[tuple[int, int]], *, lengths: list[int]) -> None:
        with torch.inference_mode():
            self.cache.move_slots(moves, lengths=lengths)
