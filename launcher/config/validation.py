"""The checks that refuse a bad config before launch (UserError: the launcher exits with 2), beyond
what the schema's types express. Topology is checked by launcher.planning.plan.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from pathlib import Path
from typing import Any

from launcher.config.schema import (
    CHOICES,
    MODEL_ROLES,
    ROLES,
    AlgorithmConfig,
    Config,
    FilterGroupsConfig,
    OverlongBufferConfig,
    kept_kv_sessions,
    resolved_rollout_correction,
    reward_is_model,
    role_section,
    uses_ref,
)
from launcher.errors import UserError


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for p in dotted.split("."):
        if obj is None:  # an optional section left unset (reward.model): nothing under it to check
            return None
        obj = getattr(obj, p)
    return obj


def validate_config(cfg: Config) -> None:
    """Value checks that the types alone do not express. Topology is checked by launcher.planning.plan."""
    if cfg.model.dtype == "float16":
        raise UserError("model.dtype=float16: fp16 training needs a loss scaler, which hybridrl does not have (its "
                        "updates would underflow or overflow silently); use bfloat16 (the same memory) or float32")
    for key, choices in CHOICES.items():
        v = _get(cfg, key)
        if v is None and (key.endswith(".activation_checkpointing") or key.startswith("reward.model.")):
            continue  # unset: chosen at launch (launcher.planning.fit), or an optional section left unset
        if v not in choices:
            close = difflib.get_close_matches(str(v), choices, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(f"{key}={v!r} is not one of {', '.join(choices)}{hint}")
    _validate_numbers(cfg)
    t, r = cfg.trainer, cfg.rollout
    checks = [
        (t.total_steps >= 1, f"trainer.total_steps({t.total_steps}) must be >= 1"),
        (cfg.data.batch_size >= 1, f"data.batch_size({cfg.data.batch_size}) must be >= 1"),
        (r.n >= 1, f"rollout.n({r.n}) must be >= 1"),
        (r.temperature >= 0, f"rollout.temperature({r.temperature}) must be >= 0"),
        (0 < r.top_p <= 1, f"rollout.top_p({r.top_p}) must be in (0, 1]"),
        (r.max_response_length >= 1, f"rollout.max_response_length({r.max_response_length}) must be >= 1"),
        (cfg.actor.ppo_epochs >= 1, f"actor.ppo_epochs({cfg.actor.ppo_epochs}) must be >= 1"),
        (t.keep_last >= 1, f"trainer.keep_last({t.keep_last}) must be >= 1"),
        (t.max_staleness >= 0, f"trainer.max_staleness({t.max_staleness}) must be >= 0 (0: synchronous, 1: one "
                               f"step off, K: batches generated up to K steps ahead)"),
        (t.total_epochs >= 0, f"trainer.total_epochs({t.total_epochs}) must be >= 0 (0: use trainer.total_steps)"),
        (t.test_freq >= 0, f"trainer.test_freq({t.test_freq}) must be >= 0 (0: validate after the last step only)"),
        (t.log_samples_every >= 0, f"trainer.log_samples_every({t.log_samples_every}) must be >= 0 (0: off)"),
        (t.log_samples_count >= 1, f"trainer.log_samples_count({t.log_samples_count}) must be >= 1"),
        (r.val_n >= 1, f"rollout.val_n({r.val_n}) must be >= 1"),
        (r.val_temperature >= 0, f"rollout.val_temperature({r.val_temperature}) must be >= 0 (0: greedy)"),
        (t.save_every >= 0, f"trainer.save_every({t.save_every}) must be >= 0 (0: no step-based checkpoints)"),
        (t.save_every_minutes >= 0, f"trainer.save_every_minutes({t.save_every_minutes}) must be >= 0 (0: off)"),
        (t.max_nonfinite_steps >= 1, f"trainer.max_nonfinite_steps({t.max_nonfinite_steps}) must be >= 1 (non-finite "
                                     f"steps in a row that stop the run)"),
        (all(isinstance(x, int) and x >= 1 for x in t.profile_steps),
         f"trainer.profile_steps({list(t.profile_steps)}) must list step numbers >= 1 (e.g. [3]; []: off)"),
        (t.dist_timeout_s > 0, f"trainer.dist_timeout_s({t.dist_timeout_s}) must be > 0 seconds: it bounds how "
                               f"long a collective waits for a missing rank"),
        (t.preempt_grace_s >= 0, f"trainer.preempt_grace_s({t.preempt_grace_s}) must be >= 0 (0: no limit)"),
        (t.watchdog_timeout_s >= 0, f"trainer.watchdog_timeout_s({t.watchdog_timeout_s}) must be >= 0 (0: off)"),
        (cfg.reward.timeout_s >= 0, f"reward.timeout_s({cfg.reward.timeout_s}) must be >= 0 (0: no limit)"),
        (0 < cfg.reward.stop_failed_fraction <= 1,
         f"reward.stop_failed_fraction({cfg.reward.stop_failed_fraction}) must be in (0, 1] (1: stop only when "
         f"every sample of a step failed)"),
        (cfg.actor.mini_batch_size >= 0,
         f"actor.mini_batch_size({cfg.actor.mini_batch_size}) must be >= 0 (samples per optimizer step; 0: the "
         f"whole batch)"),
        (cfg.critic.mini_batch_size >= 0,
         f"critic.mini_batch_size({cfg.critic.mini_batch_size}) must be >= 0 (samples per optimizer step; 0: the "
         f"whole batch)"),
        (cfg.critic.ppo_epochs >= 1, f"critic.ppo_epochs({cfg.critic.ppo_epochs}) must be >= 1"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)
    _validate_roles_keys(cfg)
    d = cfg.data
    # recipes for real models and data say preset/task "none": forgetting the path is an error, not a toy run
    if cfg.model.path is None and cfg.model.preset == "none":
        raise UserError("model.path is required (model.preset=none: no random initialisation); "
                        "set model.path=<Hugging Face model directory>")
    if not d.train_files and d.task == "none":
        raise UserError("data.train_files is required (data.task=none: no synthetic task); "
                        "set data.train_files=train.parquet (or [a.parquet,b.parquet])")
    # validation and sample-log keys act only with their switch: set without it, they are refused
    unused = [(key, value) for key, value, default, active in (
        ("trainer.test_freq", t.test_freq, 0, d.val_files), ("rollout.val_n", r.val_n, 1, d.val_files),
        ("rollout.val_temperature", r.val_temperature, 0.0, d.val_files),
        ("reward.pass_threshold", cfg.reward.pass_threshold, 1.0, d.val_files),
        ("trainer.log_samples_count", t.log_samples_count, 4, t.log_samples_every)) if value != default and not active]
    for key, value in unused:
        switch = "trainer.log_samples_every" if key == "trainer.log_samples_count" else "data.val_files"
        example = "10" if switch == "trainer.log_samples_every" else "[val.parquet]"
        raise UserError(f"{key}={value} acts only with {switch}, which is not set; set {switch}={example} "
                        f"or remove {key}")
    if r.val_n > 1 and r.val_temperature == 0:
        raise UserError(f"rollout.val_n={r.val_n} with rollout.val_temperature=0 (greedy) draws {r.val_n} identical "
                        f"samples; set rollout.val_temperature=1.0 (for pass@{r.val_n}) or rollout.val_n=1")
    if d.sft_answer_key and not (t.sft_warmup_steps and d.train_files):
        raise UserError(f"data.sft_answer_key={d.sft_answer_key!r} is read by the SFT warm-up on data.train_files "
                        f"only; set trainer.sft_warmup_steps>0 and data.train_files, or remove data.sft_answer_key")
    if cfg.algorithm.name in ("grpo", "rloo") and r.n < 2:
        raise UserError(f"algorithm.name={cfg.algorithm.name} compares samples of one prompt: "
                        f"set rollout.n >= 2 (got {r.n})")
    _validate_algorithm_variants(cfg)
    if t.share_prompts and (cfg.actor.pp > 1 or cfg.ref.pp > 1):
        raise UserError(f"trainer.share_prompts packs a prompt once with its responses, which pipeline micro-batches "
                        f"cannot (actor.pp={cfg.actor.pp}, ref.pp={cfg.ref.pp}); set trainer.share_prompts=false or "
                        f"pp=1")
    if cfg.actor.offload_optimizer and cfg.actor.offload_optimizer_while_generating:
        raise UserError("actor.offload_optimizer=true keeps the optimizer states in host memory all the time, so "
                        "actor.offload_optimizer_while_generating=true (move them there while generating) has nothing "
                        "to move; set actor.offload_optimizer_while_generating=false")
    _validate_lora(cfg)  # first: a LoRA actor on megatron is refused for its LoRA, whatever the device
    for role in MODEL_ROLES:
        _validate_megatron_role(cfg, role)
    if t.resume not in ("never", "auto") and not Path(t.resume).exists():
        raise UserError(f"trainer.resume={t.resume!r}: no such checkpoint directory (use never, auto or a path)")
    if cfg.model.path is not None and not Path(cfg.model.path).is_dir():
        raise UserError(f"model.path={cfg.model.path!r} is not a directory holding config.json and *.safetensors "
                        f"(set model.path=<Hugging Face model directory>)")
    if reward_is_model(cfg) and not cfg.reward.model.path and cfg.model.path:
        # a random-initialised reward model only makes sense next to a random-initialised policy (benchmarks)
        raise UserError("reward.model needs reward.model.path (a *ForSequenceClassification directory) beside "
                        "model.path")
    if r.batches_in_flight < 1:
        raise UserError(f"rollout.batches_in_flight({r.batches_in_flight}) must be >= 1 (1: no over-provisioning)")
    if r.batches_in_flight > 1 and cfg.trainer.max_staleness < 1:
        raise UserError(f"rollout.batches_in_flight={r.batches_in_flight} trains groups whose tokens span weight "
                        f"versions, which needs a staleness bound: set trainer.max_staleness >= 1 (the oldest "
                        f"token of a trained group is at most that many steps old)")
    if cfg.trainer.stale_policy not in ("pace", "drop"):
        raise UserError(f"trainer.stale_policy={cfg.trainer.stale_policy!r} must be pace or drop")
    if cfg.trainer.stale_policy == "drop" and r.batches_in_flight < 2:
        raise UserError(f"trainer.stale_policy=drop drops groups in flight that would be trained more than "
                        f"trainer.max_staleness steps old; without partial rollouts (rollout.batches_in_flight="
                        f"{r.batches_in_flight}) no group stays in flight across steps (batches generated ahead are "
                        f"within the bound by construction), so nothing could be dropped: set "
                        f"rollout.batches_in_flight >= 2 (and trainer.max_staleness >= 1) or trainer.stale_policy=pace")
    if cfg.trainer.stale_policy == "pace" and r.batches_in_flight > 2:
        # groups admitted at or before step k - K: (B_f + k - K) x B, of which (k - K + 1) x B were surely trained by
        # step k, so up to (B_f - 1) x B are due at step k, which trains B: more than B at B_f >= 3
        raise UserError(f"rollout.batches_in_flight={r.batches_in_flight} with trainer.stale_policy=pace can leave "
                        f"more groups due (admitted trainer.max_staleness steps ago) than a step trains, and those "
                        f"would be trained past the bound: set rollout.batches_in_flight=2, or "
                        f"trainer.stale_policy=drop (the groups past the bound dropped and counted)")
    if r.partial_kv not in ("recompute", "keep"):
        raise UserError(f"rollout.partial_kv={r.partial_kv!r}: choose recompute or keep")
    if r.partial_kv == "keep" and r.batches_in_flight < 2:
        raise UserError("rollout.partial_kv=keep acts only on partial rollouts: set rollout.batches_in_flight >= 2, or "
                        "remove rollout.partial_kv")
    if r.partial_kv == "keep" and r.free_memory_on_sleep is not False:
        raise UserError("rollout.partial_kv=keep keeps the KV of samples in flight across the training step, which "
                        "needs the KV cache resident: set rollout.free_memory_on_sleep=false (the engine frees its "
                        "cache on sleep otherwise, and every sample would re-prefill)")
    if r.decode_beside and r.batches_in_flight < 2:
        raise UserError("rollout.decode_beside keeps the groups in flight of partial rollouts decoding while the step "
                        "trains: set rollout.batches_in_flight=2 (and trainer.max_staleness >= 1), or remove it")
    if r.decode_beside and cfg.trainer.stale_policy == "drop":
        raise UserError("rollout.decode_beside keeps groups decoding after generation, where trainer.stale_policy=drop "
                        "decides which to drop: use trainer.stale_policy=pace, or remove rollout.decode_beside")
    if r.decode_beside and r.free_memory_on_sleep is True:
        raise UserError("rollout.decode_beside needs the engine's KV cache kept while training, and "
                        "rollout.free_memory_on_sleep=true frees it: set it false, or leave it unset (decided after "
                        "the first step)")
    if r.engine != "native" and r.partial_kv == "keep":
        raise UserError(f"rollout.partial_kv=keep parks the KV of samples in flight in the native engine's slots; "
                        f"{r.engine} keeps none across a weight swap (vLLM resets its prefix cache with the weights): "
                        f"use rollout.engine=native, or remove rollout.partial_kv (recompute)")
    if r.engine != "native" and r.decode_beside:
        raise UserError(f"rollout.decode_beside steps the native engine on a thread and CUDA stream of its own beside "
                        f"training; {r.engine} is not stepped there: use rollout.engine=native, or remove "
                        f"rollout.decode_beside")
    if r.engine == "vllm":
        _validate_vllm(cfg)
    _validate_agent(cfg)
    if r.max_parked_seqs is not None and r.max_parked_seqs < 0:
        raise UserError(f"rollout.max_parked_seqs={r.max_parked_seqs} must be >= 0")
    if r.max_parked_seqs and not kept_kv_sessions(cfg):
        raise UserError(f"rollout.max_parked_seqs={r.max_parked_seqs} acts only where the native engine keeps KV "
                        "between turns (rollout.engine=native with a multi-turn agent loop and agent.keep_kv, or "
                        "rollout.partial_kv=keep): nothing parks here; remove rollout.max_parked_seqs")
    for pool in cfg.placement.pools:
        for role in pool.roles:
            if role not in ROLES:
                close = difflib.get_close_matches(role, ROLES, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise UserError(f"placement.pools: unknown role {role!r}{hint}; roles: {', '.join(ROLES)}")
        if pool.size < 1:
            raise UserError(f"placement.pools: size must be >= 1, got {pool.size} for roles {pool.roles}")


def _walk(node: Any, prefix: str = ""):
    """(dotted key, value) of every leaf of the config tree (dataclasses and lists of them)."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            yield from _walk(getattr(node, f.name), f"{prefix}{f.name}.")
    elif isinstance(node, list | tuple):
        for i, item in enumerate(node):
            yield from _walk(item, f"{prefix[:-1]}[{i}].")
    else:
        yield prefix[:-1], node


