"""Step time and memory of a placement, from the stage costs of launcher/planning/costmodel.py.

    est = estimate(workload, calibration, candidate)
    est.step_s, est.samples_per_s, est.stages, est.pool_utilization(), est.peak_gb, est.reject

The phases follow ppo/trainer/step.py's `step()`:
    sync:  generate (actor pool) | score (every pool its own stages) | advantages | update (every pool)
    async: score batch k on every pool while the actor pool generates batch k+1 | advantages | update
A phase lasts as long as its slowest pool (colocated: one pool, so every stage runs in sequence).
Memory per GPU of each pool: training states, frozen weights, the engine's weights and KV cache,
and the largest activation working set; the engine's share is freed while training unless
rollout.free_memory_on_sleep=false.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.planning.costmodel import (
    BF16,
    OFFLOADED_BYTES_PER_PARAM,
    TRAINED_BYTES_PER_PARAM,
    Calibration,
    Candidate,
    ModelShape,
    Workload,
    generation_s,
    host_s,
    kv_slots,
    model_pass_s,
    reshard_s,
    transfer_s,
)
from ppo.roles.generation import RESIDENT_FRACTION

SCORE_STAGES = ("old_log_prob", "ref", "values", "reward")
UPDATE_STAGES = ("update_actor", "update_critic")
# a chunk of the chunked log-prob (models/logprobs.py) as its torch path's fp32 copies at 4096 tokens: an upper
# bound of both paths (the fused one holds 4096 x V in bf16, the torch one 1024 x V fp32 copies)
LOGITS_CHUNK = 4096


@dataclass(slots=True)
class Estimate:
    candidate: Candidate
    stages: dict[str, float]  # seconds per stage (timing_s/<stage> names, plus "transfer")
    step_s: float
    samples: int
    busy_s: list[float]  # per pool: seconds its GPUs compute per step
    useful_flops: float
    peak_gb: list[float]  # per pool: peak memory per GPU
    train_peak_gb: list[float]  # per pool: training's peak per GPU (states and activations; an engine kept resident)
    memory: list[dict[str, float]]  # per pool: GB per GPU by item
    reject: str | None = None
    kv_reject: str | None = None  # the engine's KV budget holds no sequence of the longest sample (with numbers)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.step_s

    def pool_utilization(self) -> list[float]:
        return [b / self.step_s for b in self.busy_s]

    def useful_utilization(self, cal: Calibration) -> float:
        return self.useful_flops / (self.step_s * self.candidate.world_size * cal.peak_flops)

    def summary(self, cal: Calibration) -> dict:
        c = self.candidate
        return {"plan": c.describe(), "mode": c.mode, "async": c.is_async,
                "pools": [{"roles": list(r), "gpus": n, "utilization": round(u, 3), "peak_gb": round(g, 1)}
                          for (r, n), u, g in zip(c.pools, self.pool_utilization(), self.peak_gb)],
                "layouts": {r: {"tp": t, "pp": p, "dp": d} for r, (t, p, d) in c.layouts}, "gen_tp": c.gen_tp,
                "predicted_step_s": round(self.step_s, 4), "samples_per_s": round(self.samples_per_s, 2),
                "useful_utilization": round(self.useful_utilization(cal), 4),
                "peak_gb": round(max(self.peak_gb), 1), "train_peak_gb": round(max(self.train_peak_gb), 2),
                "hbm_gb": cal.hbm_gb,
                "stages_s": {k: round(v, 4) for k, v in self.stages.items()}, "reject": self.reject,
                "kv_reject": self.kv_reject}


def _no_kv_slot(w: Workload, cal: Calibration, c: Candidate, items: dict[str, float]) -> str:
    """Why one generation replica's KV cache holds no sequence of the longest sample, with the numbers:
    the sequence's K/V per GPU against rollout.gpu_memory_fraction of what the pool's states and engine
    weights leave of the GPU (rollout/model_runner.py sizes its cache so)."""
    static = sum(v for k, v in items.items() if k not in ("activations", "kv_cache"))
    budget = max(0.0, cal.hbm_gb - static) * w.kv_memory_fraction
    seq = w.slot_len * w.actor.kv_bytes_per_token / c.gen_tp / 1e9
    return (f"one sequence of {w.slot_len} tokens (a prompt + rollout.max_response_length) needs "
            f"{seq:.2f} GB of KV cache per GPU at gen_tp={c.gen_tp}, and the engine's budget is {budget:.2f} GB "
            f"(rollout.gpu_memory_fraction={w.kv_memory_fraction} of the {max(0.0, cal.hbm_gb - static):.1f} GB "
            f"that {static:.1f} GB of weights and states leave of {cal.hbm_gb:.0f} GB); shorten "
            f"data.max_prompt_length or rollout.max_response_length, or raise rollout.gen_tp or "
            f"rollout.gpu_memory_fraction")


def _role_model(w: Workload, role: str) -> ModelShape | None:
    return {"actor": w.actor, "critic": w.critic, "ref": w.ref, "reward": w.reward_model}[role]


def _activation_gb(w: Workload, cal: Calibration, role: str, m: ModelShape, layout, *, train: bool) -> float:
    """Largest working set of one micro-batch: saved activations (training) or a few layers (forward)."""
    tp, pp, dp = layout
    mb = min(w.micro_batch_tokens.get(role, 16384), max(1, w.tokens(role) // dp))
    logits = LOGITS_CHUNK * m.vocab / tp * 4 * 3 if m.vocab and role in ("actor", "ref") else 0.0
    if not train:
        return (mb / tp * m.hidden * BF16 * 8 + logits) / 1e9
    in_flight = min(pp, max(2 * pp, -(-w.tokens(role) // dp // mb))) if pp > 1 else 1
    layers = m.layers / pp * in_flight
    per_layer = mb / tp * m.hidden * cal.activation_bytes_per_token_layer_hidden
    if w.ac.get(role) == "full":  # only the layer inputs stay, plus one layer recomputed at a time
        saved = layers * mb / tp * m.hidden * BF16 + per_layer
    else:
        saved = layers * per_layer
    return (saved + logits) / 1e9


def pool_memory(w: Workload, cal: Calibration, c: Candidate, pool: int) -> tuple[dict[str, float], float, int]:
    """(GB per GPU by item, peak GB per GPU, KV slots per generation replica) of one pool."""
    roles, _ = c.pools[pool]
    items: dict[str, float] = {}
    act = 0.0
    for role in roles:
        m = _role_model(w, role) if role != "rollout" else None
        if m is None:
            continue
        tp, pp, dp = c.layout(role)
        train = role in ("actor", "critic")
        per_param = TRAINED_BYTES_PER_PARAM if train else w.frozen_bytes_per_param
        if role in w.offload_optimizer:
            per_param -= OFFLOADED_BYTES_PER_PARAM  # Adam's moments in host memory
        if w.lora_params and role == "actor":  # a frozen base and trained adapters
            states = m.n_params * w.frozen_bytes_per_param + w.lora_params * per_param
        elif w.lora_params and role == "ref":  # the actor's base with its adapters off: no weights of its own
            states = 0.0
        else:
            states = m.n_params * per_param
        if (ep := w.ep.get(role, 1)) > 1:  # each rank holds 1/ep of the experts whole (not FSDP-sharded over dp)
            experts = m.n_expert_params * per_param
            items[f"{role}_states"] = ((states - experts) / (tp * pp * dp) + experts / ep) / 1e9
        else:
            items[f"{role}_states"] = states / (tp * pp * dp) / 1e9
        act = max(act, _activation_gb(w, cal, role, m, c.layout(role), train=train))
    items["activations"] = act
    slots = 0
    if "rollout" in roles:
        static = sum(items.values()) - act
        items["engine_weights"] = w.actor.n_params * BF16 / c.gen_tp / 1e9
        slots = kv_slots(w, cal, tp=c.gen_tp, static_gb=static + items["engine_weights"])
        items["kv_cache"] = slots * w.slot_len * w.actor.kv_bytes_per_token / c.gen_tp / 1e9
    engine = items.get("engine_weights", 0.0) + items.get("kv_cache", 0.0)
    static = sum(items.values()) - act - engine
    free = w.free_memory_on_sleep
    if free is None:  # auto: resident when the training peak and the engine fit (ppo.roles.generation.fits_resident)
        free = static + engine + act > RESIDENT_FRACTION * cal.hbm_gb
    if free:
        offloaded = items.get("actor_states", 0.0) * OFFLOADED_BYTES_PER_PARAM / TRAINED_BYTES_PER_PARAM \
            if w.offload_optimizer_while_generating else 0.0
        peak = max(static + act, static - offloaded + engine)
    else:
        peak = static + engine + act
    return items, peak, slots


def training_peak_gb(w: Workload, items: dict[str, float]) -> float:
    """A pool's memory per GPU while it trains: every item but the engine's, whose KV cache is sized from the memory
    left (its wake-up) and freed while training, unless rollout.free_memory_on_sleep=false keeps it."""
    engine = items.get("engine_weights", 0.0) + items.get("kv_cache", 0.0)
    return sum(items.values()) - (0.0 if w.free_memory_on_sleep is False else engine)


def _busy(stages: dict[str, float], c: Candidate, owner: dict[str, str]) -> list[float]:
    busy = [0.0] * len(c.pools)
    for stage, s in stages.items():
        if stage in owner:
            busy[c.pool_of(owner[stage])] += s
    return busy


def estimate(w: Workload, cal: Calibration, c: Candidate) -> Estimate:
    """Predicted stage seconds, step seconds, utilization and memory of candidate `c` (never raises on an
    infeasible plan: `reject` says why, and the times are those it would have if it fit)."""
    memory, peaks, train_peaks, reject = [], [], [], None
    slots = 0
    for i, (roles, n) in enumerate(c.pools):
        items, peak, s = pool_memory(w, cal, c, i)
        memory.append({k: round(v, 2) for k, v in items.items()})
        peaks.append(peak)
        train_peaks.append(training_peak_gb(w, items))
        slots = s or slots
        if peak > cal.hbm_gb and reject is None:
            top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(items.items(), key=lambda kv: -kv[1]))
            reject = (f"pool {'+'.join(roles)} ({n} GPUs): {peak:.1f} GB per GPU > {cal.hbm_gb:.0f} GB "
                      f"usable ({top} GB)")
    kv_reject = None
    if slots == 0:
        kv_reject = _no_kv_slot(w, cal, c, memory[c.pool_of("actor")])  # the rollout shares the actor's pool
        reject = reject or kv_reject
    tp, pp, dp = c.layout("actor")
    n_actor = tp * pp * dp
    stages: dict[str, float] = {
        "gen": generation_s(w, cal, gen_tp=c.gen_tp, gen_dp=n_actor // c.gen_tp, slots=max(1, slots)),
        "reshard": reshard_s(w, cal, tp=tp, pp=pp, dp=dp, gen_tp=c.gen_tp),
    }
    owner = {"gen": "actor", "reshard": "actor", "old_log_prob": "actor", "ref": "ref", "values": "critic",
             "reward": "reward", "update_actor": "actor", "update_critic": "critic"}
    if w.old_logp_share:
        stages["old_log_prob"] = w.old_logp_share * model_pass_s(w, cal, "actor", w.actor, layout=c.layout("actor"),
                                                                 train=False)
    for role, stage in (("ref", "ref"), ("critic", "values"), ("reward", "reward")):
        m = _role_model(w, role)
        if m is not None:
            stages[stage] = model_pass_s(w, cal, role, m, layout=c.layout(role), train=False)
    stages["update_actor"] = model_pass_s(w, cal, "actor", w.actor, layout=c.layout("actor"), train=True)
    if w.critic is not None:
        stages["update_critic"] = model_pass_s(w, cal, "critic", w.critic, layout=c.layout("critic"), train=True)
    reward_pool = c.pools[c.pool_of("reward")][1]
    host = host_s(w, cal, reward_gpus=reward_pool)
    stages["adv"] = host["adv"]
    if not w.reward_model:
        stages["reward"] = host["reward"]
    stages["transfer"] = transfer_s(w, cal, world=c.world_size)  # share_samples / merge_results, every mode

    def per_pool(names) -> list[float]:
        out = [0.0] * len(c.pools)
        for s in names:
            if s in stages:
                out[c.pool_of(owner[s])] += stages[s]
        return out

    gen = stages["gen"] + stages["reshard"]
    score = per_pool(SCORE_STAGES)
    if w.is_async:
        score[c.pool_of("actor")] += gen
        first = max(score)
    else:
        first = gen + max(score)
    step = first + stages["adv"] + stages["transfer"] + max(per_pool(UPDATE_STAGES))
    busy = _busy({k: v for k, v in stages.items() if not (k == "reward" and not w.reward_model)}, c, owner)
    return Estimate(candidate=c, stages=stages, step_s=step, samples=w.samples, busy_s=busy,
                    useful_flops=useful_flops(w), peak_gb=peaks, train_peak_gb=train_peaks, memory=memory,
                    reject=reject, kv_reject=kv_reject)


def useful_flops(w: Workload) -> float:
    """ppo/metrics/flops.py's count of the step, exactly as the trainer's perf/useful_util counts it."""
    from ppo.metrics.flops import ppo_step_flops

    trained = w.samples * (w.prompt_len + w.response_len)
    return ppo_step_flops(
        n_params_actor=w.actor.n_matmul, n_params_critic=w.actor.n_matmul if w.critic else None,
        n_params_ref=w.actor.n_matmul if w.ref else None, n_params_rm=w.actor.n_matmul if w.reward_model else None,
        trained_tokens=trained, generated_tokens=w.samples * w.response_len,
        prefill_tokens=w.samples * w.prompt_len // max(1, w.n), ppo_epochs=w.ppo_epochs,
        old_logp_share=w.old_logp_share,
        policy_tokens=w.tokens("actor") if w.share_prompts else None)
