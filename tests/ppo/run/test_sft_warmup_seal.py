"""The SFT warm-up's reference weights (`<run>/sft_warmup`), which a resume reloads as the reference policy, are
covered by a manifest of sizes and SHA-256 like a checkpoint's files: a resume onto altered weights stops (exit 2)
naming the file, instead of measuring the KL against another reference."""

from __future__ import annotations

import pytest

from tests.ppo.world import tiny_run, world_of_one


def test_resume_refuses_altered_sft_warmup_weights(tmp_path):
    from ppo.run.checkpoint import CheckpointError, verify_checkpoint

    common = ["trainer.sft_warmup_steps=1", "trainer.total_steps=1", "trainer.save_every=1"]
    with world_of_one():
        tiny_run(tmp_path, *common).trainer(tmp_path).fit()
    warm = tmp_path / "sft_warmup"
    assert (warm / "COMPLETE").exists() and verify_checkpoint(warm) is None
    weights = warm / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, other content
    weights.write_bytes(bytes(data))
    with world_of_one():
        t = tiny_run(tmp_path, *common[:1], "trainer.total_steps=2", "trainer.resume=auto").trainer(tmp_path)
        with pytest.raises(CheckpointError, match="sft_warmup: model.safetensors has other content"):
            t.fit()
