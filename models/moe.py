"""Qwen3-MoE's sparse MLP block with Hugging Face names, its grouped expert GEMMs, routing traces and the
load-balancing loss.

    block = SparseMoeBlock(cfg, layer_idx)      # mlp.gate.weight [E, H], mlp.experts.gate_up_proj [E, 2I, H],
    y = block(x, trace)                         #   mlp.experts.down_proj [E, H, I]   (transformers 5's names)

Router (transformers' Qwen3MoeTopKRouter): logits = x W_g^T, probabilities softmax in fp32, the top-k of them
(renormalised when norm_topk_prob), cast back to the logits' dtype. Every expert's tokens run as one grouped GEMM
(`torch._grouped_mm`: one kernel over all experts, CPU included; no loop over tokens or experts); where the device
lacks it (CUDA before Hopper, or fp32 on CUDA) a loop over experts runs the same sums. Checkpoints on disk keep
Hugging Face's per-expert names (`mlp.experts.<e>.gate_proj.weight` ...): models/hf_io.py converts.

A `RouterTrace` is passed explicitly through the model's forward (like the attention backend) and is how
routing leaves and enters a forward: it replays given expert ids (routing replay: the trainer reuses the
experts the rollout engine chose), keeps each layer's choice (what the engine records), counts how often the
router's own choice differs from the replayed one, and keeps the per-layer statistics of the auxiliary
load-balancing loss (Switch Transformer's, exactly as transformers' `load_balancing_loss_func`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig


@dataclass(slots=True)
class RouterTrace:
    """Routing of one forward over N tokens (the flattened [B, T] rows), per MoE layer index.

    recorded: layer -> [N, k] expert ids the rollout engine chose; a row of -1 means no record (e.g. the last
      sampled token, which the engine never ran). replay: the layer uses the recorded experts (rows of -1 keep
      the router's own choice); either way the router's own choice is compared with them (`mismatched`).
    keep_choice: record each layer's experts in `chosen` ([N, k] int32, the ids the layer used).
    keep_logits: record each layer's router logits in `logits` ([N, E]; parity tests).
    aux_stats: layer -> (tokens routed per expert [E] fp32, router probabilities summed over tokens [E] fp32,
      differentiable), always kept (two [E] vectors a layer): the load-balancing loss reads them.
    mismatched / compared: over (token, layer) pairs with a recorded row, how many the router alone routes to
      another expert set than the record (device scalars; compared counts the pairs).
    """

    recorded: dict[int, torch.Tensor] | None = None
    replay: bool = False
    keep_choice: bool = False
    keep_logits: bool = False
    chosen: dict[int, torch.Tensor] = field(default_factory=dict)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    aux_stats: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=dict)
    mismatched: torch.Tensor | None = None
    compared: torch.Tensor | None = None

    def aux_loss(self, num_experts: int) -> torch.Tensor | None:
        """transformers' load_balancing_loss_func over every MoE layer this forward ran (no padding mask):
        E * sum_e f_e * P_e, f_e the fraction of the layers' top-k assignments to expert e, P_e its mean router
        probability, both over all layers' tokens together. None when no MoE layer ran."""
        if not self.aux_stats:
            return None
        counts = sum(c for c, _, _ in self.aux_stats.values())
        probs = sum(p for _, p, _ in self.aux_stats.values())
        rows = sum(n for _, _, n in self.aux_stats.values())
        return num_experts * torch.sum((counts / rows) * (probs / rows))

    def _count_mismatch(self, own: torch.Tensor, replay: torch.Tensor) -> None:
        has = replay[:, 0] >= 0
        differs = (own.sort(dim=-1).values != replay.sort(dim=-1).values).any(dim=-1) & has
        m, c = differs.sum(), has.sum()
        self.mismatched = m if self.mismatched is None else self.mismatched + m
        self.compared = c if self.compared is None else self.compared + c


class GroupedExperts(nn.Module):
    """E SwiGLU experts as two stacked weights (transformers 5's Qwen3MoeExperts layout)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))  # rows [0, I): gate, [I, 2I): up
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, align: int | None = None
                ) -> torch.Tensor:
        """x [N, H], ids [N, k] expert ids, weights [N, k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x), [N, H].

        The N * k (token, expert) rows are grouped by expert, each group starting at a multiple of `align` rows
        (zero rows between: CUDA's bf16 grouped GEMM backward needs groups of 8-row multiples; default 8 on CUDA,
        1 elsewhere). Everything stays on the device (no host sync: graph-capturable)."""
        n, k = ids.shape
        flat = ids.reshape(-1).to(torch.int64)
        order = flat.argsort(stable=True)  # assignments grouped by expert (token order inside each group)
        token = order // k
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        y = expert_mlp(x.index_select(0, token), counts, flat[order], self.gate_up_proj, self.down_proj, align=align)
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))


def expert_mlp(xs: torch.Tensor, counts: torch.Tensor, expert: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor, *, align: int | None = None) -> torch.Tensor:
    """The SwiGLU experts of rows grouped by expert: xs [M, H] holds counts[e] rows of expert e after those of
    experts < e (expert [M]: each row's expert id), gate_up [E, 2I, H] and down [E, H, I] -> [M, H] in xs's order.

    Each group starts at a multiple of `align` rows (zero rows between: CUDA's bf16 grouped GEMM backward needs
    groups of 8-row multiples; default 8 on CUDA, 1 elsewhere). Everything stays on the device (no host sync:
    graph-capturable). Weights of another dtype than xs (experts left out of FSDP's mixed precision) are cast."""
    num_experts = gate_up.shape[0]
    align = (GROUP_ALIGN if xs.is_cuda else 1) if align is None else align
    gate_up, down = gate_up.to(xs.dtype), down.to(xs.dtype)
    if align > 1:
        padded = (counts + align - 1) // align * align
        ends = padded.cumsum(0)
        # row of each assignment: its group's padded start + its rank inside the group
        rank = torch.arange(xs.shape[0], device=xs.device) - (counts.cumsum(0) - counts)[expert]
        row = (ends - padded)[expert] + rank
        rows = xs.shape[0] + num_experts * (align - 1)  # a bound known on the host
        xs = xs.new_zeros(rows, xs.shape[1]).index_copy(0, row, xs)
    else:
        ends = counts.cumsum(0)
    ends = ends.to(torch.int32)
    h = _grouped_linear(xs, gate_up, ends)
    gate, up = h.chunk(2, dim=-1)
    y = _grouped_linear(F.silu(gate) * up, down, ends)
    return y.index_select(0, row) if align > 1 else y


# rows each expert group is padded to on CUDA: the bf16 grouped GEMM's weight gradient contracts over a group's
# rows, whose stride must be a multiple of 16 bytes (8 bf16 elements)
GROUP_ALIGN = 8


def _grouped_linear(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows [ends[e-1], ends[e]) of x [M, in] times w[e]^T ([E, out, in]) -> [M, out]."""
    if grouped_mm_supported(x):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=ends)
    out = x.new_zeros(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(ends.tolist()):  # one host sync a call; only off the grouped-GEMM path
        if end > start:
            out[start:end] = F.linear(x[start:end], w[e])
        start = end
    return out


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """torch._grouped_mm runs here: on the CPU (any float dtype eagerly; bf16 under torch.compile, whose fake-tensor
    check of the op takes bf16 only), on CUDA in bf16 on Hopper or newer."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return x.dtype == torch.bfloat16 or not torch.compiler.is_compiling()
    return x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)


class SparseMoeBlock(nn.Module):
    """Qwen3MoeSparseMoeBlock: router `gate` and `experts`; forward(x [B, T, H], trace) -> [B, T, H]."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg)

    def route(self, x: torch.Tensor, trace: RouterTrace | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (expert ids [N, k], weights [N, k] in the logits' dtype); records into `trace`."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if trace is not None:
            recorded = trace.recorded.get(self.layer_idx) if trace.recorded else None
            if recorded is not None:
                trace._count_mismatch(ids, recorded)
                if trace.replay:  # the engine's experts, weighted by this router's probabilities of them
                    ids = torch.where(recorded >= 0, recorded.to(ids.dtype), ids)
                    top = probs.gather(1, ids)
            counts = torch.zeros(probs.shape[1], dtype=torch.float32, device=x.device)
            counts.scatter_add_(0, ids.reshape(-1), torch.ones(ids.numel(), dtype=torch.float32, device=x.device))
            trace.aux_stats[self.layer_idx] = (counts, probs.sum(0), probs.shape[0])
            if trace.keep_choice:
                trace.chosen[self.layer_idx] = ids.to(torch.int32)
            if trace.keep_logits:
                trace.logits[self.layer_idx] = logits
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return ids, top.to(logits.dtype)

    def forward(self, x: torch.Tensor, trace: RouterTrace | None = None) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        ids, weights = self.route(flat, trace)
        return self.experts(flat, ids, weights).view(b, t, h)
