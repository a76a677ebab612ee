"""Resume onto another layout, the decisions without processes: when a resume is one, the line it logs, what is
refused (megatron at another layout, native -> megatron, partial rollouts in flight, an old checkpoint) and the
per-rank RNG rule. The resharding itself: tests/parallel/test_reshard_state.py (runner states) and
tests/ppo/test_relayout_e2e.py (PPO through torchrun), tests/launcher/test_faults.py (2 ranks -> 1)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from ppo.run.relayout import (
    check_relayout,
    check_same_backend,
    converted_roles,
    describe_relayout,
    is_relayout,
    seed_rng,
)
from ppo.run.resume import ResumeError

OLD = {"actor": [[0, 1, 2, 3], 2, 2, 1], "critic": [[0, 1, 2, 3], 2, 2, 1], "rollout": [[0, 1, 2, 3], 2, 1, 2]}
NEW = {"actor": [[0, 1, 2, 3], 1, 1, 4], "critic": [[0, 1, 2, 3], 1, 1, 4], "rollout": [[0, 1, 2, 3], 1, 1, 4]}


def test_a_layout_change_is_detected_and_described():
    assert not is_relayout(OLD, 4, OLD, 4)
    assert is_relayout(OLD, 4, NEW, 4) and is_relayout(OLD, 4, OLD, 2)
    assert describe_relayout(3, OLD, 4, NEW, 4).startswith(
        "resuming step 3 written at tp=2 pp=2 dp=1 (4 ranks) onto tp=1 pp=1 dp=4 (4 ranks)")
    split = {"actor": [[0, 1], 1, 1, 2], "critic": [[2, 3], 2, 1, 1]}
    assert "onto tp=1 pp=1 dp=2, critic tp=2 pp=1 dp=1 on ranks 2-3 (4 ranks)" in describe_relayout(3, OLD, 4, split, 4)
    assert "resharded, the actor's megatron state converted for the native backend, the data position" in \
        describe_relayout(3, OLD, 4, OLD, 4, converted=["actor"])


def _roles(backend="native"):
    runner = SimpleNamespace(backend=backend)
    return SimpleNamespace(actor=SimpleNamespace(runner=runner), critic=None)


def _rank(backend="native", *, slices=True, rollout=False, layout=None):
    runner = {"params": {}, **({"slices": {}} if slices else {}), **({"layout": layout} if layout else {})}
    workers = {"actor": {"runner": runner, "backend": backend}}
    if rollout:
        workers["rollout"] = {"partial": {}}
    return {"workers": workers}


def test_what_cannot_move_is_refused_naming_the_way_out():
    check_relayout("ckpt", [_rank(), _rank()], _roles(), saved_desc="tp=2 (2 ranks)")  # native: resharded
    # megatron -> native: converted (parallel/megatron_checkpoint.py) when the states record layout and ranges
    lay = dict(tp=1, tp_rank=0, pp=1, pp_rank=0, dp=1, dp_rank=0, ep=1, head="lm")
    check_relayout("ckpt", [_rank("megatron", slices=False, layout=lay)], _roles(), saved_desc="tp=2 (2 ranks)")
    with pytest.raises(ResumeError, match=r"actor.backend=megatron and its state cannot be converted for "
                                          r"actor.backend=native: .*before megatron checkpoints recorded.*"
                                          r"resume with the layout that wrote it \(tp=2 \(2 ranks\)\).*"
                                          r"model.path=ckpt/actor"):
        check_relayout("ckpt", [_rank("megatron", slices=False)], _roles(), saved_desc="tp=2 (2 ranks)")
    with pytest.raises(ResumeError, match="actor.backend=native and resumes with actor.backend=megatron .*CUDA only"):
        check_relayout("ckpt", [_rank()], _roles("megatron"), saved_desc="x")
    with pytest.raises(ResumeError, match="actor.backend=megatron and resumes with actor.backend=megatron .*converts "
                                          "into the native backend"):
        check_relayout("ckpt", [_rank("megatron", slices=False, layout=lay)], _roles("megatron"), saved_desc="x")
    with pytest.raises(ResumeError, match="partial rollouts in flight"):
        check_relayout("ckpt", [_rank(rollout=True)], _roles(), saved_desc="x")
    with pytest.raises(ResumeError, match="before runner states carried their shard index"):
        check_relayout("ckpt", [_rank(slices=False)], _roles(), saved_desc="x")
    with pytest.raises(ResumeError, match="holds no critic state"):
        check_relayout("ckpt", [_rank()], SimpleNamespace(actor=None, critic=SimpleNamespace(runner=None)),
                       saved_desc="x")
    # the same layout: megatron -> native is converted (the relayout path), native -> megatron refused
    check_same_backend("ckpt", _rank()["workers"], _roles())
    assert converted_roles(_rank()["workers"], _roles()) == []
    older = {"actor": {"runner": {"params": {"model.norm.weight": torch.ones(2)}}}}  # no backend recorded
    check_same_backend("ckpt", older, _roles())
    by_names = {"actor": {"runner": {"params": {"decoder.final_layernorm.weight": 0}}}}  # megatron, by its names
    check_same_backend("ckpt", by_names, _roles())
    assert converted_roles(by_names, _roles()) == ["actor"]
    assert converted_roles(by_names, _roles("megatron")) == []
    with pytest.raises(ResumeError, match="trained with actor.backend=native, this run sets megatron; native's "
                                          "optimizer state does not convert"):
        check_same_backend("ckpt", _rank()["workers"], _roles("megatron"))


def test_rng_at_another_layout_is_a_function_of_seed_step_and_rank():
    def draw(rank):
        seed_rng(5, step=3, rank=rank)
        return random.random(), torch.rand(2)

    a, b = draw(0), draw(0)
    assert a[0] == b[0] and torch.equal(a[1], b[1])
    assert draw(1)[0] != a[0]
