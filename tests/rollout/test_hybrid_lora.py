"""A LoRA actor's engine samples from the updated policy after every update: in a TP=2 gloo world, after each
adapter step the hybrid engine's greedy tokens and log-probs equal the trainer's own forward (the adapted model),
and differ from the base's, so an adapter that never reached the engine would fail here. Both sync modes: merged
weights every update, or (the engine applying the adapters) the base once and then the adapters alone."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_world

PROMPTS = [[1, 5, 9, 22], [1, 300, 7], [1, 42]]


def _trainer_view(model, prompt, tokens):
    """The trainer's greedy choices and log-probs of `tokens` after `prompt` (one forward of the adapted model)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0, len(prompt) - 1:-1].float(), -1)
    return logp.argmax(-1).tolist(), logp.gather(1, torch.tensor(tokens)[:, None])[:, 0]


def _body(rank, world, sync):
    import torch.nn.functional as F

    from models import build_model
    from models.lora import LoRASpec, adapters_disabled
    from parallel.apply import parallelize_model
    from parallel.dims import ParallelDims, build_mesh
    from parallel.reshard import GenLayout
    from parallel.reshard_exec import build_reshard_groups
    from rollout.base import RolloutConfig, SamplingParams
    from rollout.engine import NativeEngine
    from rollout.hybrid import HybridEngine

    dims = ParallelDims(tp=2)
    spec = LoRASpec(rank=4, alpha=8.0, target_modules=("all-linear", "lm_head"))  # the vocab-parallel head too
    runner = parallelize_model(build_model("tiny", seed=0), mesh=build_mesh(dims, [0, 1], device_type="cpu"),
                               dims=dims, lora=spec)
    model = runner.modules[0]
    opt = runner.build_optimizer(lr=3e-2, betas=(0.9, 0.999), weight_decay=0.0)
    gen = GenLayout.for_world(world, tp=2)
    groups = build_reshard_groups((dims, gen), [0, 1])
    engine = NativeEngine(model.config, tp_group=groups.gen_tp_group,
                          config=RolloutConfig(max_model_len=64, max_num_seqs=8, kv_cache_tokens=512, block_size=16,
                                               enable_cuda_graph=False, drop_weights_on_sleep=sync == "merged"),
                          lora=spec if sync == "adapters" else None)
    hybrid = HybridEngine(runner, engine, train_layout=dims, gen_layout=gen, groups=groups, bucket_bytes=16 << 10,
                          offload_optimizer_while_generating=False, lora=spec, lora_sync=sync)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ids = torch.randint(3, 512, (4, 12), generator=torch.Generator().manual_seed(1))
    out = []
    for update in range(3):
        logits = model(ids[:, :-1])  # an adapter step towards a fixed batch: the policy moves every update
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)).backward()
        runner.optimizer_step(opt, max_norm=1.0)
        opt.zero_grad(set_to_none=True)
        res = hybrid.generate(PROMPTS, greedy)
        step = {"bytes": res.engine_bytes, "base_differs": False}
        for p, c in zip(PROMPTS, res.completions):
            choices, logp = _trainer_view(model, p, c.token_ids)
            assert choices == c.token_ids, (update, p, choices, c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs), logp, rtol=0, atol=1e-5)
            with adapters_disabled(model):
                base_choices, base_logp = _trainer_view(model, p, c.token_ids)
            step["base_differs"] |= base_choices != choices or (base_logp - logp).abs().max().item() > 1e-2
        out.append(step)
    # merged: this rank's TP shard of every weight, adapted ones merged, no adapter tensor; adapters: its TP shard
    # of the base (the first update only) and of the adapters (gen layout = training layout here)
    assert not any("lora_" in n for n in runner.training_shards())
    base, adapters = runner.lora_shards()
    out.append([sum(t.numel() * t.element_size() for t in d.values()) for d in (base, adapters)])
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("sync", ["merged", "adapters"])
def test_engine_samples_the_updated_lora_policy_after_every_update(sync):
    results = run_world(_body, 2, (sync,))
    for *steps, (base_bytes, adapter_bytes) in results:
        assert all(s["base_differs"] for s in steps)  # the adapters matter: the base would fail the check
        sent = [s["bytes"] for s in steps]  # reported per update (reshard/engine_bytes)
        if sync == "merged":
            assert sent == [base_bytes] * 3  # the merged weights' bytes, every update
        else:
            assert sent == [base_bytes + adapter_bytes, adapter_bytes, adapter_bytes]
            assert adapter_bytes < base_bytes / 5  # r 4 on hidden 64: about a tenth
