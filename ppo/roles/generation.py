"""The rollout role: the actor's ranks generate through the hybrid engine.

Each generation replica (gen_tp ranks) takes its share of the step's prompts; every rank
of a replica gets the same completions, and only the replica's gen-TP rank 0 reports them
as `Sample`s, so each sample enters the step's experience exactly once.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, replace

import torch

from ppo.agents.driver import ENGINE_COUNTERS, Start, ToolPool, drive, tp_tool_sync
from ppo.agents.loop import AgentTask, single_turn
from ppo.agents.registry import build_registry
from ppo.batch.experience import Sample, all_gather_objects
from ppo.settings import GenerationSettings
from rollout.base import SamplingParams


def sample_info(row: dict) -> dict:
    """What a sample carries from its data row to the reward function: data_source, extra_info and
    the row's other columns."""
    return {**row.get("columns", {}), "data_source": row.get("data_source", ""),
            "extra_info": row.get("extra_info", {})}


def response_cap(row: dict, max_response_length: int) -> int:
    """The prompt's response budget: its data row's `max_response_length` column when it has one (a per-prompt
    cap, e.g. a benchmark's heavy-tailed lengths), never above rollout.max_response_length."""
    cap = row.get("columns", {}).get("max_response_length")
    if cap is None:
        return max_response_length
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or int(cap) != cap or cap < 1:
        raise ValueError(f"prompt {row.get('index')}: column max_response_length={cap!r} must be a positive integer")
    return min(int(cap), max_response_length)