def _validate_numbers(cfg: Config) -> None:
    """No key holds nan or inf (lr=nan would train nothing and log nothing), and every micro-batch token budget is
    >= 1 (0 packs no sample and never ends)."""
    for key, v in _walk(cfg):
        if isinstance(v, float) and not math.isfinite(v):
            raise UserError(f"{key}={v} is not a finite number")
        if key.endswith("max_tokens_per_micro_batch") and isinstance(v, int) and v < 1:
            raise UserError(f"{key}({v}) must be >= 1 tokens (the budget of one packed micro-batch)")


def _validate_algorithm_variants(cfg: Config) -> None:
    """DAPO / GSPO / Dr. GRPO / rollout-correction keys: each acts in this setting, or is refused."""
    a, r = cfg.algorithm, cfg.rollout
    default = AlgorithmConfig()
    mode = resolved_rollout_correction(cfg)
    if "tis" not in mode and a.rollout_is_cap != default.rollout_is_cap:
        raise UserError(f"algorithm.rollout_is_cap={a.rollout_is_cap} acts only with algorithm.rollout_correction=tis "
                        f"or tis+seq_mask (it is {a.rollout_correction} -> {mode})")
    if "seq_mask" not in mode and a.rollout_mask_threshold != default.rollout_mask_threshold:
        raise UserError(f"algorithm.rollout_mask_threshold={a.rollout_mask_threshold} acts only with "
                        f"algorithm.rollout_correction=seq_mask or tis+seq_mask (it is {a.rollout_correction})")
    if a.rollout_is_cap <= 1.0:
        raise UserError(f"algorithm.rollout_is_cap({a.rollout_is_cap}) must be > 1 (a cap at or below 1 "
                        f"down-weights every token)")
    if a.rollout_mask_threshold <= 1.0:
        raise UserError(f"algorithm.rollout_mask_threshold({a.rollout_mask_threshold}) must be > 1: it bounds "
                        f"the geometric-mean ratio to [1/threshold, threshold]")
    fg, ob = a.filter_groups, a.overlong_buffer
    if fg.enable:
        if r.n < 2:
            raise UserError(f"algorithm.filter_groups.enable drops groups whose rollout.n samples scored the same: "
                            f"set rollout.n >= 2 (got {r.n})")
        if cfg.trainer.max_staleness:
            raise UserError(f"algorithm.filter_groups.enable regenerates within the step, which "
                            f"trainer.max_staleness={cfg.trainer.max_staleness} (batches generated ahead) cannot; "
                            f"set trainer.max_staleness=0 or turn dynamic sampling off")
        if fg.max_num_gen_batches < 1:
            raise UserError(f"algorithm.filter_groups.max_num_gen_batches({fg.max_num_gen_batches}) must be >= 1")
    elif fg.max_num_gen_batches != FilterGroupsConfig().max_num_gen_batches:
        raise UserError("algorithm.filter_groups.max_num_gen_batches acts only with "
                        "algorithm.filter_groups.enable=true")
    if ob.enable:
        if not 0 < ob.len <= r.max_response_length:
            raise UserError(f"algorithm.overlong_buffer.len({ob.len}) must be in (0, rollout.max_response_length="
                            f"{r.max_response_length}]")
    elif ob != OverlongBufferConfig():
        raise UserError("algorithm.overlong_buffer.len / penalty_factor act only with "
                        "algorithm.overlong_buffer.enable=true")
    if not a.norm_adv_by_std and a.name != "grpo":
        raise UserError(f"algorithm.norm_adv_by_std=false acts only with algorithm.name=grpo (Dr. GRPO); "
                        f"{a.name} does not divide by a group std")


