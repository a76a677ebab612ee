"""ppo/roles/generation.py: the rollout role's share of the prompts, its samples, and the report of what the
hybrid engine's generate cost (reshard seconds and bytes, peak memory), in one process."""

from __future__ import annotations

import pytest

from ppo.roles.generation import Generation, fits_resident, request_seed, settle_residency, sized_for_prompts
from tests.ppo.world import tiny_run, world_of_one


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    with world_of_one():
        run = tiny_run(tmp_path_factory.mktemp("gen"), "rollout.n=2", "algorithm.name=grpo",
                       config="conf/grpo_tiny.yaml")
        yield run.trainer()


def test_request_seed_is_stable_and_distinct():
    seeds = {request_seed(42, step, i) for step in range(3) for i in range(50)}
    assert len(seeds) == 150 and all(0 <= s < 2**62 for s in seeds)
    assert request_seed(42, 1, 7) == request_seed(42, 1, 7) != request_seed(43, 1, 7)


def test_generate_reports_samples_timings_and_metrics(trainer):
    rollout = trainer.roles.rollout
    batch = trainer.state.next_prompts(0)
    gen = rollout.generate(batch, step=0, seed=1)
    assert isinstance(gen, Generation)
    n = trainer.settings.generation.n
    assert sorted(s.uid for s in gen.samples) == list(range(len(batch) * n))
    for s in gen.samples:
        row = batch[s.prompt_index]
        assert s.uid // n == row["index"] and s.prompt_ids == list(row["prompt_ids"])
        assert s.ground_truth == row.get("ground_truth")
        assert len(s.behaviour_logprobs) == len(s.response_ids) <= trainer.settings.generation.max_response_length
    assert gen.reshard_s > 0
    # one rank, same layout and dtype: the generation weights alias the training shards, nothing moves
    assert gen.metrics["reshard/bytes_received"] == 0 and gen.metrics["reshard/peak_staging_bytes"] == 0
    assert gen.metrics["mem/hybrid_peak_gb"] > 0
    # the per-request seeds make a generate reproducible; another step samples differently
    again = rollout.generate(batch, step=0, seed=1)
    assert [s.response_ids for s in again.samples] == [s.response_ids for s in gen.samples]
    other = rollout.generate(batch, step=1, seed=1)
    assert [s.response_ids for s in other.samples] != [s.response_ids for s in gen.samples]


def test_engine_length_is_cut_to_the_longest_prompt_plus_the_response(trainer):
    g = trainer.settings.generation
    longest = max(trainer.state.dataset.longest_prompt, 0)
    assert g.engine.max_model_len == longest + g.max_response_length  # the trainer sized it from its data
    assert sized_for_prompts(g, 10**6).engine.max_model_len == g.engine.max_model_len  # never above the config's
    assert sized_for_prompts(g, 0) is g


def test_residency_fits_in_ninety_percent_of_the_device_and_needs_a_measurement(trainer):
    gib = 2**30
    assert fits_resident(train_peak=36 * gib, engine_bytes=86 * gib, total=140 * gib)
    assert not fits_resident(train_peak=36 * gib, engine_bytes=96 * gib, total=140 * gib)
    # on CPU there is no device memory to measure: the engine keeps freeing on sleep
    rollout = trainer.roles.rollout
    assert rollout.settle_memory(0) == (False, "no measured generate on CUDA")
    line = settle_residency(rollout, train_peak=0)
    assert line.startswith("rollout.free_memory_on_sleep=true (auto, after the first step: no measured")
    assert rollout.engine.config.free_memory_on_sleep is True
    assert settle_residency(None, train_peak=0).startswith("rollout.free_memory_on_sleep=false")


def test_replicas_take_contiguous_prompt_shares(trainer):
    rollout = trainer.roles.rollout
    batch = [{"index": i} for i in range(7)]
    assert rollout.my_prompts(batch) == batch  # one replica: everything
    saved = rollout.gen_dp, rollout.gen_dp_rank
    try:
        rollout.gen_dp = 2
        shares = []
        for rank in range(2):
            rollout.gen_dp_rank = rank
            shares.append([r["index"] for r in rollout.my_prompts(batch)])
        assert shares == [[0, 1, 2, 3], [4, 5, 6]]
    finally:
        rollout.gen_dp, rollout.gen_dp_rank = saved


def test_a_data_row_caps_its_response_length(trainer):
    from ppo.roles.generation import response_cap

    assert response_cap({"columns": {}}, 16) == 16 and response_cap({}, 16) == 16
    assert response_cap({"columns": {"max_response_length": 3}}, 16) == 3
    assert response_cap({"columns": {"max_response_length": 99}}, 16) == 16  # never above rollout's
    with pytest.raises(ValueError, match="max_response_length=0 must be a positive integer"):
        response_cap({"index": 5, "columns": {"max_response_length": 0}}, 16)
    rollout = trainer.roles.rollout
    batch = [dict(row, columns={"max_response_length": 1 + row["index"] % 2}) for row in trainer.state.next_prompts(0)]
    gen = rollout.generate(batch, step=0, seed=1)
    assert gen.samples and all(len(s.response_ids) <= 1 + s.prompt_index % 2 for s in gen.samples)
    assert any(len(s.response_ids) == 2 for s in gen.samples)


def test_lora_sync_auto_weighs_the_traffic_of_each_path():
    from models.config import preset_config
    from models.lora import LoRASpec, adapter_param_count
    from ppo.roles.generation import choose_lora_sync

    # llama-7b, r 64 on every linear layer, bf16, one GPU, 256 decode steps: one merged copy (2 passes over 13.5 GB)
    # costs less than the adapters read by every decode step (320 MB x 258)
    cfg = preset_config("llama-7b")
    base, adapters = 2 * cfg.num_params(), 2 * adapter_param_count(cfg, LoRASpec(rank=64, alpha=128))
    kw = dict(base_bytes=base, adapter_bytes=adapters, frees_weights=False)
    assert choose_lora_sync(decode_steps=256, crosses_ranks=False, **kw)[0] == "merged"
    # short responses, or weights that cross ranks (each byte 10x dearer): the adapters
    assert choose_lora_sync(decode_steps=8, crosses_ranks=False, **kw)[0] == "adapters"
    mode, why = choose_lora_sync(decode_steps=256, crosses_ranks=True, **kw)
    assert mode == "adapters" and "cross" in why
    # training needs the engine's memory on the GPU: merged, whatever the traffic
    assert choose_lora_sync(decode_steps=8, crosses_ranks=True, base_bytes=base, adapter_bytes=adapters,
                            frees_weights=True)[0] == "merged"