def request_seed(seed: int, step: int, prompt_index: int) -> int:
    """Per-request sampling seed: independent of the layout, so runs reproduce on any plan."""
    h = hashlib.blake2b(f"{seed}/{step}/{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & (2**62 - 1)


@dataclass(slots=True)
class Generation:
    """One generate call on this rank: its samples, and what it cost.

    reshard_s: seconds of the weight gather (a stage of its own in timing_s/, the rest of the call is
    decoding); metrics: the hybrid engine's reshard/bytes_received, reshard/peak_staging_bytes,
    reshard/engine_bytes (the weights handed to the engine per update) and mem/hybrid_peak_gb (this rank's;
    rollout.hybrid.HybridResult.metrics)."""

    samples: list[Sample]
    reshard_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    # partial rollouts with trainer.stale_policy=drop: the prompts of the groups dropped, as their data rows'
    # `source` ([epoch, dataset row]; ppo.run.state.TrainState.next_prompts), reported by gen-TP rank 0
    dropped: list[list[int] | None] = field(default_factory=list)


def trajectory_sample(row: dict, sample: int, n: int, traj, *, agent: bool, version: int = 0) -> Sample:
    """A trajectory as the step's Sample (uid = prompt index * n + sample). Its loss mask is kept only where
    it has observation tokens (Trajectory.loss_mask None: every response token sampled); agent: keep its counts;
    version: the policy version of the weights that generated it."""
    sampled = sum(end - start for start, end in traj.turns)
    counts = {"turns": len(traj.turns), "tool_calls": traj.tool_calls, "tool_errors": traj.tool_errors,
              "truncated_observations": traj.truncated_observations, "sampled_tokens": sampled,
              "observation_tokens": len(traj.response_ids) - sampled} if agent else None
    return Sample(uid=row["index"] * n + sample, prompt_index=row["index"], prompt_ids=list(row["prompt_ids"]),
                  response_ids=traj.response_ids, behaviour_logprobs=traj.logprobs,
                  finish_reason=traj.finish_reason, ground_truth=row.get("ground_truth"), info=sample_info(row),
                  loss_mask=traj.loss_mask, text=traj.text, agent=counts, version=version,
                  routed_experts=traj.routed_experts)


def build_rollout_groups(plan):
    """The hybrid engine's process groups (collective: every rank of the world calls this)."""
    from parallel.reshard import GenLayout, TrainLayout
    from parallel.reshard_exec import build_reshard_groups

    actor = plan.groups["actor"]
    train = TrainLayout(tp=actor.tp, pp=actor.pp, dp=actor.dp, ep=actor.ep)
    gen = GenLayout(tp=plan.gen_tp, dp=plan.gen_dp)
    return train, gen, build_reshard_groups((train, gen), actor.ranks)


def idle_vllm_engine(settings: GenerationSettings, *, plan, env, model_config):
    """rollout.engine=vllm on a rank without the rollout role: vLLM's start-up is collective over the whole
    world, so this rank starts a replica too (same KV size; never asked to generate)."""
    from rollout.factory import build_rollout_engine

    return build_rollout_engine("vllm", model_config, config=replace(settings.engine), device=env.device,
                                dtype=settings.dtype, vllm=replace(settings.vllm, idle_tp=plan.gen_tp))


def sized_for_prompts(settings: GenerationSettings, longest_prompt: int) -> GenerationSettings:
    """The engine's sequence length cut to the data's longest prompt plus rollout.max_response_length (at most the
    configured data.max_prompt_length + max_response_length): the KV cache is one slot of max_model_len tokens per
    sequence, so slack in the prompt length is KV memory no sequence uses."""
    if longest_prompt <= 0:
        return settings
    length = min(settings.engine.max_model_len, longest_prompt + settings.max_response_length)
    return replace(settings, engine=replace(settings.engine, max_model_len=length))


# HBM bytes per interconnect byte: a byte that crosses ranks costs about this many bytes of device memory traffic
# (H200: about 4.3 TB/s copy bandwidth against about 0.45 TB/s of NVLink per direction)
NETWORK_FACTOR = 10.0


def choose_lora_sync(*, base_bytes: int, adapter_bytes: int, decode_steps: int,
                     crosses_ranks: bool, frees_weights: bool) -> tuple[str, str]:
    """actor.lora.sync=auto: (mode, why) for a LoRA actor, by the device-memory traffic each one costs per update.

    merged: the adapted weights merged on the trainer's device (written once) and copied into the engine: 2 passes
    over this rank's generation shard of the weights (base_bytes), plus NETWORK_FACTOR per byte when the reshard
    crosses ranks. adapters: the same for the adapters alone (adapter_bytes), but every decode step then reads the
    adapters beside the base: decode_steps (at least the longest response) more passes over them. Not when training
    needs the engine's memory on the GPU (rollout.free_memory_on_sleep=true frees its weights on every sleep; the
    adapters path keeps its base). The same estimate for both engines (vLLM reads its adapters in its own LoRA
    kernels each step, as the native engine does in its GEMMs)."""
    if frees_weights:
        return "merged", "auto: rollout.free_memory_on_sleep=true: training needs the engine's memory, its base too"
    net = NETWORK_FACTOR if crosses_ranks else 0.0
    merged = base_bytes * (2 + net)
    adapters = adapter_bytes * (2 + net + decode_steps)
    mode = "adapters" if adapters < merged else "merged"
    return mode, (f"auto: per update about {merged / 2**20:.1f} MiB of device traffic merged vs "
                  f"{adapters / 2**20:.1f} MiB with adapters ({adapter_bytes / 2**20:.2f} MiB sent, read by each of "
                  f"~{decode_steps} decode steps; weights {'cross' if crosses_ranks else 'stay on'} ranks)")


RESIDENT_FRACTION = 0.9  # of the device's memory: training's peak plus the resident engine at most


def fits_resident(*, train_peak: int, engine_bytes: int, total: int) -> bool:
    """Whether the engine's memory (what its sleep frees: KV cache, weights, CUDA graphs) fits beside the training
    peak in RESIDENT_FRACTION of the device (the rest: the allocator's fragmentation, the CUDA context)."""
    return train_peak + engine_bytes <= RESIDENT_FRACTION * total


def settle_residency(rollout: RolloutRole | None, *, train_peak: int) -> str:
    """After the first step of a run whose rollout.free_memory_on_sleep is unset: every rank votes (ranks without a
    rollout role agree), and the engines stay resident only if every rank's fits. Collective over the world.
    -> the decision as a log line (the figures are this rank's)."""
    fits, why = (True, "no engine on this rank") if rollout is None else rollout.settle_memory(train_peak)
    resident = all(all_gather_objects(fits))
    if resident and rollout is not None:
        rollout.keep_resident()
    other = "; another rank's does not fit" if fits and not resident else ""
    return f"rollout.free_memory_on_sleep={str(not resident).lower()} (auto, after the first step: {why}{other})"


class RolloutRole:
    def __init__(self, settings: GenerationSettings, *, plan, actor, env, model_config, tokenizer, layouts):
        from rollout.factory import build_rollout_engine
        from rollout.hybrid import HybridEngine

        self.settings, self.tokenizer = settings, tokenizer
        train, gen, groups = layouts
        self.groups = groups
        self.gen_dp, self.gen_dp_rank, self.gen_tp_rank = plan.gen_dp, groups.gen_dp_rank, groups.gen_tp_rank
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
        lora = getattr(actor.spec, "lora", None)
        self.lora_sync = self._lora_sync(lora, train, gen, model_config, cuda=torch.device(env.device).type == "cuda") \
            if lora is not None else "merged"
        # a copy: the batch controller moves this engine's token budget, never the launcher's settings; with
        # adapters sync the engine keeps its frozen base across sleep (KV cache and graphs are still freed)
        engine_cfg = replace(settings.engine, **({"drop_weights_on_sleep": False}
                                                 if self.lora_sync == "adapters" else {}))
        self.engine = build_rollout_engine(settings.engine_kind, model_config, config=engine_cfg,
                                           tp_group=groups.gen_tp_group, device=env.device, dtype=settings.dtype,
                                           eos_token_ids=eos, vllm=settings.vllm,
                                           lora=lora if self.lora_sync == "adapters" else None)
        a = settings.agent
        self.agents = build_registry(default=a.default, tools_file=a.tools_file, loop_file=a.loop_file,
                                     max_turns=a.max_turns, max_tool_response_tokens=a.max_tool_response_tokens)
        # tool calls run on generation-TP rank 0 only; the other ranks of its group receive their results
        self.tools = ToolPool(workers=a.tool_workers, timeout_s=a.tool_timeout_s, run_here=self.gen_tp_rank == 0)
        self.hybrid = HybridEngine(actor.runner, self.engine, train_layout=train, gen_layout=gen, groups=groups,
                                   bucket_bytes=settings.bucket_bytes,
                                   offload_optimizer_while_generating=settings.offload_optimizer_while_generating,
                                   optimizer=actor.optimizer, gen_dtype=settings.dtype,
                                   logger=logging.getLogger("hybridrl"), lora=lora, lora_sync=self.lora_sync)
        self.partial = None  # rollout.partial.PartialRollouts: the groups in flight (rollout.batches_in_flight > 1)
        self.beside = None  # rollout.beside.DecodeBeside: those groups decoding while the step trains

    def _lora_sync(self, lora, train, gen, model_config, *, cuda: bool) -> str:
        """actor.lora.sync resolved (auto: choose_lora_sync's estimate), logged with its reason."""
        from parallel.lora import adapter_param_specs
        from parallel.reshard import param_specs
        from rollout.vllm_support import VLLM_MAX_LORA_RANK

        s = self.settings
        mode, why = s.lora_sync, "actor.lora.sync"
        if mode == "auto" and s.engine_kind == "vllm" and lora.rank > VLLM_MAX_LORA_RANK:
            mode, why = "merged", f"auto: vLLM serves adapters of rank <= {VLLM_MAX_LORA_RANK}"
        if mode == "auto":
            item = torch.empty(0, dtype=s.dtype).element_size()
            specs = param_specs(model_config, itemsize=item)
            nbytes = [sum(p.numel * p.itemsize for p in ps) // gen.tp
                      for ps in (specs, adapter_param_specs(specs, lora))]
            # rollout.free_memory_on_sleep=true on a GPU: training needs the engine's memory, its base included
            frees = s.engine.free_memory_on_sleep and not s.settle_residency and cuda
            mode, why = choose_lora_sync(base_bytes=nbytes[0], adapter_bytes=nbytes[1],
                                         decode_steps=s.max_response_length, frees_weights=frees,
                                         crosses_ranks=not (train.pp == 1 and train.dp == 1 and train.tp == gen.tp))
        logging.getLogger("hybridrl").info("actor.lora.sync=%s (%s)", mode, why)
        return mode

    def my_prompts(self, batch: list[dict]) -> list[dict]:
        """Contiguous share of this generation replica (all n samples of a prompt stay together)."""
        per = -(-len(batch) // self.gen_dp)
        return batch[self.gen_dp_rank * per:(self.gen_dp_rank + 1) * per]

    def generate(self, batch: list[dict], *, step: int, seed: int, version: int = 0, n: int | None = None,
                 temperature: float | None = None) -> Generation:
        """This replica's share of `batch`, n samples per prompt (collective over the actor ranks);
        only gen-TP rank 0 reports samples, every rank reports its timings and metrics. step: the batch's
        step (its sampling seeds); version: the policy version of the weights generating, which every sample
        carries (ppo.batch.ahead). n / temperature override rollout.n / rollout.temperature (validation:
        rollout.val_n, val_temperature)."""
        r = self.settings
        n = r.n if n is None else n
        temperature = r.temperature if temperature is None else temperature
        rows = self.my_prompts(batch)
        limit = self.engine.config.max_model_len
        tasks = [AgentTask(row["prompt_ids"], row, self.tokenizer, response_cap(row, r.max_response_length), limit)
                 for row in rows]
        starts = [Start(self.agents.pick(row), task, request_seed(seed, step, row["index"]), key=(i, j), sample=j)
                  for i, (row, task) in enumerate(zip(rows, tasks)) for j in range(n)]
        base = SamplingParams(temperature=temperature, top_k=r.top_k, top_p=r.top_p)
        cycle = self.hybrid.run(lambda engine: drive(engine, starts, sampling=base, tools=self.tools,
                                                     sync=tp_tool_sync(self.groups.gen_tp_group),
                                                     keep_kv=r.agent.keep_kv))
        trajectories, stats = cycle.completions
        out = Generation([], reshard_s=cycle.reshard_s, metrics=cycle.metrics())
        if any(s.loop is not single_turn for s in starts):
            out.metrics["agent/decode_steps_during_tools"] = float(stats.steps_during_tools)
            out.metrics["agent/tool_wait_s"] = stats.tool_wait_s
            # the engine's prefill work: tokens prefilled, tokens a later turn's kept KV spared, evicted KV
            for name in ENGINE_COUNTERS:
                out.metrics[f"agent/{name}"] = float(getattr(stats, name))
        if self.gen_tp_rank != 0:
            return out
        for start, traj in zip(starts, trajectories):
            row = rows[start.key[0]]
            if traj.finish_reason == "error":
                raise RuntimeError(f"generation failed for prompt {row['index']}: {traj.error}")
            out.samples.append(trajectory_sample(row, start.sample, n, traj, agent=start.loop is not single_turn,
                                                 version=version))
        return out

    def demonstrations(self, pairs: list[tuple[list[int], list[int]]]
                       ) -> list[tuple[list[int], list[int], list[int] | None]]:
        """The warm-up's (prompt, response, loss mask) examples of (prompt ids, answer ids + eos) pairs: with a
        tools file's SFT_TURNS and the tool loop as agent.default, each pair becomes the loop's own trajectory
        (calls and answer trained on, the real tool responses masked); otherwise the pairs as they are."""
        from ppo.agents.demonstrations import demonstration

        a, tok = self.settings.agent, self.tokenizer
        if a.default != "tool" or self.agents.sft_turns is None:
            return [(p, r, None) for p, r in pairs]
        loop, out = self.agents.loops["tool"], []
        for prompt, answer in pairs:
            eos = tok.eos_token_id
            text = tok.decode(answer[:-1] if answer and answer[-1] == eos else answer)
            turns = self.agents.sft_turns(tok.decode(prompt, skip_special_tokens=True), text)
            traj = demonstration(loop, prompt_ids=prompt, turns=turns, tokenizer=tok, tools=self.tools,
                                 max_response_tokens=self.settings.max_response_length,
                                 max_total_tokens=self.engine.config.max_model_len)
            out.append((list(prompt), traj.response_ids, traj.loss_mask))
        return out

    def generate_partial(self, batch: list[dict], *, step: int, seed: int, version: int, quota: int,
                         due_before: int, drop: bool = False) -> Generation:
        """Over-provisioned partial rollouts (rollout.partial; collective over the actor ranks): this replica's
        share of `batch` joins the groups it has in flight, all continue under the weights of `version`, and the
        first `quota` complete groups (the due ones first: admitted before version due_before) come back as
        samples numbered by replica (prompt index gen_dp_rank x quota + i); the others stay in flight, suspended,
        for the next call. A sample's version is its oldest token's. The due groups are waited for (pacing:
        async/paced_s), or with `drop` not waited for, and those not handed over are dropped (async/dropped_*,
        Generation.dropped): the next call would train them past the bound."""
        from rollout.partial import PartialRollouts

        r = self.settings
        if self.partial is None:
            self.partial = PartialRollouts(self.engine, version=version, kv=r.partial_kv)
        new = [(row["prompt_ids"], SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                                                  max_tokens=response_cap(row, r.max_response_length), n=r.n,
                                                  seed=request_seed(seed, step, row["index"])), row)
               for row in self.my_prompts(batch)]
        # the engine's count of sampled tokens: the samples left in flight (decoding beside) have tokens not yet
        # folded into their trajectories
        sampled, paced = self.engine.stats["sampled_tokens"], self.partial.stats.get("paced_s", 0.0)
        beside = self.decodes_beside()
        cycle = self.hybrid.generate_partial(self.partial, version=version, new_groups=new, groups=quota,
                                             due_before=due_before, wait=not drop, awake=beside)
        if beside:  # the last step's tokens are this cycle's
            self.partial.settle()
        dropped = self.partial.drop(admitted_before=due_before) if drop else []  # host state only: the engine sleeps
        out = Generation([], reshard_s=cycle.reshard_s, metrics=cycle.metrics())
        try:
            if self.gen_tp_rank == 0:
                self._partial_report(out, cycle.completions, dropped, step=step, quota=quota, version=version,
                                     sampled=sampled, paced=paced)
        except BaseException:
            if beside:  # as the cycle would have left them
                self.partial.suspend()
                self.engine.sleep()
            raise
        if beside:  # the groups left in flight decode on while the step scores and trains, until end_beside()
            from rollout.beside import DecodeBeside

            self.beside = DecodeBeside(self.partial, device=self.hybrid.device)
        return out

    def decodes_beside(self) -> bool:
        """rollout.decode_beside, where it can act now: the engine stays resident (with
        rollout.free_memory_on_sleep unset, from the step after that was decided)."""
        return self.settings.decode_beside and self.engine.config.free_memory_on_sleep is False

    def end_beside(self) -> dict[str, float]:
        """Stop the decoding beside training (a no-op where none runs): the groups in flight are suspended and the
        engine sleeps, as after any generation. -> its async/beside_* metrics."""
        if self.beside is None:
            return {}
        beside, self.beside = self.beside, None
        try:
            metrics = beside.stop()
        finally:
            self.partial.suspend()
            self.engine.sleep()
        return metrics if self.gen_tp_rank == 0 else {}

    def _partial_report(self, out: Generation, completions, dropped, *, step: int, quota: int, version: int,
                        sampled: int, paced: float) -> None:
        """generate_partial's samples and async/* metrics (a replica's leader)."""
        r, stats = self.settings, self.partial.stats
        # tokens sampled in this cycle, all by `version` (summed over the replicas' leaders), the wait for due
        # groups (the slowest replica's), the groups dropped and those still held (sums)
        out.metrics.update({"async/generated_tokens": float(self.engine.stats["sampled_tokens"] - sampled),
                            "async/paced_s": stats.get("paced_s", 0.0) - paced,
                            "async/dropped_groups": float(len(dropped)),
                            "async/dropped_samples": float(sum(map(len, dropped))),
                            "async/dropped_tokens": float(sum(len(t.token_ids) for g in dropped for t in g)),
                            "async/groups_in_flight": float(len(self.partial.groups))})
        out.dropped = [g[0].tag.get("source") for g in dropped]
        for i, group in enumerate(completions):
            index = self.gen_dp_rank * quota + i
            for t in group:
                row = t.tag
                if t.finish_reason == "error":
                    raise RuntimeError(f"generation failed for prompt {row['index']} of step {step}: {t.error}")
                out.samples.append(Sample(uid=index * r.n + t.sample_index, prompt_index=index,
                                          prompt_ids=list(t.prompt_ids), response_ids=list(t.token_ids),
                                          behaviour_logprobs=list(t.logprobs), finish_reason=t.finish_reason,
                                          ground_truth=row.get("ground_truth"), info=sample_info(row),
                                          version=min(t.versions, default=version),
                                          token_versions=list(t.versions) if len(set(t.versions)) > 1 else None,
                                          routed_experts=t.routed_experts))

    def restore_partial(self, state: dict) -> None:
        """The groups in flight of a checkpoint (rollout.partial.PartialRollouts.state_dict), suspended."""
        from rollout.partial import PartialRollouts

        self.partial = PartialRollouts(self.engine, kv=self.settings.partial_kv)
        self.partial.load_state_dict(state)

    def settle_memory(self, train_peak: int) -> tuple[bool, str]:
        """rollout.free_memory_on_sleep unset, after the first step: this rank's vote on keeping the engine resident
        (no KV re-allocation and no CUDA-graph re-capture per step) from the last generate's measured engine memory
        and `train_peak` (bytes allocated at most while training), with the figures. No measurement: no."""
        log = {r.step: r for r in self.hybrid.memory_log}
        if self.hybrid.device.type != "cuda" or "generate" not in log or "sleep" not in log:
            return False, "no measured generate on CUDA"
        engine_bytes = log["generate"].allocated - log["sleep"].allocated
        total = torch.cuda.get_device_properties(self.hybrid.device).total_memory
        fits = fits_resident(train_peak=train_peak, engine_bytes=engine_bytes, total=total)
        return fits, (f"training peak {train_peak / 2**30:.1f} GiB + engine {engine_bytes / 2**30:.1f} GiB "
                      f"{'<=' if fits else '>'} {RESIDENT_FRACTION:.0%} of {total / 2**30:.1f} GiB")

    def keep_resident(self) -> None:
        """From the next generate on, sleep() keeps the KV cache, weights and CUDA graphs (wake_up re-allocates
        once if they were freed)."""
        self.engine.config.free_memory_on_sleep = False

    def set_token_budget(self, tokens: int) -> None:
        """Batch-controller hook, applied at a step boundary: the prefill token budget of the next
        generate (the KV cache itself is sized at wake_up from rollout.gpu_memory_fraction)."""
        self.engine.config.max_num_batched_tokens = max(int(tokens), self.engine.config.max_model_len)
