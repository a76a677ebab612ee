"""Atomic checkpoints: round trip, HF-loadable weights, crash safety, pruning, multi-rank protocol."""

import json
import os
import random
import threading

import numpy as np
import pytest
import torch

import ppo.run.checkpoint as ckpt_mod
from models import build_model
from ppo.run.checkpoint import (
    capture_rng_state,
    find_latest_checkpoint,
    hf_weight_files,
    list_checkpoints,
    load_checkpoint,
    load_model_state,
    restore_rng_state,
    save_checkpoint,
)
from tests.dist_utils import run_world


def _tiny():
    model = build_model("tiny", seed=3)
    return model, model.config.to_hf()


def _save(run_dir, step, **kw):
    kw.setdefault("per_rank_state", {"step": step})
    return save_checkpoint(run_dir, step, rank=0, world_size=1, **kw)


def test_roundtrip_states_weights_and_rng(tmp_path):
    model, cfg = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 512, (2, 8))).sum().backward()
    opt.step()
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    rng = capture_rng_state()
    expect = (random.random(), np.random.rand(), torch.rand(3))
    path = save_checkpoint(tmp_path, 5, rank=0, world_size=1,
                           per_rank_state={"optim": opt.state_dict(), "rng": rng},
                           shared_state={"sampler": {"epoch": 1, "index": 42}, "config_hash": "abc"},
                           model_states={"actor": model.state_dict()}, model_configs={"actor": cfg})
    assert path == tmp_path / "checkpoints" / "step_5" and find_latest_checkpoint(tmp_path) == path
    per_rank, shared = load_checkpoint(path, rank=0)
    assert shared == {"sampler": {"epoch": 1, "index": 42}, "config_hash": "abc"}
    st = per_rank["optim"]["state"][0]
    assert torch.equal(st["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    restore_rng_state(per_rank["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expect[0] and got[1] == expect[1] and torch.equal(got[2], expect[2])
    sd = load_model_state(path, "actor")
    assert sd.keys() == model.state_dict().keys()
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    manifest = json.loads((path / "COMPLETE").read_text())
    assert manifest["roles"] == ["actor"] and "rank_0.pt" in manifest["files"]
    assert json.loads((path / "actor" / "config.json").read_text())["dtype"] == "float32"
    assert not list((tmp_path / "checkpoints").glob("*.tmp-*"))


def test_actor_dir_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    model, cfg = _tiny()
    cfg["architectures"] = ["LlamaCausalLM"]  # a malformed class name is repaired, not propagated
    path = _save(tmp_path, 1, model_states={"actor": model.state_dict()}, model_configs={"actor": cfg})
    assert json.loads((path / "actor" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path / "actor", dtype=torch.float32)
    ids = torch.randint(0, 512, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-4, atol=1e-4)


def test_sharded_role_directory_reads_back(tmp_path):
    model, cfg = _tiny()
    sd = model.state_dict()
    path = _save(tmp_path, 1, model_states={"actor": sd}, model_configs={"actor": cfg}, max_shard_bytes=100_000)
    shards = hf_weight_files(path / "actor")
    assert len(shards) > 2 and (path / "actor" / "model.safetensors.index.json").exists()
    back = load_model_state(path, "actor")
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    os.remove(shards[1])
    with pytest.raises(FileNotFoundError, match="missing"):
        hf_weight_files(path / "actor")
    with pytest.raises(ValueError, match="model_configs"):
        _save(tmp_path, 2, model_states={"actor": sd})


def test_crash_mid_save_keeps_previous(tmp_path, monkeypatch):
    good = _save(tmp_path, 10, shared_state={"v": 10})
    with pytest.raises(Exception):  # noqa: B017 - pickling a lambda fails part-way through the write
        _save(tmp_path, 20, per_rank_state={"bad": lambda: 0})
    assert find_latest_checkpoint(tmp_path) == good
    assert list((tmp_path / "checkpoints").glob("step_20.tmp-*"))  # debris, never picked

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod, "_write_manifest", boom)  # everything written except the manifest
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 30, shared_state={"v": 30})
    assert find_latest_checkpoint(tmp_path) == good and load_checkpoint(good, rank=0)[1] == {"v": 10}
    monkeypatch.undo()
    newer = _save(tmp_path, 40)
    assert find_latest_checkpoint(tmp_path) == newer
    assert not list((tmp_path / "checkpoints").glob("*.tmp-*"))  # debris cleaned by the next good save


def test_incomplete_or_damaged_never_picked(tmp_path):
    good = _save(tmp_path, 1)
    (tmp_path / "checkpoints" / "step_7").mkdir()  # no manifest
    damaged = _save(tmp_path, 9)
    with open(damaged / "rank_0.pt", "ab") as f:  # size no longer matches the manifest
        f.write(b"x")
    assert list_checkpoints(tmp_path) == [good] and find_latest_checkpoint(tmp_path) == good
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_checkpoint(damaged, rank=0)
    assert find_latest_checkpoint(tmp_path / "nothing") is None


def test_keep_last_and_resave(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep_last=2, shared_state={"v": step})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_3", "step_4"]
    again = _save(tmp_path, 4, keep_last=2, shared_state={"v": 44})  # re-save of an existing step swaps it
    assert load_checkpoint(again, rank=0)[1] == {"v": 44}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_3", "step_4"]
    with pytest.raises(ValueError, match="keep_last"):
        _save(tmp_path, 5, keep_last=0)


def test_multi_rank_protocol_with_thread_barrier(tmp_path):
    world = 3
    bar = threading.Barrier(world, timeout=30)
    order: list[str] = []
    real_rename = os.rename

    def spy_rename(a, b):
        order.append(f"rename {os.path.basename(b)}")
        real_rename(a, b)

    results, errors = {}, []

    def body(rank):
        try:
            if rank == 2:
                order.append("rank2 writing")
            results[rank] = save_checkpoint(tmp_path, 3, rank=rank, world_size=world,
                                            per_rank_state={"rank": rank, "t": torch.full((2,), rank)},
                                            shared_state={"step": 3} if rank == 0 else {"ignored": True},
                                            barrier=bar.wait)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ckpt_mod.os.rename = spy_rename
    try:
        threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    finally:
        ckpt_mod.os.rename = real_rename
    assert not errors and len(set(results.values())) == 1
    assert order.index("rank2 writing") < order.index("rename step_3")
    for r in range(world):
        per_rank, shared = load_checkpoint(results[0], rank=r)
        assert per_rank["rank"] == r and torch.equal(per_rank["t"], torch.full((2,), r))
        assert shared == {"step": 3}
    with pytest.raises(ValueError, match="written by 3 ranks"):
        load_checkpoint(results[0], rank=3)


def _gloo_body(rank, world_size, run_dir):
    model = build_model("tiny", seed=0)
    path = save_checkpoint(run_dir, 2, rank=rank, world_size=world_size,
                           per_rank_state={"rng": capture_rng_state(), "rank": rank},
                           shared_state={"step": 2}, model_states={"actor": model.state_dict()},
                           model_configs={"actor": model.config.to_hf()})
    per_rank, shared = load_checkpoint(find_latest_checkpoint(run_dir), rank=rank)
    return str(path), per_rank["rank"], shared["step"]


@pytest.mark.distributed
def test_gloo_world_default_barrier(tmp_path):
    out = run_world(_gloo_body, 2, args=(str(tmp_path),))
    assert out == [(str(tmp_path / "checkpoints" / "step_2"), 0, 2), (str(tmp_path / "checkpoints" / "step_2"), 1, 2)]
