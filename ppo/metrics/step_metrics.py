"""A step's metrics row: every rank's measurements gathered to rank 0 and reduced, with the step's FLOP
accounting against the device's spec peak (ppo.metrics.flops).

    metrics = StepMetrics(plan=plan, rank=rank, device=device, model_config=cfg, gc_pauses=pauses, n=4,
                          ppo_epochs=1, share_prompts=True, reward_model=False)
    row = metrics.collect(step, exp, batch, adv_metrics, actor_m, critic_m, timer.times,
                          gen_metrics=gen.metrics, old_logp_share=1.0)   # collective; {} off rank 0
"""

from __future__ import annotations

import logging

import torch

from ppo.batch.experience import Experience, all_gather_objects
from ppo.batch.step_batch import StepBatch
from ppo.metrics.flops import attention_forward_flops, ppo_stage_flops, spec_peak_flops, useful_utilization
from ppo.metrics.recompiles import recompile_log, summary
from ppo.metrics.timing import compiled_graphs, host_memory_gb

log = logging.getLogger("hybridrl")

# the generation metrics each replica counts for itself (summed over the replicas' reports; the others: the max)
SUMMED_GEN_KEYS = ("reshard/bytes_received", "async/generated_tokens", "async/dropped_groups",
                   "async/dropped_samples", "async/dropped_tokens", "async/groups_in_flight", "async/beside_tokens",
                   "async/beside_steps", "async/beside_ungraphed_steps")


