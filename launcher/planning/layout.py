"""The planner's size rule for one role's layout, shared by the plan (launcher/planning/plan.py) and the
auto search (launcher/planning/autoplan.py), so the search never proposes a layout the planner refuses."""

from __future__ import annotations

from models.config import ModelConfig
from parallel.dims import ParallelDims


def validate_role_layout(role: str, shape: ModelConfig, *, tp: int, pp: int, stages_per_rank: int = 1) -> None:
    """Whether `role` can shard a model of `shape` over tp x pp (parallel.dims.ParallelDims.validate_model:
    heads, KV heads, intermediate size, vocabulary, layers). Raises TopologyError.
    The one size rule of the planner and of the auto search, so the search never proposes a layout
    the planner then refuses."""
    ParallelDims(tp=tp, pp=pp, dp=1).validate_model(
        num_heads=shape.num_attention_heads, num_kv_heads=shape.num_key_value_heads,
        num_layers=shape.num_hidden_layers, vocab_size=shape.vocab_size, intermediate_size=shape.intermediate_size,
        stages_per_rank=stages_per_rank, role=role)
