"""Which dimension of each Hugging Face-named parameter tensor parallelism shards.

One table serves the DTensor TP plan (parallel/tensor_parallel.py), the rollout engine's
local TP shards and the reshard planner, so training and generation can never disagree:

    q/k/v/gate/up (weight and bias)  -> dim 0  (column parallel: output features)
    o_proj / down_proj weight         -> dim 1  (row parallel: input features)
    embed_tokens / lm_head / score    -> dim 0  (vocab parallel; score is 1-wide -> replicated)
    norms, everything else            -> None   (replicated)

LoRA adapters (models/lora.py) split like their base, so an adapted projection needs no collective of its own:
a column-parallel projection's (and the vocab-parallel lm_head's) lora_B [out, r] -> dim 0 (its lora_A [r, in]
replicated), a row-parallel one's
lora_A [r, in] -> dim 1 (its lora_B [out, r] replicated).
"""

from __future__ import annotations

import re

_COLWISE = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_ROWWISE = re.compile(r"\.(o_proj|down_proj)\.weight$")
_COLWISE_LORA = re.compile(r"(\.(q_proj|k_proj|v_proj|gate_proj|up_proj)|(^|\.)lm_head)\.lora_B$")
_ROWWISE_LORA = re.compile(r"\.(o_proj|down_proj)\.lora_A$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


def tp_shard_dim(name: str) -> int | None:
    """Dimension of parameter `name` that is split across the TP group, or None if replicated."""
    if _COLWISE.search(name) or _COLWISE_LORA.search(name):
        return 0
    if _ROWWISE.search(name) or _ROWWISE_LORA.search(name):
        return 1
    if _VOCAB.search(name):
        return 0
    return None


def shard_range(size: int, *, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of an even split of `size` into `world` parts (TP requires divisibility)."""
    if size % world:
        raise ValueError(f"dimension of size {size} is not divisible by tp({world})")
    step = size // world
    return rank * step, (rank + 1) * step


def tp_slices(name: str, shape: tuple[int, ...], *, rank: int, world: int) -> tuple[slice, ...]:
    """Index of rank `rank`'s TP shard of a full tensor of `shape`."""
    idx = [slice(None)] * len(shape)
    dim = tp_shard_dim(name)
    if dim is not None and world > 1:
        start, stop = shard_range(shape[dim], rank=rank, world=world)
        idx[dim] = slice(start, stop)
    return tuple(idx)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """Decoder layer of a parameter (`model.layers.7.mlp...` -> 7); None for embeddings/norm/head."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def pp_stage_layers(num_layers: int, *, pp: int, stage: int) -> range:
    """Layers of pipeline stage `stage`: an even split, earlier stages take the remainder."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def pp_stage_of(name: str, *, num_layers: int, pp: int) -> int:
    """Stage that owns parameter `name`: embeddings on the first, final norm/head on the last."""
    layer = layer_index(name)
    if layer is None:
        return 0 if "embed_tokens" in name else pp - 1
    for s in range(pp):
        if layer in pp_stage_layers(num_layers, pp=pp, stage=s):
            return s
    raise ValueError(f"layer {layer} of {name} outside {num_layers} layers")