def _validate_agent(cfg: Config) -> None:
    """Agent loops: the files import and define what they must, the default loop exists, the limits are sane.
    Both engines have the step API the loops run on."""
    from ppo.agents.loop import AgentLoopError
    from ppo.agents.registry import build_registry

    g = cfg.agent
    for ok, msg in ((g.max_turns >= 1, f"agent.max_turns({g.max_turns}) must be >= 1"),
                    (g.max_tool_response_tokens >= 1,
                     f"agent.max_tool_response_tokens({g.max_tool_response_tokens}) must be >= 1"),
                    (g.tool_timeout_s > 0, f"agent.tool_timeout_s({g.tool_timeout_s}) must be > 0 seconds"),
                    (g.tool_workers >= 1, f"agent.tool_workers({g.tool_workers}) must be >= 1")):
        if not ok:
            raise UserError(msg)
    if (g.tools_file or g.loop_file) and cfg.rollout.batches_in_flight > 1:
        raise UserError(f"rollout.batches_in_flight={cfg.rollout.batches_in_flight} (partial rollouts) continues "
                        "single responses across weight swaps; agent loops (agent.tools_file / agent.loop_file) do not "
                        "run there yet: set rollout.batches_in_flight=1")
    if not g.keep_kv and not (g.tools_file or g.loop_file):
        raise UserError("agent.keep_kv=false acts only on multi-turn loops (agent.tools_file / agent.loop_file): plain "
                        "generation never continues a response, so there is no KV to keep; remove agent.keep_kv")
    if not g.keep_kv and cfg.rollout.engine != "native":
        raise UserError(f"agent.keep_kv=false acts only with rollout.engine=native (the engine that keeps a "
                        f"trajectory's KV between turns); rollout.engine={cfg.rollout.engine} has nothing to turn off: "
                        "remove agent.keep_kv")
    if not g.tools_file:
        tool_keys = [k for k, v, d in (("agent.max_turns", g.max_turns, 4),
                                       ("agent.max_tool_response_tokens", g.max_tool_response_tokens, 256),
                                       ("agent.tool_timeout_s", g.tool_timeout_s, 30.0),
                                       ("agent.tool_workers", g.tool_workers, 8)) if v != d]
        if tool_keys:
            raise UserError(f"{tool_keys[0]} acts only with agent.tools_file, which is not set; set "
                            f"agent.tools_file=tools.py or remove {tool_keys[0]}")
    try:
        registry = build_registry(default=g.default, tools_file=g.tools_file, loop_file=g.loop_file,
                                  max_turns=g.max_turns, max_tool_response_tokens=g.max_tool_response_tokens)
    except AgentLoopError as e:
        raise UserError(str(e)) from None
    if g.default not in registry.loops:
        raise UserError(f"agent.default={g.default!r} is not a loop: the loops are {sorted(registry.loops)} "
                        "(agent.tools_file adds 'tool', agent.loop_file its AGENT_LOOPS)")
    if g.default == "tool" and cfg.trainer.sft_warmup_steps and registry.sft_turns is None:
        raise UserError(f"trainer.sft_warmup_steps={cfg.trainer.sft_warmup_steps} with agent.default=tool trains on "
                        f"tool-use demonstrations: define SFT_TURNS(prompt, answer) -> [assistant turn texts] in "
                        f"{g.tools_file}, or set trainer.sft_warmup_steps=0")


