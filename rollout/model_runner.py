"""The only part of the engine that touches the device: local-TP model, KV cache, prefill, graphed decode.

The model is a plain-tensor LlamaForCausalLM built with LOCAL sizes (heads, intermediate and vocab
divided by tp) and made tensor-parallel with explicit collectives on `tp_group`: all-reduce after
o_proj and down_proj (row parallel), a vocab-parallel embedding, and an all-gather of the local-vocab
logits so every rank samples the same token from the full [B, V] (no DTensor: too slow and not
graph-capturable). Weights arrive by Hugging Face name as this rank's shard (parallel/sharding.py).

The engine's copy also runs q/k/v and gate/up as one GEMM each (FusedQKVAttention/FusedGateUpMLP,
the HF-named parameters being views of the fused weight), reusing llama.py's RoPE.

Decode rows (token, position, RNG key, sampling params, active flag) live on the device, one per KV
slot; a step reads rows [0, B) and advances them in place, so consecutive steps need no host input and
the engine can enqueue step k+1 before reading step k's tokens. Each step runs as one CUDA graph per
(batch bucket, KV-length bucket, filtered-sampling) key, captured lazily into one shared pool (and
optionally torch.compile'd once, dynamic in B and KV length); results come back in one async D2H copy.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.llama import MLP, Attention, LlamaForCausalLM, RMSNorm, apply_rotary, compute_inv_freq
from rollout import triton_sampling
from rollout.base import RolloutConfig
from rollout.kv_cache import (
    DecodeAttention,
    KVCache,
    PrefillAttention,
    decode_kernels,
    fastest_decode_kernel,
    kv_bytes_per_token,
)
from rollout.sampler import sample, uniform_from_counter
from rollout.scheduler import PrefillBatch, Sequence

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DecodeHandle:
    buf: torch.Tensor  # host [2 * slots] float64: tokens [:num_rows], then logprobs
    num_rows: int
    event: object | None  # torch.cuda.Event on CUDA


def any_filtered(seqs: list[Sequence]) -> bool:
    """Whether any sampled (T > 0) row needs the sorted top-k/top-p path."""
    return any(s.params.temperature > 0 and (s.params.top_k > 0 or s.params.top_p < 1) for s in seqs)


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
            log.warning("torch.compile of the decode step failed; running eagerly: %s", self.error)
            return self.eager(*args)


class RowParallelLinear(nn.Linear):
    """Linear over this rank's slice of the input features; partial sums all-reduced over the TP group."""

    def __init__(self, in_features: int, out_features: int, *, group):
        super().__init__(in_features, out_features, bias=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + num_embeddings) of the table; other ids give 0, summed over TP."""

    def __init__(self, num_embeddings: int, dim: int, *, vocab_start: int, group):
        super().__init__(num_embeddings, dim)
        self.vocab_start, self.group = vocab_start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        dist.all_reduce(out, group=self.group)
        return out


class FusedQKVAttention(Attention):
    """models/llama.py's Attention with q/k/v as ONE GEMM: q_proj/k_proj/v_proj weights are views of
    `qkv_weight`, so HF-named loading fills it (bigger GEMMs run closer to peak at decode batch sizes)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        b, t, _ = x.shape
        nq, nk, _ = self.qkv_split
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        # q and k are adjacent in the fused output: one RoPE over both heads (half the small kernels)
        qk = apply_rotary(qkv[..., : nq + nk].view(b, t, -1, self.head_dim).transpose(1, 2), cos, sin)
        hq = nq // self.head_dim
        v = qkv[..., nq + nk:].view(b, t, -1, self.head_dim).transpose(1, 2)
        out = attn(self.layer_idx, qk[:, :hq], qk[:, hq:], v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class FusedRMSNorm(RMSNorm):
    """llama.py's RMSNorm (fp32 normalise, scale in the input dtype) through F.rms_norm: same formula,
    fewer kernels per norm in the eager/graphed decode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class FusedGateUpMLP(MLP):
    """models/llama.py's MLP with gate/up as one GEMM over `gate_up_weight` (views, as above)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


@dataclass(slots=True)
class FusedGroup:
    module: nn.Module
    attr: str  # the module attribute holding the fused tensor
    members: list[nn.Parameter]  # views of it, concatenated along dim 0
    shapes: list[tuple[int, ...]]

    def bind(self, *, device, dtype) -> None:
        """(Re)allocate the fused tensor and point every member parameter at its slice."""
        fused = torch.empty(sum(s[0] for s in self.shapes), *self.shapes[0][1:], device=device, dtype=dtype)
        start = 0
        for p, shape in zip(self.members, self.shapes):
            p.data = fused[start: start + shape[0]]
            start += shape[0]
        setattr(self.module, self.attr, fused)

    def drop(self, *, device, dtype) -> None:
        for p in self.members:
            p.data = torch.empty(0, device=device, dtype=dtype)
        setattr(self.module, self.attr, None)


def fuse_projections(model: LlamaForCausalLM, *, device, dtype) -> list[FusedGroup]:
    """Swap norms, attention and MLPs to the fused variants; returns the weight groups to (re)bind on load."""
    groups = []
    for mod in model.modules():
        if type(mod) is RMSNorm:
            mod.__class__ = FusedRMSNorm
    for layer in model.model.layers.values():
        a, m = layer.self_attn, layer.mlp
        projs = (a.q_proj, a.k_proj, a.v_proj)
        a.__class__, m.__class__ = FusedQKVAttention, FusedGateUpMLP
        a.qkv_split = [lin.out_features for lin in projs]
        a.qkv_bias = None
        members = [(a, "qkv_weight", [lin.weight for lin in projs]),
                   (m, "gate_up_weight", [m.gate_proj.weight, m.up_proj.weight])]
        if projs[0].bias is not None:
            members.append((a, "qkv_bias", [lin.bias for lin in projs]))
        for mod, attr, params in members:
            group = FusedGroup(mod, attr, params, [tuple(p.shape) for p in params])
            group.bind(device=device, dtype=dtype)
            groups.append(group)
    return groups


def build_local_model(cfg: ModelConfig, *, tp: int, tp_rank: int, tp_group, device, dtype) -> LlamaForCausalLM:
    """LlamaForCausalLM holding rank tp_rank's shards (uninitialised weights; load them by name)."""
    for name, size in (("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads",
                       cfg.num_key_value_heads), ("intermediate_size", cfg.intermediate_size),
                       ("vocab_size", cfg.vocab_size)):
        if size % tp:
            raise ValueError(f"rollout tp({tp}) must divide {name}({size})")
    local = dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp,
                                num_key_value_heads=cfg.num_key_value_heads // tp,
                                intermediate_size=cfg.intermediate_size // tp,
                                vocab_size=cfg.vocab_size // tp, head_dim=cfg.head_dim)
    with torch.device("meta"):
        model = LlamaForCausalLM(local)
        if tp > 1:
            for layer in model.model.layers.values():
                layer.self_attn.o_proj = RowParallelLinear(local.num_attention_heads * cfg.head_dim,
                                                           cfg.hidden_size, group=tp_group)
                layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, cfg.hidden_size, group=tp_group)
            model.model.embed_tokens = VocabParallelEmbedding(local.vocab_size, cfg.hidden_size,
                                                              vocab_start=tp_rank * local.vocab_size, group=tp_group)
            if cfg.tie_word_embeddings:
                model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(dtype=dtype).to_empty(device=device)
    # the non-persistent RoPE buffer is garbage after to_empty; cast like build_model so logits match
    model.model.inv_freq = compute_inv_freq(cfg).to(device=device, dtype=dtype)
    return model.eval().requires_grad_(False)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, *, config: RolloutConfig, tp_group=None, device="cpu",
                 dtype=torch.float32):
        self.cfg, self.config, self.dtype = cfg, config, dtype
        self.device = torch.device(device)
        self.tp_group = tp_group
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self.model = build_local_model(cfg, tp=self.tp, tp_rank=self.tp_rank, tp_group=tp_group,
                                       device=self.device, dtype=dtype)
        self.fused = fuse_projections(self.model, device=self.device, dtype=dtype) if config.fuse_projections else []
        self.fused_of = {id(p): g for g in self.fused for p in g.members}
        self.params = dict(self.model.named_parameters(remove_duplicate=False))
        self.shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        self.loaded: set[int] = set()  # ids of parameters loaded since the last allocation
        self.shared: set[int] = set()  # ids of parameters aliasing a caller's tensor (from_model)
        self.use_graphs = config.enable_cuda_graph and self.device.type == "cuda"
        self.graph_error: str | None = None
        self.kernel_for: dict[tuple[int, int], str] = {}  # (rows, kv_len) -> decode attention kernel ("auto")
        self._kernel = "sdpa"
        self._decode, self._prefill = self._decode_fn, self._prefill_fn
        if config.compile:
            # one graph, dynamic in rows and KV length (marked per call); a bigger cache limit so a
            # surprise recompile never silently falls back to eager
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self._decode = _DynamicRows(torch.compile(self._decode_fn), self._decode_fn)
            self._prefill = _DynamicRows(torch.compile(self._prefill_fn), self._prefill_fn)
        self.cache: KVCache | None = None
        self._allocate_runtime()

    # ---- memory ----
    def _num_slots(self, slot_len: int) -> int:
        per_tok = kv_bytes_per_token(num_layers=self.cfg.num_hidden_layers, head_dim=self.cfg.head_dim,
                                     num_kv_heads=self.cfg.num_key_value_heads // self.tp, dtype=self.dtype)
        if self.config.kv_cache_tokens is not None:
            tokens = self.config.kv_cache_tokens
        elif self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            tokens = int(free * self.config.gpu_memory_fraction) // per_tok
            if self.tp > 1:  # every rank must agree on the slot count (same schedule, same collectives)
                t = torch.tensor([tokens], device=self.device)
                dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp_group)
                tokens = int(t.item())
        else:
            tokens = self.config.max_num_seqs * slot_len  # CPU: as many slots as sequences allowed
        slots = min(self.config.max_num_seqs, tokens // slot_len)
        if slots < 1:
            raise RuntimeError(f"KV cache of {tokens} tokens ({tokens * per_tok / 2**30:.2f} GiB) holds no slot of "
                               f"max_model_len={self.config.max_model_len}; raise gpu_memory_fraction / "
                               f"kv_cache_tokens or lower max_model_len")
        return slots

    def _allocate_runtime(self) -> None:
        slot_len = self.config.max_model_len
        slots = self._num_slots(slot_len)
        self.cache = KVCache(num_layers=self.cfg.num_hidden_layers, num_slots=slots, slot_len=slot_len,
                             num_kv_heads=self.cfg.num_key_value_heads // self.tp, head_dim=self.cfg.head_dim,
                             dtype=self.dtype, device=self.device)
        # static decode rows per slot: token, position, key, top_k, active (int64) / temperature, top_p (fp32)
        self.meta_i = torch.zeros(5, slots, dtype=torch.int64, device=self.device)
        self.meta_f = torch.ones(2, slots, dtype=torch.float32, device=self.device)
        self.out = torch.zeros(2 * slots, dtype=torch.float64, device=self.device)
        self.kv_index = torch.arange(slot_len, device=self.device)
        self.u_table = torch.full((slots + 1, slot_len + 1), 0.5, dtype=torch.float32, device=self.device)
        # two host buffers: step k's result is read while step k+1 (launched before) runs
        pin = self.device.type == "cuda"
        self._host_out = [torch.zeros(2 * slots, dtype=torch.float64, pin_memory=pin) for _ in range(2)]
        self._flip = 0
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.graph_pool = None
        self._capture_stream = torch.cuda.Stream(self.device) if self.use_graphs else None

    @property
    def num_slots(self) -> int:
        return self.cache.num_slots

    @property
    def slot_len(self) -> int:
        return self.cache.slot_len

    def free_runtime(self, *, drop_weights: bool) -> None:
        self.graphs.clear()
        self.graph_pool = None
        self.cache = self.meta_i = self.meta_f = self.out = self._host_out = self.u_table = None
        if drop_weights:
            for p in self.params.values():
                p.data = torch.empty(0, dtype=self.dtype, device=self.device)
            for g in self.fused:
                g.drop(device=self.device, dtype=self.dtype)
            self.loaded.clear()
            self.shared.clear()

    def wake(self) -> None:
        """Re-allocate the KV cache and decode buffers; dropped weights come back with load_weights."""
        self._allocate_runtime()

    # ---- weights ----
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, share: bool = False) -> None:
        """Copy (or alias, when `share` and device/dtype match) HF-named local shards into the model."""
        changed = False  # new storage under a parameter invalidates the captured graphs' pointers
        for name, t in named_tensors:
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
        if changed:
            self.graphs.clear()

    def check_loaded(self) -> None:
        missing = [n for n, p in self.params.items() if id(p) not in self.loaded]
        if missing:
            raise RuntimeError(f"{len(missing)} weights not loaded since wake_up/creation (e.g. {missing[:3]}); "
                               f"call update_weights with every parameter before generate")

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

    @torch.inference_mode()
    def prefill(self, batch: PrefillBatch) -> tuple[list[int], list[float]]:
        """Run the prompts (plus any tokens already generated) of each row; sample the next token of
        every sequence. Returns tokens, logprobs in batch.seqs order."""
        dev = self.device
        ids = torch.zeros(len(batch.rows), batch.padded_len, dtype=torch.int64)
        last = []
        for r, row in enumerate(batch.rows):
            toks = row[0].prompt_ids + row[0].token_ids
            ids[r, : len(toks)] = torch.tensor(toks)
            last.append(len(toks) - 1)
        seqs = batch.seqs
        rows = torch.tensor([r for r, row in enumerate(batch.rows) for _ in row], device=dev)
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        logits = self._prefill(ids.to(dev), slots, rows, torch.tensor(last, device=dev))
        f = torch.tensor([[float(s.params.temperature), float(s.params.top_p)] for s in seqs], device=dev)
        i = torch.tensor([[s.key, s.params.top_k, s.length] for s in seqs], device=dev)
        tok, lp = sample(logits, temperature=f[:, 0], top_p=f[:, 1], keys=i[:, 0], top_k=i[:, 1],
                         positions=i[:, 2], filtered=any_filtered(seqs))
        out = torch.stack([tok.double(), lp.double()]).cpu()
        return [int(t) for t in out[0]], out[1].tolist()

    def _prefill_fn(self, ids: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                    last: torch.Tensor) -> torch.Tensor:
        """Right-padded prompt rows ids [Np, T] -> K/V written to `slots` (row rows[i] for slot i) and the
        logits [len(slots), V] of each sequence's last prompt token; what torch.compile sees for prefill."""
        n, t = ids.shape
        pos = torch.arange(t, device=ids.device).expand(n, t)
        h = self.model.hidden_states(ids, pos, attn=PrefillAttention(self.cache, slots=slots, rows=rows))
        return self._logits(h[torch.arange(n, device=ids.device), last])[rows]

    # ---- decode: device-resident rows, advanced inside the graph ----
    def set_rows(self, rows: dict[int, tuple[tuple[int, ...], tuple[float, float]]]) -> None:
        """Overwrite decode rows: slot -> ((token, position, key, top_k, active), (temperature, top_p))."""
        if not rows:
            return
        slots = list(rows)
        idx = torch.tensor(slots, device=self.device)
        self.meta_i[:, idx] = torch.tensor([rows[s][0] for s in slots], dtype=torch.int64).T.to(self.device)
        self.meta_f[:, idx] = torch.tensor([rows[s][1] for s in slots], dtype=torch.float32).T.to(self.device)
        # the row's uniforms for every position, once per (re)assignment: ~40 tiny hash kernels per decode
        # step become one gather
        positions = torch.arange(self.u_table.shape[1], device=self.device)
        self.u_table[idx] = uniform_from_counter(self.meta_i[2, idx][:, None], positions[None, :])

    def _decode_fn(self, ids: torch.Tensor, pos: torch.Tensor, kv_index: torch.Tensor) -> torch.Tensor:
        """Forward of one token per row [B] -> logits [B, V]; what torch.compile sees (sampling stays out:
        Inductor's Triton backend cannot split the vocab-long cumsum, "NYI TritonSplitDimKernel")."""
        attn = DecodeAttention(self.cache.data, positions=pos, kv_index=kv_index, mode=self._kernel)
        return self._logits(self.model.hidden_states(ids[:, None], pos[:, None], attn=attn)[:, 0])

    def _decode_step(self, b: int, kv_len: int, filtered: bool) -> None:
        """One graph-capturable decode over cache rows [0, b): reads the static rows, writes self.out[:2b]
        (tokens then logprobs), then advances every active row in place (token <- sampled, position += 1)."""
        ids, pos, active = self.meta_i[0, :b], self.meta_i[1, :b], self.meta_i[4, :b]
        self._kernel = self._pick_kernel(b, kv_len)
        logits = self._decode(ids, pos, self.kv_index[:kv_len])
        u = self.u_table[:b].gather(1, (pos + 1)[:, None])[:, 0]  # the uniform of the new token's position
        if not filtered and self.device.type == "cuda" and triton_sampling.available(self.device):
            # one Triton kernel instead of ~10 over [B, V] fp32, same draws up to CDF-boundary rounding; CPU
            # keeps sample()
            tok, lp = triton_sampling.sample_unfiltered(logits, self.meta_f[0, :b], u)
        else:
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
            self.kernel_for[(b, kv_len)] = self._time_kernels(b, kv_len)
        return self.kernel_for[(b, kv_len)]

    def _time_kernels(self, b: int, kv_len: int) -> str:
        best, times = fastest_decode_kernel(self.cache, rows=b, kv_index=self.kv_index[:kv_len],
                                            num_heads=self.cfg.num_attention_heads // self.tp, sync=self._sync)
        log.info("decode attention B=%d kv=%d: %s (ms: %s)", b, kv_len, best, times)
        return best

    @torch.inference_mode()
    def launch_decode(self, num_rows: int, kv_len: int, filtered: bool) -> DecodeHandle:
        """Enqueue one decode step (graph replay on CUDA) and the async copy of its [2, num_rows] result."""
        key = (num_rows, kv_len, filtered)
        if not self.use_graphs:
            self._decode_step(*key)
        elif key in self.graphs:
            self.graphs[key].replay()
        else:
            try:
                try:
                    self._capture(key)
                except RuntimeError:
                    if self.kernel_for.get(key[:2], "sdpa") == "sdpa":
                        raise
                    # a forced SDPA backend / bmm that runs but does not capture: plain SDPA instead
                    log.warning("decode kernel %s did not capture; using sdpa", self.kernel_for[key[:2]])
                    self.kernel_for[key[:2]] = "sdpa"
                    torch.cuda.synchronize(self.device)
                    self._capture(key)
            except RuntimeError as e:  # keep generating: eager decode is slower but correct
                self.graph_error = f"{type(e).__name__}: {e}"[:500]
                log.warning("CUDA graph capture failed, decoding eagerly from now on: %s", self.graph_error)
                self.use_graphs = False
                self.graphs.clear()
                torch.cuda.synchronize(self.device)
                self._decode_step(*key)
        buf = self._host_out[self._flip]
        self._flip ^= 1
        buf[: 2 * num_rows].copy_(self.out[: 2 * num_rows], non_blocking=True)  # contiguous: truly async
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return DecodeHandle(buf, num_rows, event)

    def collect(self, handle: DecodeHandle) -> tuple[list[int], list[float]]:
        """Wait for a launched step; tokens and logprobs of rows [0, num_rows) (padding rows included)."""
        if handle.event is not None:
            handle.event.synchronize()
        b = handle.num_rows
        return [int(t) for t in handle.buf[:b].tolist()], handle.buf[b: 2 * b].tolist()

    def _capture(self, key: tuple[int, int, bool]) -> None:
        """Warm up eagerly (then undo its row advance), capture, and replay once: the step runs exactly once.

        capture_begin/end directly rather than `torch.cuda.graph`, whose gc.collect + empty_cache per
        capture would cost ~100 ms per graph; sleep() drops the graphs, so they are recaptured often."""
        saved = self.meta_i.clone()
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._decode_step(*key)  # warm-up: compiles / loads every kernel outside the capture
            self.meta_i.copy_(saved)
            if self.graph_pool is None:
                self.graph_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.graph_pool)
            try:
                self._decode_step(*key)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graphs[key] = graph
        graph.replay()

    def move_slots(self, moves: list[tuple[int, int]], *, lengths: list[int]) -> None:
        with torch.inference_mode():
            self.cache.move_slots(moves, lengths=lengths)
