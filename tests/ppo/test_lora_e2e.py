"""LoRA GRPO end to end through torchrun (one rank): the reference is the actor's base (no second model), a
resumed run repeats the straight one's metrics exactly, the checkpoint's PEFT adapter loads in peft on the
base and equals the merged actor directory beside it, and actor.lora.init_from continues from it. The engine
samples the trainer's policy at every step under both actor.lora.sync modes, and receives the adapters' bytes
(adapters; the base once more after the SFT warm-up merged into it) or the merged weights' (merged) per update."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.ppo.test_trainer import _ok, launch, metrics

# a dense reward moves the policy from the first step; two epochs: the old log-probs are recomputed, so the
# engine's are compared with them
LORA = [f"reward.function={Path(__file__).parent / 'dense_rewards.py'}:digit_fraction", "actor.lora.rank=4",
        "actor.lora.alpha=8", "actor.optim.lr=1e-2", "trainer.save_every=1", "actor.ppo_epochs=2"]


def _same(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in b] == [r["step"] for r in a]
    for x, y in zip(a, b):
        for k in x:
            if k.startswith(("timing_s/", "perf/", "mem/", "host/")) or k.endswith("_s"):
                continue
            if k == "reshard/engine_bytes":  # a resumed run's engine gets its base once more
                continue
            assert x[k] == y[k], (x["step"], k, x[k], y[k])


@pytest.mark.distributed
@pytest.mark.slow(seconds=40)
def test_lora_grpo_resumes_exactly_and_exports_a_peft_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    import transformers

    from models.lora import read_peft_adapter

    _ok(launch(tmp_path, 1, "conf/grpo_tiny.yaml", "trainer.total_steps=2", "trainer.experiment_name=straight",
               "trainer.gc_freeze=false", *LORA))
    # resume the straight run's step 1 in a run of its own: step 2 must repeat
    _ok(launch(tmp_path, 1, "conf/grpo_tiny.yaml", "trainer.total_steps=2", "trainer.experiment_name=resumed",
               f"trainer.resume={tmp_path / 'straight' / 'checkpoints' / 'step_1'}", *LORA))
    straight = metrics(tmp_path / "straight")
    _same(straight[1:], metrics(tmp_path / "resumed"))
    log = (tmp_path / "straight" / "logs" / "rank_0.log").read_text()
    # the adapters only: 4 layers x (q, k, v, o: 4 x (64 + 64) + gate, up, down: 4 x (64 + 176)) = 18,688
    assert "optimizer ShardLocalAdamW over 1.87e+04 parameters" in log
    adapter_bytes = 18_688 * 4  # fp32
    assert "actor.lora.sync=adapters (auto:" in log  # the CPU demo's estimate: adapters
    # the base and the adapters once (the warm-up's merge changed the base), then the adapters alone
    assert [row["reshard/engine_bytes"] for row in straight][1:] == [adapter_bytes]
    assert straight[0]["reshard/engine_bytes"] > 10 * adapter_bytes
    _ok(launch(tmp_path, 1, "conf/grpo_tiny.yaml", "trainer.total_steps=2", "trainer.experiment_name=merged",
               "trainer.gc_freeze=false", *LORA, "actor.lora.sync=merged", "trainer.save_every=0"))
    merged_run = metrics(tmp_path / "merged")
    assert {row["reshard/engine_bytes"] for row in merged_run} == {straight[0]["reshard/engine_bytes"] - adapter_bytes}
    for row in straight + merged_run:
        # the engine samples the trainer's policy (old log-probs recomputed: compared each step) ...
        assert row["rollout/logprob_diff_max"] < 1e-5, row
    assert straight[-1]["actor/kl"] != 0.0  # ... which has left the base (the reference) by then

    ckpt = tmp_path / "straight" / "checkpoints" / "step_2"
    spec, adapters = read_peft_adapter(ckpt / "actor_adapter")
    assert spec.rank == 4 and any(t.abs().max() > 0 for n, t in adapters.items() if n.endswith("lora_B"))
    # the base: the SFT warm-up's policy (merged into the base before RL), which the run exported
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "sft_warmup")
    peft_model = peft.PeftModel.from_pretrained(base, str(ckpt / "actor_adapter")).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(ckpt / "actor").eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, merged(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)

    # the adapter out of the run's newest checkpoint, as a user exports it
    from launcher.export import export_checkpoint

    out = export_checkpoint(tmp_path / "straight", tmp_path / "exported", role="actor_adapter")
    assert read_peft_adapter(out)[1].keys() == adapters.keys()

    # continue from the exported adapter: the actor starts with its tensors; its reference is its own base
    from tests.ppo.world import tiny_run, world_of_one

    with world_of_one():
        roles = tiny_run(tmp_path / "cont", f"model.path={tmp_path / 'straight' / 'sft_warmup'}",
                         "model.tokenizer=builtin:char", f"actor.lora.init_from={out}", *LORA,
                         config="conf/grpo_tiny.yaml").trainer().roles
        live = {n: p.detach() for n, p in roles.actor.runner.named_parameters() if "lora_" in n}
        assert live.keys() == adapters.keys() and all(torch.equal(live[n], t) for n, t in adapters.items())
        assert roles.ref_is_actor_base