class StepMetrics:
    """plan: the device plan (groups, world_size); gc_pauses: ppo.metrics.host_gc.GcPauses of this rank; for the
    FLOP accounting: n samples per prompt, the actor's ppo_epochs, whether prompts are packed once per group
    (share_prompts), whether the reward is a model and a LoRA actor's adapter parameter count."""

    def __init__(self, *, plan, rank: int, device: torch.device, model_config, gc_pauses, n: int, ppo_epochs: int,
                 share_prompts: bool, reward_model: bool, adapter_params: int = 0):
        self.plan, self.rank, self.device, self.gc_pauses = plan, rank, device, gc_pauses
        self.n, self.ppo_epochs, self.share_prompts, self.reward_model = n, ppo_epochs, share_prompts, reward_model
        # the FLOP accounting's N (no embedding lookup): the policy's with its LM head, a value/reward head's without
        self.recompiles = recompile_log()  # Dynamo's recompile reasons (None where TORCH_LOGS leaves them out)
        self.n_policy = model_config.matmul_params()
        self.n_head = model_config.matmul_params(lm_head=False)
        self.adapter_params = adapter_params  # a LoRA actor's (its base gets no weight gradients)
        self.layers = model_config.num_hidden_layers
        self.attn_width = model_config.num_attention_heads * model_config.head_dim
        # no spec peak for a CPU or an unlisted device: no utilization figure rather than a guess
        self.train_peak = 0  # bytes allocated at most since the last generate, at the last collect (CUDA)
        self.peak_flops = spec_peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None

    def collect(self, step: int, exp: Experience, batch: StepBatch, adv_metrics: dict, actor_m: dict | None,
                critic_m: dict | None, times: dict[str, float], *, gen_metrics: dict[str, float],
                old_logp_share: float) -> dict[str, float]:
        """batch: the step's (its mask and scores); actor_m / critic_m: this rank's update metrics when it owns
        a shard of that role's metrics (None elsewhere); old_logp_share: the share of the batch an old-log-prob
        forward ran over (ppo.roles.step_plan.old_logp_share). Collective over the world; the row on rank 0, {} on the
        others."""
        mine = {"times": times, "gen": gen_metrics, "actor": actor_m, "critic": critic_m,
                "peak_gb": (torch.cuda.max_memory_allocated(self.device) / 2**30
                            if self.device.type == "cuda" else None),
                "graphs": compiled_graphs(), "recompiles": self.recompiles.take() if self.recompiles else [],
                **self.gc_pauses.take(), **host_memory_gb()}
        parts = all_gather_objects(mine)
        if self.device.type == "cuda":
            # colocated: the hybrid engine's last record reset the peak, so this is the training stages' peak
            self.train_peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.rank != 0:
            return {}
        resp_len = batch.mask.sum(-1).float()
        m: dict[str, float] = {"step": step + 1, "reward/mean": float(batch.scores.mean()),
                               "reward/max": float(batch.scores.max()),
                               "response_length/mean": float(resp_len.mean()),
                               "response_length/max": float(resp_len.max()),
                               "response_length/clip_frac": float(sum(s.finish_reason == "length"
                                                                      for s in exp.samples) / len(exp.samples))}
        m.update(adv_metrics)
        m.update(agent_metrics(exp))
        for key, prefix in (("actor", "actor/"), ("critic", "critic/")):
            vals = [p[key] for p in parts if p[key]]
            for k in (vals[0] if vals else {}):
                # rollout_corr/... keep their own section; *_max / *_min reduce as such over DP ranks
                name = k if "/" in k else prefix + k
                red = max if k.endswith("_max") else min if k.endswith("_min") else None
                m[name] = red(v[k] for v in vals) if red else sum(v[k] for v in vals) / len(vals)
        if "actor/kl" not in m and "actor/kl_loss" in m:  # fused old log-probs: the KL loss term is the KL
            m["actor/kl"] = m["actor/kl_loss"]
        for stage in set().union(*(p["times"] for p in parts)):
            m[f"timing_s/{stage}"] = max(p["times"].get(stage, 0.0) for p in parts)
        step_s = m["timing_s/step"]
        n_tokens = float(sum(s.length for s in exp.samples))
        m["perf/samples_per_s"] = len(exp.samples) / step_s
        m["perf/tokens_per_s"] = n_tokens / step_s
        m.update(self.flop_metrics(exp, m, old_logp_share=old_logp_share))
        for key in set().union(*(p["gen"] for p in parts)):
            vals = [p["gen"][key] for p in parts if key in p["gen"]]
            # bytes received and tokens sampled (reported by each replica's leader) add up over the actor ranks;
            # peaks are the worst rank's
            m[key] = sum(vals) if key in SUMMED_GEN_KEYS else max(vals)
        peaks = [p["peak_gb"] for p in parts if p["peak_gb"] is not None]
        if peaks:
            m["mem/peak_gb"] = max(peaks)
        # host memory per rank (offloaded optimizer states live there): now, and the process's peak so far
        m["mem/host_rss_gb"] = max(p["host_rss_gb"] for p in parts)
        m["mem/host_peak_gb"] = max(p["host_peak_gb"] for p in parts)
        m["compile/graphs"] = max(p["graphs"] for p in parts)  # cumulative: a step that raises it compiled
        # graphs compiled again (a guard failed) in this step, on the rank with the most; the first one's reason
        # logged: after the first step each cost a measured step its compile time
        worst = max(parts, key=lambda p: len(p["recompiles"]))["recompiles"]
        m["compile/recompiles"] = len(worst)
        if worst:
            (log.warning if step > 0 else log.info)("step %d: %d recompile(s); the first: %s", step + 1, len(worst),
                                                    summary(worst[0]))
        # the garbage collector's stalls inside the step on the slowest rank (a full collection: tenths of a second)
        m["host/gc_s"] = max(p["gc_s"] for p in parts)
        m["host/gc_full"] = max(p["gc_full"] for p in parts)
        return m

    def flop_metrics(self, exp: Experience, m: dict[str, float], *, old_logp_share: float) -> dict[str, float]:
        """The step's model FLOPs (perf/flops) and, where the device's spec peak is known, the useful
        utilization of the whole step and the actor update's MFU."""
        roles = self.plan.groups
        # shared prompts: each prompt is packed once per group of samples
        units, packed = exp.prompt_units()
        policy = sum(packed) if self.share_prompts else None
        prompts = [len(exp.samples[u[0]].prompt_ids) for u in units]
        responses = [[len(exp.samples[i].response_ids) for i in u] for u in units]
        attention = {name: attention_forward_flops(prompts, responses, layers=self.layers, attn_width=self.attn_width,
                                                   share_prompts=share)
                     for name, share in (("attention_policy", self.share_prompts), ("attention_full", False))}
        flops = ppo_stage_flops(
            n_params_actor=self.n_policy, n_params_critic=self.n_head if "critic" in roles else None,
            n_params_ref=self.n_policy if "ref" in roles else None,
            n_params_rm=self.n_head if self.reward_model else None,
            trained_tokens=sum(s.length for s in exp.samples),
            generated_tokens=sum(len(s.response_ids) for s in exp.samples),
            prefill_tokens=sum(len(s.prompt_ids) for s in exp.samples) // max(1, self.n),
            ppo_epochs=self.ppo_epochs, old_logp_share=old_logp_share, policy_tokens=policy,
            adapter_params_actor=self.adapter_params, **attention)
        out = {"perf/flops": sum(flops.values())}
        if self.peak_flops is None:
            return out
        out["perf/useful_util"] = useful_utilization(out["perf/flops"], m["timing_s/step"],
                                                     n_gpus=self.plan.world_size, peak_flops=self.peak_flops)
        actor_s = m.get("timing_s/update_actor", 0.0)
        if actor_s > 0:
            out["perf/mfu/actor"] = useful_utilization(flops["update_actor"], actor_s,
                                                       n_gpus=len(roles["actor"].ranks), peak_flops=self.peak_flops)
        return out


def agent_metrics(exp: Experience) -> dict[str, float]:
    """agent/* over the step's agent trajectories (none: {}): turns and tool calls per trajectory, the tool
    errors and cut tool responses of the step, the share of trajectories a limit cut, and the sampled vs
    observation tokens per trajectory (response_length/* counts sampled tokens only)."""
    runs = [s for s in exp.samples if s.agent is not None]
    if not runs:
        return {}
    k = len(runs)
    total = {key: sum(s.agent[key] for s in runs) for key in runs[0].agent}
    return {"agent/turns_mean": total["turns"] / k, "agent/tool_calls_mean": total["tool_calls"] / k,
            "agent/tool_errors": float(total["tool_errors"]),
            "agent/truncated_observations": float(total["truncated_observations"]),
            "agent/truncated_frac": sum(s.finish_reason == "length" for s in runs) / k,
            "agent/sampled_tokens_mean": total["sampled_tokens"] / k,
            "agent/observation_tokens_mean": total["observation_tokens"] / k}
