"""LoRA adapters (models/lora.py) against PEFT on transformers: logits with non-zero adapters, gradients only
in the adapters, the base with adapters off, merged weights, and PEFT's adapter directory both ways."""

from __future__ import annotations

import pytest
import torch

from models.lora import (
    LoRASpec,
    adapted_linears,
    adapters_disabled,
    add_adapters,
    freeze_base,
    merged_weight,
    read_peft_adapter,
    resolve_targets,
    save_peft_adapter,
)
from tests.models.hf_fixtures import hf_causal_lm, random_ids, save_hf

peft = pytest.importorskip("peft")

SPEC = LoRASpec(rank=4, alpha=8.0, target_modules=("all-linear",))


def _randomize_adapters(model, *, seed: int) -> None:
    # B starts at zero (the adapted model equals the base): give both factors values, as after training
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, mod in adapted_linears(model):
            mod.lora_A.copy_(0.1 * torch.randn(mod.lora_A.shape, generator=gen))
            mod.lora_B.copy_(0.1 * torch.randn(mod.lora_B.shape, generator=gen))


def _ours_and_peft(tmp_path, kind="qwen3", spec=SPEC, *, trainable=False):
    from models import load_pretrained

    hf = hf_causal_lm(kind, seed=1)
    path = save_hf(hf, tmp_path / "base")
    ours = load_pretrained(path, dtype=torch.float32)
    add_adapters(ours, spec, seed=0)
    _randomize_adapters(ours, seed=2)
    adapter_dir = save_peft_adapter({n: p for n, p in ours.named_parameters() if "lora_" in n}, spec,
                                    tmp_path / "adapter", base_model=path)
    theirs = peft.PeftModel.from_pretrained(hf, str(adapter_dir), is_trainable=trainable).eval()
    return ours, theirs, adapter_dir


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_logits_equal_peft_with_nonzero_adapters(tmp_path, kind):
    ours, theirs, _ = _ours_and_peft(tmp_path, kind)
    ids = random_ids(2, 12)
    with torch.no_grad():
        got, want = ours(ids), theirs(input_ids=ids).logits
        with adapters_disabled(ours), theirs.disable_adapter():
            base_got, base_want = ours(ids), theirs(input_ids=ids).logits
    assert (got - base_got).abs().max() > 1e-2  # the adapters change the output
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(base_got, base_want, rtol=1e-5, atol=1e-5)


def test_gradients_reach_only_adapters_and_equal_peft(tmp_path):
    ours, theirs, _ = _ours_and_peft(tmp_path, trainable=True)
    trainable = freeze_base(ours)
    assert trainable == sum(p.numel() for n, p in theirs.named_parameters() if p.requires_grad)
    ids = random_ids(2, 12)
    ours(ids).logsumexp(-1).mean().backward()
    theirs(input_ids=ids).logits.logsumexp(-1).mean().backward()
    peft_grads = {n.replace("base_model.model.", "").replace(".default.weight", ""): p.grad
                  for n, p in theirs.named_parameters() if p.requires_grad}
    for n, p in ours.named_parameters():
        if "lora_" in n:
            torch.testing.assert_close(p.grad, peft_grads[n], rtol=1e-5, atol=1e-6)
        else:
            assert not p.requires_grad and p.grad is None, n


def test_merged_weights_equal_peft_merge(tmp_path):
    ours, theirs, _ = _ours_and_peft(tmp_path)
    merged = theirs.merge_and_unload().state_dict()
    for name, mod in adapted_linears(ours):
        torch.testing.assert_close(merged_weight(mod), merged[f"{name}.weight"], rtol=1e-5, atol=1e-6)


def test_adapter_directory_round_trip(tmp_path):
    ours, _, adapter_dir = _ours_and_peft(tmp_path)
    spec, tensors = read_peft_adapter(adapter_dir)
    assert spec == LoRASpec(rank=4, alpha=8.0, target_modules=tuple(sorted(SPEC.modules)))
    live = dict(ours.named_parameters())
    assert tensors.keys() == {n for n in live if "lora_" in n}
    for n, t in tensors.items():
        assert torch.equal(t, live[n].detach())


def test_fresh_adapters_start_at_the_base_and_targets_resolve():
    from models import build_model

    model = build_model("tiny", seed=0)
    ids = random_ids(1, 8, vocab=512)
    before = model(ids)
    names = add_adapters(model, LoRASpec(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj")), seed=0)
    assert names == [f"model.layers.{i}.self_attn.{p}" for i in range(4) for p in ("q_proj", "v_proj")]
    assert torch.equal(model(ids), before)  # B = 0
    assert resolve_targets("all-linear") == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj")
    assert resolve_targets(["all-linear", "lm_head"])[-1] == "lm_head"  # the head only when named, as in PEFT
    with pytest.raises(ValueError, match="embed_tokens"):
        resolve_targets(["embed_tokens"])


def test_an_adapted_head_equals_peft_through_the_runners_merged_head(tmp_path):
    """lm_head named in target_modules: logits and gradients equal PEFT's, and the trainer's log-prob head
    (parallel.runner.head_weight: W + alpha/r B @ A, differentiable) gives the forward's logits and gradients."""
    from parallel.runner import head_weight

    spec = LoRASpec(rank=4, alpha=8.0, target_modules=("q_proj", "lm_head"))
    ours, theirs, _ = _ours_and_peft(tmp_path, "qwen3", spec, trainable=True)
    freeze_base(ours)
    ids = random_ids(2, 12)
    got = ours(ids)
    torch.testing.assert_close(got, theirs(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    w, _ = head_weight(ours)
    torch.testing.assert_close(ours.hidden_states(ids) @ w.T, got, rtol=1e-5, atol=1e-5)
    (ours.hidden_states(ids) @ w.T).logsumexp(-1).mean().backward()
    theirs(input_ids=ids).logits.logsumexp(-1).mean().backward()
    peft_grads = {n.replace("base_model.model.", "").replace(".default.weight", ""): p.grad
                  for n, p in theirs.named_parameters() if p.requires_grad}
    head = dict(ours.named_parameters())
    for n in ("lm_head.lora_A", "lm_head.lora_B", "model.layers.0.self_attn.q_proj.lora_B"):
        torch.testing.assert_close(head[n].grad, peft_grads[n], rtol=1e-5, atol=1e-6)
    with adapters_disabled(ours):
        assert torch.equal(head_weight(ours)[0], ours.lm_head.weight)
    tied = hf_causal_lm("qwen3-tied", seed=1)
    from models import load_pretrained

    with pytest.raises(ValueError, match="tied"):
        add_adapters(load_pretrained(save_hf(tied, tmp_path / "tied"), dtype=torch.float32), spec)
