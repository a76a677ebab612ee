"""rollout/vllm_support.py and the config checks of rollout.engine=vllm; no vLLM needed (main suite)."""

from __future__ import annotations

import importlib.util

import pytest

from launcher.config.load import load_config
from launcher.errors import UserError
from rollout.vllm_support import logprobs_mode_for, request_matches_mode, vllm_install_problem
from tests.dist_utils import run_world


def test_logprobs_mode_matches_our_convention():
    # top-k/top-p off: processed log-probs are log softmax(logits / T) for every T (greedy: T = 1)
    for t in (0.0, 0.7, 1.0, 1.3):
        assert logprobs_mode_for(temperature=t, top_k=-1, top_p=1.0) == "processed_logprobs"
    # filtered at T in {0, 1}: processed would be renormalised over the kept set, raw is ours
    assert logprobs_mode_for(temperature=1.0, top_k=20, top_p=1.0) == "raw_logprobs"
    assert logprobs_mode_for(temperature=0.0, top_k=-1, top_p=0.9) == "raw_logprobs"
    with pytest.raises(ValueError, match="renormalis"):
        logprobs_mode_for(temperature=0.7, top_k=20, top_p=1.0)


def test_requests_outside_the_engine_mode_are_named():
    assert request_matches_mode("processed_logprobs", temperature=0.7, top_k=0, top_p=1.0) is None
    assert "renormalised" in request_matches_mode("processed_logprobs", temperature=1.0, top_k=5, top_p=1.0)
    assert request_matches_mode("raw_logprobs", temperature=1.0, top_k=5, top_p=0.9) is None
    assert "temperature=0.5" in request_matches_mode("raw_logprobs", temperature=0.5, top_k=5, top_p=1.0)


def test_version_check():
    assert vllm_install_problem("0.32.0") is None and vllm_install_problem("0.32.3+cpu") is None
    assert "pip install" in vllm_install_problem(None)
    msg = vllm_install_problem("0.11.0")
    assert "0.32.x" in msg and "found 0.11.0" in msg


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this Python")
def test_engine_vllm_without_vllm_is_a_user_error():
    with pytest.raises(UserError, match="vLLM is not installed") as e:
        load_config("conf/ppo_tiny.yaml", ["rollout.engine=vllm"])
    assert "pip install" in str(e.value) and "make install-vllm" in str(e.value)


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.temperature=0.7", "rollout.top_k=20"], "without renormalisation"),
    (["rollout.decode_attention=bmm"], "rollout.decode_attention"),
    (["rollout.share_prompt_kv=false"], "rollout.share_prompt_kv"),
    (["rollout.fold_norms=false"], "rollout.fold_norms"),
])
def test_engine_vllm_config_mismatches_exit_before_launch(monkeypatch, overrides, needle):
    import rollout.vllm_support as support

    monkeypatch.setattr(support, "installed_vllm_version", lambda: "0.32.0")
    load_config("conf/ppo_tiny.yaml", ["rollout.engine=vllm"])  # supported version, matching defaults: fine
    with pytest.raises(UserError, match=needle):
        load_config("conf/ppo_tiny.yaml", ["rollout.engine=vllm", *overrides])
    monkeypatch.setattr(support, "installed_vllm_version", lambda: "0.20.1")
    with pytest.raises(UserError, match="supports vLLM 0.32.x, found 0.20.1"):
        load_config("conf/ppo_tiny.yaml", ["rollout.engine=vllm"])


def _gather(rank, world):
    import torch

    from models import build_model
    from parallel.sharding import tp_slices
    from rollout.vllm_engine import gather_full_tensors

    full = build_model("tiny-hd32", seed=0).state_dict()
    shards = [(k, v[tp_slices(k, tuple(v.shape), rank=rank, world=world)].contiguous()) for k, v in full.items()]
    # 20 KiB buckets: several per layer, so bucket edges fall inside and between tensors
    got = list(gather_full_tensors(iter(shards), group=None if world == 1 else torch.distributed.group.WORLD,
                                   bucket_bytes=20 << 10))
    return [k for k, _ in got] == list(full) and all(torch.equal(t, full[k]) for k, t in got)


@pytest.mark.distributed
def test_update_weights_gathers_tp_shards_into_full_tensors():
    """What VLLMEngine.update_weights streams into vLLM (no vLLM needed): TP=2 shards -> the full tensors."""
    assert run_world(_gather, world_size=2) == [True, True]
