"""One compiled graph serves every decoder layer: LoRA adapters, selective activation checkpointing and expert
parallelism give modules their forward through a mixed-in class (models.mixin), never an instance attribute,
which torch.compile guards by object id (a 32-layer LoRA model compiled 74 graphs, three minutes, on the H200)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models import build_model, preset_config
from models.lora import LoRASpec, add_adapters, freeze_base
from models.mixin import mixed_class, with_mixin
from parallel.apply import apply_ac, apply_compile
from ppo.metrics.timing import compiled_graphs

_COMPILE = torch.nn.Module.compile


def _graphs_of_a_step(layers: int, monkeypatch, *, ac: str) -> int:
    torch._dynamo.reset()
    # Dynamo's tracing and guards as in a real run, without inductor's code generation (seconds per graph on CPU)
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: _COMPILE(self, backend="eager", **kw))
    cfg = dataclasses.replace(preset_config("tiny"), num_hidden_layers=layers)
    model = build_model(cfg, seed=0)
    add_adapters(model, LoRASpec(rank=4, alpha=8.0), seed=0)
    freeze_base(model)
    apply_ac(model, ac)
    apply_compile(model)
    before = compiled_graphs()
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    model(ids).float().sum().backward()  # the update's forward and backward
    with torch.no_grad():
        model(ids)  # a scoring forward
    return compiled_graphs() - before


@pytest.mark.parametrize("ac", ["none", "selective"])
def test_the_compiled_graph_count_does_not_grow_with_the_layer_count(monkeypatch, ac):
    assert _graphs_of_a_step(4, monkeypatch, ac=ac) == _graphs_of_a_step(2, monkeypatch, ac=ac)


def test_a_mixed_class_is_made_once_and_keeps_isinstance():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(3, 3)

    class Twice(torch.nn.Module):
        def forward(self, x):
            return 2 * super().forward(x)

    with_mixin(a, Twice), with_mixin(b, Twice)
    assert type(a) is type(b) is mixed_class(Twice, torch.nn.Linear) and isinstance(a, torch.nn.Linear)
    assert torch.equal(a(torch.ones(2)), 2 * torch.nn.functional.linear(torch.ones(2), a.weight, a.bias))
    assert [n for n, _ in a.named_parameters()] == ["weight", "bias"]
    with pytest.raises(ValueError, match="already has"):
        with_mixin(a, Twice)