def _validate_vllm(cfg: Config) -> None:
    """rollout.engine=vllm: vLLM installed in a supported version, a log-prob convention that matches ours,
    and no key that only the native engine reads."""
    from rollout.vllm_support import installed_vllm_version, logprobs_mode_for, vllm_install_problem

    r = cfg.rollout
    problem = vllm_install_problem(installed_vllm_version())
    if problem is not None:
        raise UserError(problem)
    try:
        logprobs_mode_for(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)
    except ValueError as e:
        raise UserError(str(e)) from None
    if r.decode_attention != "auto":
        raise UserError(f"rollout.decode_attention={r.decode_attention!r} selects a native-engine kernel; vLLM picks "
                        "its own attention backend: leave it at auto with rollout.engine=vllm")
    if not r.share_prompt_kv:
        raise UserError("rollout.share_prompt_kv=false turns off a native-engine kernel feature; vLLM shares prompt "
                        "KV through its own prefix cache: leave it at true with rollout.engine=vllm")
    if r.kv_cache_dtype != "auto":
        raise UserError(f"rollout.kv_cache_dtype={r.kv_cache_dtype} is the native engine's cache layout (fp8 values "
                        f"with per-token, per-head scales); the vLLM backend is not wired for it: use "
                        f"rollout.engine=native or leave kv_cache_dtype at auto")
    if not r.fold_norms:
        raise UserError("rollout.fold_norms=false turns off a native-engine feature; vLLM runs its own fused norms: "
                        "leave it at true with rollout.engine=vllm")


