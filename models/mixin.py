"""Give one module instance another forward without an instance attribute `forward`.

    with_mixin(layer, Checkpointed)      # layer.__class__ becomes CheckpointedLlamaDecoderLayer(Checkpointed, ...)

torch.compile guards an instance attribute `forward` (a functools.partial, a bound function) by its object's id,
so a model whose every layer carried its own compiled every layer again: a 32-layer LoRA model built 74 graphs
and spent three minutes compiling its first update. A class swap keeps the forward a class attribute, the same
object for every layer, so one graph serves them all. The mixed class is made once per (mixin, class) pair; the
module keeps its parameters, buffers and names, and isinstance of its old class still holds.
"""

from __future__ import annotations

import functools

from torch import nn


@functools.cache
def mixed_class(mixin: type, base: type) -> type:
    """The class (mixin, base), named mixin + base (e.g. LoRALinear); the same object on every call."""
    return type(f"{mixin.__name__}{base.__name__}", (mixin, base), {"__module__": base.__module__})


def with_mixin(module: nn.Module, mixin: type) -> nn.Module:
    """Make `module` an instance of (mixin, its class), in place; ValueError if it already is one."""
    if isinstance(module, mixin):
        raise ValueError(f"{type(module).__name__} already has {mixin.__name__}")
    module.__class__ = mixed_class(mixin, type(module))
    return module
