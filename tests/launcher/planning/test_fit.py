"""launcher/planning/fit.py: unset memory keys get the cost model's fastest choice that fits the GPU."""

from __future__ import annotations

import copy
from pathlib import Path

from launcher.config.load import load_config
from launcher.planning.fit import BUDGET_CAPS, BUDGET_MEMORY_FRACTION, fit_memory, micro_batch_ladder
from launcher.planning.plan import compute_plan, resolve_model_config

ROOT = Path(__file__).resolve().parents[3]
UNSET = ["actor.offload_optimizer=null", "actor.activation_checkpointing=null"]


def _fit(config: str, *overrides: str):
    cfg = load_config(str(ROOT / "conf" / config), [*UNSET, *overrides])
    model = resolve_model_config(cfg)
    return cfg, fit_memory(cfg, lambda c: compute_plan(c, world_size=1, model=model).predicted)


def test_a_small_model_keeps_everything_on_the_gpu_and_says_so():
    cfg, lines = _fit("bench_grpo_1b.yaml", "trainer.device=cuda")
    assert (cfg.actor.activation_checkpointing, cfg.actor.offload_optimizer) == ("none", False)
    assert {line.split("=")[0] for line in lines} == {"actor.activation_checkpointing", "actor.offload_optimizer"}
    assert all("(auto: the fastest that fits: predicted step" in line for line in lines)
    # GRPO has no critic: nothing fitted, nothing said; forward-only roles have nothing to recompute (no key)
    assert cfg.critic.offload_optimizer is False and not hasattr(cfg.ref, "activation_checkpointing")


def test_a_7b_actor_and_reference_on_one_gpu_recompute_and_stream_adam_from_the_host():
    cfg, lines = _fit("bench_grpo_7b.yaml", "trainer.device=cuda")
    assert (cfg.actor.activation_checkpointing, cfg.actor.offload_optimizer) == ("full", True)
    plan = compute_plan(cfg, world_size=1, model=resolve_model_config(cfg))
    assert plan.predicted["reject"] is None  # the chosen settings fit
    # without recompute it does not fit; with Adam's moments on the GPU it fits, but the KV cache left holds so few
    # sequences that generation runs in many waves: the host moments make the step faster
    cfg.actor.activation_checkpointing = "none"
    assert compute_plan(cfg, world_size=1, model=resolve_model_config(cfg)).predicted["reject"] is not None
    cfg.actor.activation_checkpointing, cfg.actor.offload_optimizer = "full", False
    slower = compute_plan(cfg, world_size=1, model=resolve_model_config(cfg)).predicted
    assert slower["reject"] is None and slower["predicted_step_s"] > plan.predicted["predicted_step_s"]


def test_explicit_settings_win_and_cpu_needs_no_fitting():
    cfg, lines = _fit("bench_grpo_7b.yaml", "trainer.device=cuda", "actor.activation_checkpointing=full")
    assert cfg.actor.activation_checkpointing == "full" and cfg.actor.offload_optimizer is True
    assert [line.split("=")[0] for line in lines] == ["actor.offload_optimizer"]
    cfg, lines = _fit("bench_grpo_7b.yaml", "trainer.device=cpu")
    assert (cfg.actor.activation_checkpointing, cfg.actor.offload_optimizer, lines) == ("none", False, [])


def test_offload_while_generating_keeps_the_optimizer_on_the_gpu_in_the_step():
    """actor.offload_optimizer_while_generating excludes host-streamed Adam moments: the search never picks both."""
    cfg, lines = _fit("bench_grpo_7b.yaml", "trainer.device=cuda", "actor.offload_optimizer_while_generating=true")
    assert cfg.actor.offload_optimizer is False
    assert not any(line.startswith("actor.offload_optimizer=") for line in lines)


def test_a_14b_lora_actor_fits_one_gpu_where_full_parameters_cannot():
    """conf/bench_grpo_qwen3_14b_lora.yaml: the frozen bf16 base, fp32 adapters and no reference weights fit one
    H200; the same run at full parameters (16 bytes/param of training state: 236 GB) is rejected by the plan."""
    cfg = load_config(str(ROOT / "conf" / "bench_grpo_qwen3_14b_lora.yaml"))
    model = resolve_model_config(cfg)
    lines = fit_memory(cfg, lambda c: compute_plan(c, world_size=1, model=model).predicted, cuda=True)
    assert lines[0].startswith("actor.activation_checkpointing=full (auto")  # the config leaves it to the fit
    lora = compute_plan(cfg, world_size=1, model=model).predicted
    assert lora["reject"] is None and lora["peak_gb"] < 139
    cfg.actor.lora.rank = 0
    assert compute_plan(cfg, world_size=1, model=resolve_model_config(cfg)).predicted["reject"] is not None


