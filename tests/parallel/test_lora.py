"""LoRA in parallel layouts (parallel/lora.py): TP=2 and FSDP dp=2 equal one process (logits, adapter
gradients, the merged weights the engine receives, the export), adapters sharded like their base weights."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_world

SPEC_KW = dict(rank=4, alpha=8.0, target_modules=("all-linear",))


def _ids():
    return torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(3))


def _full_adapters() -> dict[str, torch.Tensor]:
    """Non-zero adapter values (as after training) for the tiny model, by name."""
    from models import build_model
    from models.lora import LoRASpec, add_adapters

    model = build_model("tiny", seed=0)
    add_adapters(model, LoRASpec(**SPEC_KW), seed=0)
    gen = torch.Generator().manual_seed(5)
    return {n: 0.1 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters() if "lora_" in n}


def _set_adapters(named, values) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for n, p in named:
            if "lora_" not in n:
                continue
            v = values[n]
            if isinstance(p, DTensor):
                v = distribute_tensor(v, p.device_mesh, p.placements)
            p.copy_(v)


def _results(runner):
    """logits, adapter grads (full), merged shards, the merged export: one model's view."""
    from torch.distributed.tensor import DTensor

    from models.llama import LlamaForCausalLM  # noqa: F401
    from parallel.runner import hf_name

    model = runner.modules[0]
    ids = _ids()
    logits = model(ids)
    logits.logsumexp(-1).mean().backward()
    grads = {hf_name(n): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in model.named_parameters() if p.grad is not None}
    frozen = [n for n, p in runner.named_parameters() if p.requires_grad != ("lora_" in n)]
    shards = runner.training_shards()
    return dict(logits=logits.detach(), grads=grads, frozen=frozen, shards=shards,
                export=runner.export_state_dict(), adapters=runner.adapter_state_dict())


def _build(dims, ranks):
    from models import build_model
    from models.lora import LoRASpec
    from parallel.apply import parallelize_model
    from parallel.dims import build_mesh

    if ranks is None:  # one process: the plain model with its adapters
        from parallel.lora import apply_lora
        from parallel.native_runner import LocalRunner

        model = build_model("tiny", seed=0)
        apply_lora(model, LoRASpec(**SPEC_KW))
        runner = LocalRunner(model)
    else:
        mesh = build_mesh(dims, ranks, device_type="cpu")
        runner = parallelize_model(build_model("tiny", seed=0), mesh=mesh, dims=dims, lora=LoRASpec(**SPEC_KW))
    _set_adapters(runner.named_parameters(), _full_adapters())
    return runner


def _world_body(rank, world):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from parallel.dims import ParallelDims

    out = {}
    tp = _build(ParallelDims(tp=2), [0, 1])
    attn = tp.modules[0].model.layers["0"].self_attn
    out["placements"] = {n: tuple(getattr(attn, n).lora_A.placements + getattr(attn, n).lora_B.placements)
                         for n in ("q_proj", "o_proj")}
    assert isinstance(attn.q_proj.lora_A, DTensor)
    assert out["placements"] == {"q_proj": (Replicate(), Shard(0)), "o_proj": (Shard(1), Replicate())}
    out["tp"] = _results(tp)
    out["fsdp"] = _results(_build(ParallelDims(dp=2), [0, 1]))
    out["one"] = _results(_build(None, None))
    return out


@pytest.mark.distributed
def test_tp2_and_fsdp_equal_one_process():
    from parallel.sharding import tp_slices

    results = run_world(_world_body, 2)
    want = results[0]["one"]
    assert want["frozen"] == [] and len(want["grads"]) == len(want["adapters"]) == 4 * 7 * 2
    assert not any("lora_" in n for n in want["shards"]) and not any("lora_" in n for n in want["export"])
    for rank, res in enumerate(results):
        for layout in ("tp", "fsdp"):
            got = res[layout]
            assert got["frozen"] == []
            torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
            assert got["grads"].keys() == want["grads"].keys()
            for n, g in want["grads"].items():
                torch.testing.assert_close(got["grads"][n], g, rtol=1e-4, atol=1e-6, msg=f"{layout} {n}")
            if rank == 0:
                for n, t in want["export"].items():
                    torch.testing.assert_close(got["export"][n], t, rtol=1e-5, atol=1e-6)
                for n, t in want["adapters"].items():
                    torch.testing.assert_close(got["adapters"][n], t, rtol=1e-5, atol=1e-6)
        # the engine's weights: this rank's TP shard of the merged weight (dp: the FSDP shard of dim 0)
        for n, t in want["shards"].items():
            sl = tp_slices(n, t.shape, world=2, rank=rank)
            torch.testing.assert_close(res["tp"]["shards"][n], t[sl], rtol=1e-5, atol=1e-6, msg=n)
            rows = (t.shape[0] + 1) // 2
            torch.testing.assert_close(res["fsdp"]["shards"][n], t[rank * rows:(rank + 1) * rows], rtol=1e-5,
                                       atol=1e-6, msg=n)
