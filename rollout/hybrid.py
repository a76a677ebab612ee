"""`HybridEngine`: the actor's weights serve generation in place, then training resumes.

    groups = build_reshard_groups((train, gen), ranks)                  # collective, once
    engine = NativeEngine(cfg, config=rcfg, tp_group=groups.gen_tp_group, device=dev, dtype=torch.bfloat16)
    hybrid = HybridEngine(actor, engine, train_layout=train, gen_layout=gen, groups=groups,
                          bucket_bytes=256 << 20, offload_optimizer_while_generating=True, optimizer=opt,
                          gen_dtype=torch.bfloat16)
    out = hybrid.generate(prompts, SamplingParams(max_tokens=256))  # every actor rank calls it
    out.completions, out.reshard_s, out.reshard.bytes_received, out.metrics()   # what the cycle cost

One `generate` is the HybridFlow cycle, each step logged with its memory in `memory_log`:
release training-only state (grads to None; optimizer states to pinned CPU when
offload_optimizer_while_generating), so it never coexists with the generation copy -> gather the generation shard
(parallel/reshard_exec.py) -> engine.wake_up() (KV cache)
-> engine.update_weights(gen shard) -> engine.generate -> engine.sleep() -> drop the generation
copy -> restore the optimizer states. The training shards are never written, so going back is
just dropping the copy and the next training step sees exactly the parameters it left.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from parallel.reshard import GenLayout, ParamSpec, TrainLayout, param_specs, plan_reshard
from parallel.reshard_exec import ReshardGroups, ReshardStats, execute_reshard
from parallel.runner import ModelRunner


@dataclass(slots=True)
class MemoryRecord:
    step: str  # "start", "gather", "release_training", "wake_up", "update_weights", "generate", ...
    allocated: int  # CUDA: torch.cuda.memory_allocated; CPU: bytes of the buffers this engine tracks
    reserved: int  # CUDA: torch.cuda.memory_reserved; CPU: same as allocated
    peak: int  # CUDA: max allocated since the previous record; CPU: same as allocated
    seconds: float  # since generate() began


@dataclass(slots=True)
class HybridResult:
    """One generate cycle on this rank: the completions and what the cycle cost."""

    completions: object  # what run()'s work returned; generate(): rollout.base.Completion, one per (prompt, sample)
    reshard_s: float  # the gather of the generation shard (the weight transfer), synchronized
    generate_s: float  # the engine's generate (decoding)
    reshard: ReshardStats  # bytes this rank received, its peak staging bytes
    peak_bytes: int  # the cycle's memory peak: the largest MemoryRecord.peak of memory_log
    engine_bytes: int = 0  # the weights this rank handed the engine (a LoRA actor's: merged on the trainer's device)

    def metrics(self) -> dict[str, float]:
        """The cycle's metrics under docs/design.md's keys (this rank's)."""
        return {"reshard/bytes_received": float(self.reshard.bytes_received),
                "reshard/peak_staging_bytes": float(self.reshard.peak_staging_bytes),
                "reshard/engine_bytes": float(self.engine_bytes), "mem/hybrid_peak_gb": self.peak_bytes / 1e9}


def _tensor_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


class HybridEngine:
    def __init__(self, actor: ModelRunner, engine, *, train_layout: TrainLayout, gen_layout: GenLayout,
                 groups: ReshardGroups, bucket_bytes: int, offload_optimizer_while_generating: bool,
                 optimizer: torch.optim.Optimizer | None = None, logger: logging.Logger | None = None,
                 gen_dtype: torch.dtype | None = None, specs: list[ParamSpec] | None = None,
                 method: str = "alltoall", lora=None, lora_sync: str = "merged"):
        """actor: the parallelized actor (a parallel.runner.ModelRunner, any layout); engine: a
        rollout.base.RolloutEngine whose TP group is groups.gen_tp_group. gen_dtype: dtype of the
        generation shard (default: the training shards' dtype; bf16 halves the bytes moved when the
        masters are fp32). specs: full parameter shapes (default: from the actor's config). method:
        how buckets move (parallel/reshard_exec.py: "alltoall" or "p2p"). offload_optimizer_while_generating: the
        optimizer's states go to pinned host memory for the cycle and come back before it returns (an optimizer
        that streams its states from host memory in its step, parallel/offload_optim.py, is another thing).
        lora (a models.lora.LoRASpec) and lora_sync, for a LoRA actor: "merged" hands the engine every weight
        each update, the adapted ones merged on the trainer's device; "adapters" hands an engine that applies the
        adapters itself (rollout/engine_lora.py, built with the same spec, keeping its weights across sleep) the
        frozen base once (again only when the runner's base_version moves, or the engine dropped it) and
        otherwise the adapter tensors alone."""
        if lora_sync not in ("merged", "adapters"):
            raise ValueError(f"lora_sync={lora_sync!r}: choose merged or adapters")
        if lora_sync == "adapters" and (lora is None or not hasattr(engine, "holds_weights")):
            raise ValueError("lora_sync='adapters' needs the actor's LoRASpec and an engine that applies adapters "
                             "itself (rollout.engine.NativeEngine built with lora=)")
        if offload_optimizer_while_generating and optimizer is None:
            raise ValueError("offload_optimizer_while_generating=True needs the optimizer whose states to offload")
        self.actor = actor
        self.modules = actor.modules
        self.engine = engine
        self.groups = groups
        self.bucket_bytes = bucket_bytes
        self.offload_optimizer_while_generating = offload_optimizer_while_generating
        self.optimizer = optimizer
        self.log = logger
        self.gen_dtype = gen_dtype
        self.method = method
        first = next(p for m in self.modules for p in m.parameters())
        local = first.to_local() if hasattr(first, "to_local") else first
        self.device = local.device
        dtype = gen_dtype or local.dtype
        if specs is None:
            specs = param_specs(actor.model_config, itemsize=torch.empty(0, dtype=dtype).element_size())
        self.plan = plan_reshard(train_layout, gen_layout, specs, only_rank=groups.local_rank)
        self.lora_sync = lora_sync
        self.adapter_plan = None
        self._base_version: int | None = None  # the runner's base_version the engine holds (adapters sync)
        if lora_sync == "adapters":
            from parallel.lora import adapter_param_specs
            from parallel.reshard import num_layers_of

            self.adapter_plan = plan_reshard(train_layout, gen_layout, adapter_param_specs(specs, lora),
                                             only_rank=groups.local_rank, num_layers=num_layers_of(specs))
        self.memory_log: list[MemoryRecord] = []  # the last generate's (RolloutRole.settle_memory reads it)
        self._offloaded: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._host: dict[int, torch.Tensor] = {}  # pinned buffers, reused: cudaHostAlloc is slow
        self._gen: dict[str, torch.Tensor] | None = None
        self._alias_sources: list[torch.Tensor] = []  # training shards, which the gen dict may alias
        self._t0 = 0.0
        engine.sleep()  # training owns the memory until the first generate

    # ---- memory bookkeeping ----
    def _cpu_live_bytes(self) -> int:
        seen: set[int] = set()
        total = 0

        def add(t: torch.Tensor | None) -> None:
            nonlocal total
            if t is None or id(t) in seen:
                return
            seen.add(id(t))
            total += _tensor_bytes(t)

        for m in self.modules:
            for p in m.parameters():
                add(p)
                add(p.grad)
                add(getattr(p, "main_grad", None))  # fp32 main grads (parallel/master_weights.py)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for v in state.values():
                    if torch.is_tensor(v) and v.dim() > 0:
                        add(v)  # offloaded states read 0 bytes here: their device storage is gone
        if self._gen is not None:
            shards = {id(t) for t in self._alias_sources}
            for t in self._gen.values():
                if id(t) not in shards:
                    add(t)
        return total

    def _record(self, step: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            # one read of the allocator's statistics (memory_allocated, memory_reserved and max_memory_allocated
            # each flatten all of them: ~0.8 ms a record on the H200 machine, nine records a generate, GPU idle)
            stats = torch.cuda.memory_stats_as_nested_dict(self.device)
            alloc, reserved = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
            rec = MemoryRecord(step, alloc["current"], reserved["current"], alloc["peak"],
                               time.perf_counter() - self._t0)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            live = self._cpu_live_bytes()
            rec = MemoryRecord(step, live, live, live, time.perf_counter() - self._t0)
        self.memory_log.append(rec)
        if self.log is not None:
            # debug: the rank's log file keeps every generate's memory timeline, the console stays quiet
            self.log.debug("hybrid %-16s allocated %.3f GB reserved %.3f GB peak %.3f GB at %.3f s", step,
                           rec.allocated / 1e9, rec.reserved / 1e9, rec.peak / 1e9, rec.seconds)

    # ---- training-only state ----
    def _release_training_state(self) -> None:
        self.actor.release_gradients()  # the backend's gradient storage (megatron: its DDP buffers)
        if not self.offload_optimizer_while_generating:
            return
        pin = torch.cuda.is_available() and self.device.type == "cuda"
        with torch.no_grad():
            for state in self.optimizer.state.values():
                for v in state.values():
                    if not torch.is_tensor(v) or v.dim() == 0:
                        continue  # the step counter stays put
                    local = v.to_local() if hasattr(v, "to_local") else v
                    host = self._host.get(id(local))
                    if host is None or host.shape != local.shape or host.dtype != local.dtype:
                        host = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
                        self._host[id(local)] = host
                    host.copy_(local, non_blocking=pin)
                    self._offloaded.append((local, host))
            if pin:
                torch.cuda.synchronize(self.device)  # host copies done before the device storage goes
            for local, _host in self._offloaded:
                # swap the storage out, keep the tensor object (a DTensor's local tensor stays its own)
                local.data = torch.empty(0, dtype=local.dtype, device=local.device)

    def _restore_training_state(self) -> None:
        self.actor.restore_gradients()
        with torch.no_grad():
            for local, host in self._offloaded:
                local.data = host.to(self.device, non_blocking=True)
        self._offloaded.clear()

    # ---- the cycle ----
    def generate(self, prompts: list[list[int]], sampling) -> HybridResult:
        """Completions of `prompts` with the cycle's timings, reshard statistics and memory peak; collective
        over the actor ranks.

        prompts: this rank's generation replica's share of the batch (split by groups.gen_dp_rank),
        the same on every rank of groups.gen_tp_group, which decode together.
        """
        return self._cycle(lambda: self.engine.generate(prompts, sampling))

    def generate_partial(self, rollouts, *, version: int, new_groups: list[tuple[list[int], object, object]],
                         groups: int, due_before: int | None, wait: bool = True, awake: bool = False) -> HybridResult:
        """The cycle with partial rollouts (rollout.partial.PartialRollouts over this engine): the suspended
        samples continue under the weights of `version` (their KV recomputed), `new_groups` (prompt, sampling
        params, tag) join them, and the first `groups` complete groups come back as the completions (lists of
        Trajectory; the due ones first, see run_until; wait=False: the due ones not waited for); the rest are
        suspended again before the engine sleeps. awake: the rest stay in flight and the engine awake, for decoding
        beside training (rollout/beside.py; the caller suspends them and puts the engine to sleep after). The same
        calls on every rank of a generation replica."""
        def run():
            rollouts.resume(version=version)
            for prompt, params, tag in new_groups:
                rollouts.add_group(prompt, params, tag=tag)
            done = rollouts.run_until(groups=groups, due_before=due_before, wait=wait)
            if not awake:
                rollouts.suspend()
            return done

        return self._cycle(run, awake=awake)

    def run(self, work) -> HybridResult:
        """The cycle around `work(engine)`, which generates with the awake engine (its generate, or its step
        API: ppo/agents/driver.py); HybridResult.completions is what work returns. Collective as generate()."""
        return self._cycle(lambda: work(self.engine))

    def _reshard(self, stats: ReshardStats) -> dict[str, torch.Tensor]:
        """This rank's training shards -> self._gen, the generation shards the engine gets this update (collective
        over the actor ranks); returns the training shards (which self._gen may alias)."""
        if self.lora_sync == "merged":
            shards = self.actor.training_shards()
            self._alias_sources = list(shards.values())
            self._gen = execute_reshard(self.plan, shards, groups=self.groups, bucket_bytes=self.bucket_bytes,
                                        dtype=self.gen_dtype, method=self.method, stats=stats)
            return shards
        base, adapters = self.actor.lora_shards()
        self._alias_sources = list(base.values()) + list(adapters.values())
        self._gen = {}
        # the base again only if it changed or the engine lost it; every rank decides alike (the reshard is
        # collective): the version moves on every rank, and an engine that drops weights does so on all of them
        if self._base_version != self.actor.base_version or not self.engine.holds_weights():
            self._gen = execute_reshard(self.plan, base, groups=self.groups, bucket_bytes=self.bucket_bytes,
                                        dtype=self.gen_dtype, method=self.method, stats=stats)
            self._base_version = self.actor.base_version
        self._gen.update(execute_reshard(self.adapter_plan, adapters, groups=self.groups,
                                         bucket_bytes=self.bucket_bytes, dtype=self.gen_dtype, method=self.method,
                                         stats=stats))
        return {**base, **adapters}

    def _cycle(self, run, *, awake: bool = False) -> HybridResult:
        """wake -> weights -> run() (the generation) -> sleep (awake: left awake), with the training state
        released around it."""
        cuda = self.device.type == "cuda"
        self._t0 = time.perf_counter()
        self.memory_log.clear()
        self._record("start")
        # training-only state goes first, so the generation shard never coexists with the optimizer states
        self._release_training_state()
        self._record("release_training")
        stats = ReshardStats()
        t = time.perf_counter()
        shards = self._reshard(stats)
        if cuda:
            torch.cuda.synchronize(self.device)
        reshard_s = time.perf_counter() - t
        self._record("gather")
        self.engine.wake_up()
        self._record("wake_up")
        engine_bytes = sum(t.numel() * t.element_size() for t in self._gen.values())
        self.engine.update_weights(self._gen.items())
        self._record("update_weights")
        t = time.perf_counter()
        completions = run()
        generate_s = time.perf_counter() - t
        self._record("generate")
        if not awake:
            self.engine.sleep()
        self._record("sleep")
        self._gen = None
        del shards
        self._alias_sources = []
        self._record("drop_gen")
        self._restore_training_state()
        self._record("restore_training")
        return HybridResult(completions, reshard_s=reshard_s, generate_s=generate_s, reshard=stats,
                            peak_bytes=max(r.peak for r in self.memory_log), engine_bytes=engine_bytes)
