"""The engine's decoder layer with its RMSNorm weights folded into the GEMMs that follow (rollout.fold_norms).

    RMSNorm(x) @ W^T = r * (x @ (W * gamma)^T),   r = rsqrt(mean(x^2) + eps), one scalar per row of x

With gamma folded into the q/k/v and gate/up weights once per weight load (`fold_weight`), a decode layer runs
no norm kernel: r is applied by what reads each GEMM's output next (the Triton decode-attention kernel scales
q, the new k and the new v by the r of the row's x, which it reads itself; `scaled_silu_mul` scales gate and up)
and the residual adds go into the o_proj and down_proj GEMMs (cuBLAS with beta = 1, in place on the residual
stream: `residual_linear_`). A decode layer is then 6 launches (q/k/v GEMM, attention, o_proj, gate/up GEMM,
SiLU-and-multiply, down_proj) instead of 8: at decode sizes each of the two add + RMSNorm kernels cost a few
microseconds of work plus its launch gap, as much as the bytes it moved.

The same function as models/llama.py's layer; the roundings differ (W * gamma is rounded to bf16 once per load,
the GEMMs round unnormalised rows, r is applied in fp32), tested against the trainer's log-probs. Layers with
q/k/v biases or Qwen3's q/k norms (which would need r before them) keep the unfolded layer: `foldable`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.llama import DecoderLayer
from models.triton_support import triton_runs
from rollout.engine_lora import AdaptedLinear

try:
    import triton
    import triton.language as tl

    from rollout.triton_attention import row_rms_scale  # the decode kernel's own row scale
except ImportError:  # CPU-only installs: scaled_silu_mul keeps its torch formula
    triton = None


def foldable(layer: DecoderLayer) -> bool:
    """Whether r can move past the layer's q/k/v and gate/up GEMMs: no biases after them, no q/k norms."""
    a = layer.self_attn
    return a.q_proj.bias is None and a.q_norm is None and not layer.sparse


def fold_weight(weight: torch.Tensor, gamma: torch.Tensor) -> None:
    """weight [out, in] *= gamma [in] in place (one rounding to weight's dtype)."""
    weight.mul_(gamma.to(weight.dtype)[None, :])


def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """r = rsqrt(mean(x^2) + eps) in fp32, shape [..., 1] (models/llama.py's RMSNorm without its weight)."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


@torch.library.custom_op("hybridrl_rollout::residual_linear_", mutates_args=("h",))
def residual_linear_(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """h [N, H] += x [N, I] @ weight [H, I]^T as ONE GEMM (beta = 1, no separate add kernel). A custom op so
    that Inductor leaves it one call (its own lowering would split off the add) and re-uses h's buffer."""
    h.addmm_(x, weight.t())


@residual_linear_.register_fake
def _residual_linear_fake(h, x, weight) -> None:
    return None


if triton is not None:

    @triton.jit
    def _scaled_silu_mul_kernel(gu_ptr, x_ptr, out_ptr, eps, INTER, s_gu, s_x, s_o, HID: tl.constexpr,
                                CHUNK: tl.constexpr, BLOCK_I: tl.constexpr):
        # program (row, column block): gate and up loaded first, the row's r from its x (4-8 KB, from L2 after
        # the row's first block) while they arrive, then silu(g * r) * (u * r) in fp32, rounded once
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        ok = cols < INTER
        g = tl.load(gu_ptr + row * s_gu + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * s_gu + INTER + cols, mask=ok, other=0.0).to(tl.float32)
        r = row_rms_scale(x_ptr + row * s_x, eps, HID, CHUNK)
        g, u = g * r, u * r
        tl.store(out_ptr + row * s_o + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=ok)


@torch.library.custom_op("hybridrl_rollout::scaled_silu_mul", mutates_args=())
def scaled_silu_mul(gate_up: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """gate_up [N, 2I] (gate | up, the unnormalised rows of the GEMM over x with the norm weight folded in),
    x [N, H] -> silu(g * r) * (u * r) [N, I], r = rms_scale(x). One Triton kernel where Triton runs."""
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if not triton_runs(gate_up.device) or n == 0:
        r = rms_scale(x, eps)
        g, u = gate_up.float().chunk(2, dim=-1)
        return (F.silu(g * r) * (u * r)).to(gate_up.dtype)
    if gate_up.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("scaled_silu_mul needs unit-stride rows")
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 2048  # columns per program: each one also reads its row's x (H values) for r
    _scaled_silu_mul_kernel[(n, triton.cdiv(inter, block))](
        gate_up, x, out, eps, inter, gate_up.stride(0), x.stride(0), out.stride(0), HID=x.shape[1],
        CHUNK=min(2048, triton.next_power_of_2(x.shape[1])), BLOCK_I=block, num_warps=8)
    return out


@scaled_silu_mul.register_fake
def _scaled_silu_mul_fake(gate_up, x, eps) -> torch.Tensor:
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


class FoldedDecoderLayer(DecoderLayer):
    """models/llama.py's DecoderLayer over weights with its norms folded in (fuse_projections(fold_norms=True)):
    self_attn is a FusedQKVAttention whose qkv_weight holds q/k/v * input_layernorm.weight, mlp a FusedGateUpMLP
    whose gate_up_weight holds gate/up * post_attention_layernorm.weight. Updates x in place (the engine's
    residual stream; callers pass a tensor they do not read again) and returns it."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        a, m = self.self_attn, self.mlp
        b, t, hidden = x.shape
        qkv = a.qkv(x)  # the q|k|v GEMM and its LoRA adapter, if any (the adapter's A holds the norm weight too)
        if getattr(attn, "applies_norm", False):  # the decode kernel scales q/k/v by the r of x's rows
            out = a.heads(qkv, cos, sin, attn, norm_x=x.view(b * t, hidden), eps=self.input_layernorm.eps)
        else:
            out = a.heads((qkv.float() * rms_scale(x, self.input_layernorm.eps)).to(qkv.dtype), cos, sin, attn)
        x = _add_linear(x, out, a.o_proj)
        act = scaled_silu_mul(m.gate_up(x).view(b * t, -1), x.view(b * t, hidden),
                              self.post_attention_layernorm.eps)
        return _add_linear(x, act.view(b, t, -1), m.down_proj)


def _add_linear(x: torch.Tensor, y: torch.Tensor, proj) -> torch.Tensor:
    """x + proj(y): in one GEMM on x's buffer for a plain Linear (a LoRA-adapted one adds B' (A y) by a second
    GEMM on that buffer); a row-parallel one (tensor parallelism) all-reduces its partial sums first, so the
    residual is added after that."""
    if type(proj) not in (torch.nn.Linear, AdaptedLinear):
        return x + proj(y)
    rows, y = x.view(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    residual_linear_(rows, y, proj.weight)
    if type(proj) is AdaptedLinear:
        a, b = proj.lora
        residual_linear_(rows, F.linear(y, a), b)
    return x
