"""The 7B choreography's pieces through the real launcher, on CPU: `actor.offload_optimizer` builds the
host-offload AdamW (the SFT warm-up, the GRPO update, the hybrid engine's release of training state
and the checkpoint all run with it), and a frozen reference is stored in the compute dtype."""

from __future__ import annotations

import pytest
import torch

from tests.ppo.test_trainer import _ok, launch, metrics


@pytest.mark.distributed
def test_grpo_with_offloaded_optimizer_trains_and_checkpoints(tmp_path):
    _ok(launch(tmp_path, 1, "conf/grpo_tiny.yaml", "trainer.total_steps=1", "trainer.experiment_name=offload",
               "actor.offload_optimizer=true"))
    run = tmp_path / "offload"
    log = (run / "logs" / "rank_0.log").read_text()
    assert "optimizer HostOffloadAdamW" in log and "moments in host memory" in log
    from bench.ppo_step import _generate_memory

    cycle = _generate_memory(run)  # the hybrid engine's memory timeline, as the bench row reports it
    assert cycle[0].startswith("start") and cycle[-1].startswith("restore_training")
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["actor/optimizer_step_s"] > 0
    assert rows[0]["mem/host_rss_gb"] > 0 and rows[0]["mem/host_peak_gb"] >= rows[0]["mem/host_rss_gb"]
    assert rows[0]["compile/graphs"] == 0  # nothing compiled on CPU (bench.ppo_step's compiled_steps reads it)
    state = torch.load(run / "checkpoints" / "step_1" / "rank_0.pt", weights_only=False)
    saved = state["workers"]["actor"]["runner"]["optim"]["state"]  # AdamW's layout: a resume loads it like any AdamW's
    assert saved and all(s["exp_avg"].device.type == "cpu" and "exp_avg_sq" in s for s in saved.values())


@pytest.fixture
def one_rank_world():
    """A single-process gloo group in this process (no spawn: the frozen-storage check costs a forward)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_frozen_model_in_compute_dtype_gives_the_mixed_precision_outputs(one_rank_world):
    from models import build_model
    from parallel.dims import ParallelDims, build_mesh
    from parallel.runner import MicroBatch
    from ppo.roles.actor_critic import PolicyWorker
    from ppo.roles.workers import WorkerSpec

    dims = ParallelDims(tp=1, pp=1, dp=1)
    mesh = build_mesh(dims, [0], device_type="cpu")
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16)[None]
    out = {}
    for frozen in (False, True):
        # trained: FSDP2's mixed precision (fp32 masters; at dp = 1 only when asked), the reference layout here
        spec = WorkerSpec(mesh=mesh, dims=dims, device=torch.device("cpu"), dtype=torch.bfloat16, frozen=frozen,
                          fsdp_masters=not frozen)
        w = PolicyWorker(build_model("tiny", seed=4), spec, temperature=1.0, pad_id=0, trainable=False)
        params = list(w.runner.modules[0].parameters())  # before forward: FSDP at dp=1 then shows bf16 copies
        stored = ({p.dtype for p in params}, any(hasattr(p, "full_tensor") for p in params))
        (hidden,) = w.runner.forward([MicroBatch(ids, pos)], reduce=lambda h, k: h)
        out[frozen] = (hidden, *stored)
    (mixed, mixed_dtypes, mixed_fsdp), (frozen, frozen_dtypes, frozen_fsdp) = out[False], out[True]
    assert mixed_dtypes == {torch.float32} and mixed_fsdp  # FSDP: fp32 masters, bf16 compute
    assert frozen_dtypes == {torch.bfloat16} and not frozen_fsdp  # plain bf16 module, half the bytes
    assert frozen.dtype == torch.bfloat16 and torch.equal(mixed, frozen)