def _validate_lora(cfg: Config) -> None:
    """actor.lora: its keys act only with rank > 0; the layouts where adapters run (native backend; a reference
    that is the actor's own base, so it shares the actor's ranks and layout); an init_from adapter that fits."""
    from models.lora import read_peft_adapter, resolve_targets
    from rollout.vllm_support import VLLM_MAX_LORA_RANK

    lo, a = cfg.actor.lora, cfg.actor
    default = type(lo)()
    if lo.rank < 0:
        raise UserError(f"actor.lora.rank({lo.rank}) must be >= 0 (0: full-parameter training)")
    if lo.rank == 0:
        for key in ("alpha", "dropout", "target_modules", "init_from", "sync"):
            if getattr(lo, key) != getattr(default, key):
                raise UserError(f"actor.lora.{key}={getattr(lo, key)!r} acts only with LoRA on; set actor.lora.rank>0 "
                                f"(e.g. 16) or remove actor.lora.{key}")
        return
    try:
        targets = resolve_targets(list(lo.target_modules))
    except ValueError as e:
        raise UserError(f"actor.lora.target_modules: {e}") from None
    checks = [
        (lo.alpha > 0, f"actor.lora.alpha({lo.alpha}) must be > 0 (the adapters' scale is alpha / rank)"),
        (0 <= lo.dropout < 1, f"actor.lora.dropout({lo.dropout}) must be in [0, 1)"),
        (lo.sync != "adapters" or cfg.rollout.engine != "vllm" or lo.rank <= VLLM_MAX_LORA_RANK,
         f"actor.lora.sync=adapters with rollout.engine=vllm: vLLM serves adapters of rank <= {VLLM_MAX_LORA_RANK}, "
         f"not {lo.rank}; set actor.lora.sync=merged or auto"),
        (lo.dropout == 0 or "lm_head" not in targets, f"actor.lora.dropout={lo.dropout} with lm_head targeted: the "
                                                      "trainer applies the head as one merged weight, with no input to "
                                                      "drop; set actor.lora.dropout=0 or leave lm_head out"),
        (a.backend == "native", "actor.lora needs actor.backend=native: the megatron backend has no LoRA adapters; "
                                "set actor.backend=native or actor.lora.rank=0"),
        (lo.dropout == 0 or a.tp == 1, f"actor.lora.dropout={lo.dropout} with actor.tp={a.tp}: the tensor-parallel "
                                       "ranks would draw different masks of one input; set actor.lora.dropout=0 "
                                       "or actor.tp=1"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)
    if uses_ref(cfg):
        r = cfg.ref
        keys = ("tp", "pp", "dp", "backend", "compile", "pp_microbatches", "pp_schedule", "pp_stages_per_rank")
        differ = [f"ref.{k}={getattr(r, k)} vs actor.{k}={getattr(a, k)}" for k in keys
                  if getattr(r, k) != getattr(a, k)]
        if differ:
            raise UserError(f"actor.lora: the reference is the actor's base with its adapters off (no second model), "
                            f"so it runs in the actor's layout; {', '.join(differ)}: remove the ref layout keys")
        if cfg.placement.mode != "colocated":
            raise UserError(f"actor.lora with a reference: placement.mode={cfg.placement.mode} would place the "
                            f"reference on other ranks, but it is the actor's own base; use placement.mode=colocated")
    if lo.init_from is not None:
        try:
            spec, _ = read_peft_adapter(lo.init_from)
        except (ValueError, OSError, KeyError) as e:
            raise UserError(f"actor.lora.init_from={lo.init_from!r}: {e}") from None
        mine = (lo.rank, float(lo.alpha), tuple(sorted(targets)))
        theirs = (spec.rank, spec.alpha, tuple(sorted(spec.modules)))
        if mine != theirs:
            raise UserError(f"actor.lora.init_from={lo.init_from!r} holds r={spec.rank}, alpha={spec.alpha}, targets "
                            f"{list(theirs[2])}; set actor.lora.rank/alpha/target_modules to match")


def _validate_megatron_role(cfg: Config, role: str) -> None:
    """`<role>.backend: megatron` settings megatron-core cannot run, refused before any process starts
    (the layout checks that need the model's shape are in launcher.planning.plan)."""
    sec = role_section(cfg, role)
    if sec is None or sec.backend != "megatron":
        return
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        raise UserError(f"{role}.backend=megatron needs megatron-core: pip install -e .[megatron] "
                        "(megatron-core==0.16.1)") from None
    trains = role in ("actor", "critic")
    import torch

    on_cpu = cfg.trainer.device == "cpu" or (cfg.trainer.device == "auto" and not torch.cuda.is_available())
    if on_cpu and (trains or sec.pp > 1):
        what = "training (its DDP buffers, distributed optimizer and schedules)" if trains else "pp > 1 (its schedules)"
        device = "cpu" if cfg.trainer.device == "cpu" else "auto with no GPU visible"
        raise UserError(f"{role}.backend=megatron: megatron-core {what} needs CUDA, and trainer.device is "
                        f"{device}; use {role}.backend=native on CPU")
    ac = getattr(sec, "activation_checkpointing", None)  # the trained roles' (a forward-only role has none)
    refused = [
        (sec.compile and ac == "full", f"{role}.compile=true with activation_checkpointing=full",
         "megatron's full recompute wraps the layers itself and is not tested compiled; use one of the two"),
        (ac == "selective", f"{role}.activation_checkpointing=selective",
         "megatron's selective recompute targets its own core attention; use none or full"),
        (sec.pp_stages_per_rank != 1, f"{role}.pp_stages_per_rank={sec.pp_stages_per_rank}",
         "virtual pipeline stages are not wired for megatron; use 1"),
        (sec.pp_schedule != "1F1B", f"{role}.pp_schedule={sec.pp_schedule}",
         "megatron-core's schedule for pp > 1 is 1F1B; use 1F1B"),
        (sec.pp_microbatches != 0, f"{role}.pp_microbatches={sec.pp_microbatches}",
         "megatron's schedules run the token-budget micro-batches (any count, any lengths); leave it 0"),
        (trains and getattr(sec, "offload_optimizer", False), f"{role}.offload_optimizer=true",
         "host-resident Adam moments are the native backend's (parallel/offload_optim.py); set it to false"),
    ]
    for bad, key, fix in refused:
        if bad:
            raise UserError(f"{role}.backend=megatron: {key} is not supported: {fix}")


def _validate_roles_keys(cfg: Config) -> None:
    """Keys that would be accepted and ignored: the engine's sizing keys out of range, and the rule function's
    keys beside a reward model (which neither calls a function nor fails)."""
    from rollout.base import RolloutConfig

    r = cfg.rollout
    try:  # the engine's own checks, once, before launch
        sizing = {k: getattr(r, k) for k in ("gpu_memory_fraction", "max_num_seqs") if getattr(r, k) is not None}
        RolloutConfig(decode_attention=r.decode_attention, **sizing).validate()  # unset: resolved later (auto)
    except ValueError as e:
        raise UserError(f"rollout.{e}") from None
    if reward_is_model(cfg):
        default = type(cfg.reward)()
        for key in ("function", "signature", "default_score", "timeout_s", "stop_failed_fraction"):
            if getattr(cfg.reward, key) != getattr(default, key):
                raise UserError(f"reward.{key}={getattr(cfg.reward, key)!r} configures the rule function, and "
                                f"reward.model is set (a reward model neither calls a function nor fails); remove "
                                f"one of the two")