RECIPE = ["data.task=add:2", "data.train_files=[]", "data.val_files=[]", "trainer.test_freq=0"]


def _recipe(preset: str, *overrides: str, device_gb: float | None = None):
    cfg = load_config(str(ROOT / "conf" / "grpo_gsm8k_qwen3.yaml"), [f"model.preset={preset}", *RECIPE, *overrides])
    model = resolve_model_config(cfg)

    def predict(c):
        return compute_plan(c, world_size=1, model=model).predicted

    return cfg, fit_memory(cfg, predict, cuda=True, device_gb=device_gb), predict


def _budgets(cfg) -> tuple[int, int]:
    return cfg.actor.max_tokens_per_micro_batch, cfg.ref.max_tokens_per_micro_batch


def test_unset_micro_batch_budgets_are_the_largest_that_fit_the_gpu_and_say_so():
    """The recipe leaves its budgets unset: a 0.6B policy on one H200 takes the caps (the budgets it was measured
    with); an 8B policy takes the largest rung of the ladder whose predicted training peak fits 85% of the GPU, and
    the rung above it would not."""
    cfg, lines, predict = _recipe("qwen3-0.6b")
    assert _budgets(cfg) == (BUDGET_CAPS["actor"], BUDGET_CAPS["ref"]) == (16384, 32768)
    said = {line.split("=")[0]: line for line in lines}
    assert "the largest up to 16384 that fits" in said["actor.max_tokens_per_micro_batch"]
    assert "the largest up to 32768 that fits" in said["ref.max_tokens_per_micro_batch"]

    cfg, lines, predict = _recipe("qwen3-8b")
    actor, ref = _budgets(cfg)
    assert 1536 <= actor < 16384 and ref == 2 * actor  # the two roles shrink together along their caps
    chosen = predict(cfg)
    assert chosen["train_peak_gb"] <= BUDGET_MEMORY_FRACTION * chosen["hbm_gb"]
    ladder = micro_batch_ladder(cfg, ["actor", "ref"])
    above = ladder[ladder.index({"actor": actor, "ref": ref}) - 1]
    bigger = copy.deepcopy(cfg)
    bigger.actor.max_tokens_per_micro_batch, bigger.ref.max_tokens_per_micro_batch = above["actor"], above["ref"]
    assert predict(bigger)["train_peak_gb"] > BUDGET_MEMORY_FRACTION * chosen["hbm_gb"]


def test_a_smaller_gpu_gets_smaller_budgets_and_a_miss_is_said():
    """device_gb (NVML's memory at launch) bounds the budgets below the calibration's GPU; where even the longest
    sample's budget does not fit, the smallest is taken and the line says so."""
    big, _, _ = _recipe("qwen3-8b")
    small, lines, _ = _recipe("qwen3-8b", device_gb=80.0)
    assert _budgets(small)[0] < _budgets(big)[0]
    assert small.actor.max_tokens_per_micro_batch == 1536  # data.max_prompt_length 512 + 1,024 response tokens
    assert any(line.startswith("actor.max_tokens_per_micro_batch=1536 (auto: none up to 16384 fits 85% of 80 GB")
               for line in lines)


def test_explicit_budgets_win_and_cpu_takes_its_own():
    cfg, lines, _ = _recipe("qwen3-8b", "actor.max_tokens_per_micro_batch=3000")
    assert cfg.actor.max_tokens_per_micro_batch == 3000
    assert not any(line.startswith("actor.max_tokens") for line in lines)
    assert any(line.startswith("ref.max_tokens_per_micro_batch=") for line in lines)
    cfg = load_config(str(ROOT / "conf" / "grpo_tiny.yaml"), ["trainer.device=cpu"], auto_choices=(choices := []))
    assert _budgets(cfg) == (2048, 8192)  # conf/ppo_tiny.yaml sets the actor's
    assert "ref.max_tokens_per_micro_batch=8192 (auto: no CUDA device" in " ".join(choices)
    assert not any(line.startswith("actor.max_tokens") for line in choices)
