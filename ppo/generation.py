"""The rollout role: the actor's ranks generate through the hybrid engine.

Each generation replica (gen_tp ranks) takes its share of the step's prompts; every rank
of a replica gets the same completions, and only the replica's gen-TP rank 0 reports them
as `Sample`s, so each sample enters the step's experience exactly once.
"""

from __future__ import annotations

import logging

import torch

from ppo.experience import Sample
from ppo.roles import request_seed
from rollout.base import RolloutConfig as EngineConfig
from rollout.base import SamplingParams


def sample_info(row: dict) -> dict:
    """What a sample carries from its data row to the reward function: data_source, extra_info and
    the row's other columns."""
    return {**row.get("columns", {}), "data_source": row.get("data_source", ""),
            "extra_info": row.get("extra_info", {})}


def build_rollout_groups(cfg, plan):
    """The hybrid engine's process groups (collective: every rank of the world calls this)."""
    from parallel.reshard import GenLayout, TrainLayout
    from parallel.reshard_exec import build_reshard_groups

    actor = plan.groups["actor"]
    train = TrainLayout(tp=actor.tp, pp=actor.pp, dp=actor.dp)
    gen = GenLayout(tp=plan.gen_tp, dp=plan.gen_dp)
    return train, gen, build_reshard_groups((train, gen), actor.ranks)


def engine_config(cfg, env) -> EngineConfig:
    r = cfg.rollout
    max_len = cfg.data.max_prompt_length + r.max_response_length
    return EngineConfig(gpu_memory_fraction=r.gpu_memory_fraction, max_num_seqs=r.max_num_seqs,
                        max_model_len=max_len, enable_cuda_graph=r.enable_cuda_graph, compile=r.compile,
                        decode_attention=r.decode_attention, free_memory_on_sleep=r.free_memory_on_sleep,
                        kv_cache_tokens=None if env.device.type == "cuda" else max_len * r.max_num_seqs,
                        seed=cfg.trainer.seed)


def vllm_options(cfg, env, *, idle_tp: int = 0):
    """rollout.engine=vllm: the settings only vLLM reads, from the run's rollout keys."""
    from rollout.vllm_support import VLLMOptions, logprobs_mode_for

    r = cfg.rollout
    compiled = r.compile or (env.device.type == "cuda" and r.enable_cuda_graph)
    return VLLMOptions(logprobs_mode=logprobs_mode_for(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p),
                       enforce_eager=not compiled, bucket_bytes=r.bucket_mb * 2**20, idle_tp=idle_tp)


def idle_vllm_engine(cfg, *, plan, env, model_config):
    """rollout.engine=vllm on a rank without the rollout role: vLLM's start-up is collective over the whole
    world, so this rank starts a replica too (same KV size; never asked to generate)."""
    from rollout.factory import build_rollout_engine

    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    return build_rollout_engine("vllm", model_config, config=engine_config(cfg, env), device=env.device,
                                dtype=dtype, vllm=vllm_options(cfg, env, idle_tp=plan.gen_tp))


class RolloutRole:
    def __init__(self, cfg, *, plan, actor, env, model_config, tokenizer, layouts):
        from rollout.factory import build_rollout_engine
        from rollout.hybrid import HybridEngine

        self.cfg, self.tokenizer = cfg, tokenizer
        r = cfg.rollout
        train, gen, groups = layouts
        self.groups = groups
        self.gen_dp, self.gen_dp_rank, self.gen_tp_rank = plan.gen_dp, groups.gen_dp_rank, groups.gen_tp_rank
        engine_cfg = engine_config(cfg, env)
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        self.engine = build_rollout_engine(r.engine, model_config, config=engine_cfg, tp_group=groups.gen_tp_group,
                                           device=env.device, dtype=dtype, eos_token_ids=eos,
                                           vllm=vllm_options(cfg, env) if r.engine == "vllm" else None)
        self.hybrid = HybridEngine(actor.runner, self.engine, train_layout=train, gen_layout=gen, groups=groups,
                                   bucket_bytes=r.bucket_mb * 2**20, offload_optimizer=cfg.actor.offload,
                                   optimizer=actor.optimizer, gen_dtype=dtype, logger=logging.getLogger("hybridrl"))

    def my_prompts(self, batch: list[dict]) -> list[dict]:
        """Contiguous share of this generation replica (all n samples of a prompt stay together)."""
        per = -(-len(batch) // self.gen_dp)
        return batch[self.gen_dp_rank * per:(self.gen_dp_rank + 1) * per]

    def generate(self, batch: list[dict], *, step: int, seed: int, timer=None, n: int | None = None,
                 temperature: float | None = None) -> list[Sample]:
        """Samples of this replica's prompts; n / temperature override rollout.n / rollout.temperature
        (validation: rollout.val_n, rollout.val_temperature)."""
        r = self.cfg.rollout
        n = r.n if n is None else n
        temperature = r.temperature if temperature is None else temperature
        rows = self.my_prompts(batch)
        sampling = [SamplingParams(temperature=temperature, top_k=r.top_k, top_p=r.top_p,
                                   max_tokens=r.max_response_length, n=n,
                                   seed=request_seed(seed, step, row["index"])) for row in rows]
        completions = self.hybrid.generate([row["prompt_ids"] for row in rows], sampling)
        if timer is not None:  # the hybrid engine's gather is reported as its own stage
            timer.times["reshard"] = timer.times.get("reshard", 0.0) + self.hybrid.timings["reshard"]
        if self.gen_tp_rank != 0:
            return []
        out = []
        for c in completions:
            row = rows[c.prompt_index]
            if c.finish_reason == "error":
                raise RuntimeError(f"generation failed for prompt {row['index']}: {c.error}")
            out.append(Sample(uid=row["index"] * n + c.sample_index, prompt_index=row["index"],
                              prompt_ids=list(row["prompt_ids"]), response_ids=list(c.token_ids),
                              behaviour_logprobs=list(c.logprobs), finish_reason=c.finish_reason,
                              ground_truth=row.get("ground_truth"), info=sample_info(row)))
        return out

    def set_token_budget(self, tokens: int) -> None:
        """Batch-controller hook, applied at a step boundary: the prefill token budget of the next
        generate (the KV cache itself is sized at wake_up from rollout.gpu_memory_fraction)."""
        self.engine.config.max_num_batched_tokens = max(int(tokens), self.engine.config.max_model_len)
