"""Loading owned shards equals slicing the full model: PP stages, tied heads, shape errors.

The distributed cases run inside other worlds to save process start-up: TP shards against
parallel/sharding.py's slices in test_tp.py, 2-D (FSDP over TP) shards in test_fsdp.py.
"""

from __future__ import annotations

import pytest
import torch

from models import build_model, preset_config
from parallel.loading import load_sharded_weights, local_slices
from parallel.pipeline import split_stage


def test_pp_stage_loads_only_its_names(tmp_path):
    from models.hf_io import save_pretrained

    ref = build_model("tiny", seed=0)
    save_pretrained(ref, tmp_path)
    full = dict(ref.named_parameters())
    for s in range(2):
        stage = split_stage(build_model("tiny", seed=9), num_stages=2, stage=s)
        names = load_sharded_weights(stage, tmp_path)
        assert set(names) == {n for n, _ in stage.named_parameters()}
        for n, p in stage.named_parameters():
            torch.testing.assert_close(p.detach(), full[n].detach(), rtol=0, atol=0, msg=n)
    assert local_slices(full["model.norm.weight"]) == (slice(None),)


def test_tied_checkpoint_fills_last_stage_head(tmp_path):
    from models.hf_io import save_pretrained

    cfg = preset_config("tiny", tie_word_embeddings=True)
    ref = build_model(cfg, seed=0)
    save_pretrained(ref, tmp_path)
    stage = split_stage(build_model(preset_config("tiny"), seed=4), num_stages=2, stage=1)
    load_sharded_weights(stage, tmp_path)
    torch.testing.assert_close(stage.lm_head.weight.detach(), ref.model.embed_tokens.weight.detach(), rtol=0, atol=0)


def test_strict_reports_shape_mismatch(tmp_path):
    from models.hf_io import save_pretrained

    save_pretrained(build_model("tiny", seed=0), tmp_path)
    other = build_model(preset_config("tiny", intermediate_size=128), seed=0)
    with pytest.raises(ValueError, match="checkpoint shape"):
        load_sharded_weights(other, tmp_path)
