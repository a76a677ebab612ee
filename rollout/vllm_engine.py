"""`VLLMEngine`: vLLM in this process, inside the torchrun world, behind the RolloutEngine protocol.

    engine = VLLMEngine(model_config, config=RolloutConfig(max_model_len=64, max_num_seqs=16),
                        tp_group=groups.gen_tp_group, dtype=torch.float32, eos_token_ids=[2])
    engine.update_weights(gen_shards.items())     # HF-named TP shards from the hybrid engine
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=16, n=4, seed=7))

How it sits in the world (vLLM's `external_launcher` executor, VLLM_ENABLE_V1_MULTIPROCESSING=0):
vLLM reuses the already initialised torch.distributed world and cuts it into consecutive blocks of
`tensor_parallel_size` ranks, one engine per block; each block is one generation TP group of the
device plan (checked at start-up), blocks are independent replicas (vLLM's "external DP"). vLLM
creates its groups with collectives over the WHOLE world, so every rank of the world constructs an
engine at the same time; a rank without the rollout role builds an idle one (`idle_tp`, never asked
to generate) of the same KV size (vLLM sizes every engine's KV cache to the minimum over the world).
Every rank of a TP group passes the same prompts.

Weights: the engine starts from vLLM's dummy weights; `update_weights` takes this rank's HF-named
generation TP shards, all-gathers them inside the TP group one bounded bucket at a time into the
full tensors vLLM's loaders expect (vLLM re-shards them itself), streams them through vLLM's
in-place reload, and resets the prefix cache (stale KV blocks of the old weights would otherwise be
reused by a prompt with a cached prefix).

LoRA (`lora=` a models.lora.LoRASpec; actor.lora.sync=adapters): vLLM's own adapter loading (`enable_lora`). The
base comes through update_weights once; "<module>.lora_A/B" tensors, gathered like the weights, are written as a
PEFT adapter directory and served as a new `LoRARequest` ("policy-v<N>", the previous one removed), which every
later generate uses. vLLM applies alpha / r itself from the directory's adapter_config.json.

Step API (rollout.base.SteppingEngine, for agent loops and partial rollouts): add_request / step / abort drive
vLLM's LLMEngine one scheduler iteration at a time; each sample is its own vLLM request, seeded as vLLM's
n-sampling seeds its j-th child (same draws as one LLM.generate with n), reporting only when it finishes (as
LLM.generate's requests: streaming every step's tokens cost 1.7x the host time on CPU); an abort reads the tokens
and log-probs so far from vLLM's output processor. generate() is a loop over them. Scheduling is synchronous
(async_scheduling off), so no iteration is in flight between step() calls and weights may be swapped there (partial
rollouts: the samples in flight are aborted and continue as new requests, their KV recomputed).

Sleep: on CUDA, `sleep()` is vLLM's sleep level 2 (weights and KV cache leave the GPU; the weights
come back from the next update_weights) when rollout.free_memory_on_sleep; vLLM's CPU platform has
no sleep mode, so there sleep()/wake_up() only flip a flag and never call into vLLM (a vLLM
`generate` issued after its `sleep()` blocks).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from models.config import ModelConfig
from parallel.sharding import tp_shard_dim
from rollout.base import Completion, RolloutConfig, SamplingParams, check_request, error_completions, generate_by_steps
from rollout.vllm_support import (
    installed_vllm_version,
    isolate_cpu_shm_groups,
    request_matches_mode,
    vllm_install_problem,
    vllm_lora_rank,
)

# head_dim values vLLM's CPU attention accepts (others start, then fail at the first generate)
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def kv_bytes_per_token(cfg: ModelConfig, *, tp: int, dtype: torch.dtype) -> int:
    """K and V of one token on one TP rank, all layers."""
    kv_heads = max(cfg.num_key_value_heads // tp, 1)
    return 2 * cfg.num_hidden_layers * kv_heads * cfg.head_dim * torch.empty(0, dtype=dtype).element_size()


def write_hf_config(cfg: ModelConfig, directory: str, *, dtype: torch.dtype) -> None:
    """config.json of the actor's model (vLLM builds its model from it; weights come later)."""
    d = cfg.to_hf()
    d["torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(d, f)


def gather_full_tensors(named: Iterable[tuple[str, torch.Tensor]], *, group, bucket_bytes: int
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors from this rank's TP shards (parallel/sharding.py dims), gathered in buckets of at
    most ~bucket_bytes of local shard per rank, so at most one bucket of full tensors exists at a time.
    Collective over `group`: every rank iterates the same names in the same order."""
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        yield from named
        return
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        if bucket and (size + t.numel() * t.element_size() > bucket_bytes or t.dtype != bucket[0][1].dtype):
            yield from _gather_bucket(bucket, group, world)
            bucket, size = [], 0
        bucket.append((name, t))
        size += t.numel() * t.element_size()
    if bucket:
        yield from _gather_bucket(bucket, group, world)


def _gather_bucket(bucket: list[tuple[str, torch.Tensor]], group, world: int) -> Iterator[tuple[str, torch.Tensor]]:
    flat = torch.cat([t.detach().reshape(-1) for _, t in bucket])
    parts = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(parts, flat, group=group)
    offset = 0
    for name, t in bucket:
        n = t.numel()
        pieces = [p[offset:offset + n].view(t.shape) for p in parts]
        offset += n
        dim = tp_shard_dim(name)
        yield name, (pieces[0] if dim is None else torch.cat(pieces, dim=dim))


def _check_tp_group_matches_vllm(tp_group, tp: int) -> None:
    """vLLM's TP groups are consecutive blocks of `tp` world ranks; the plan's must be the same ranks."""
    rank = dist.get_rank()
    ours = dist.get_process_group_ranks(tp_group) if tp_group is not None else [rank]
    theirs = list(range(rank - rank % tp, rank - rank % tp + tp))
    if sorted(ours) != theirs:
        raise ValueError(f"rollout.engine=vllm: vLLM puts world rank {rank} in TP group {theirs} (consecutive "
                         f"blocks of gen tp={tp}), the device plan in {sorted(ours)}; place the actor on a rank "
                         "range starting at a multiple of the generation TP size")


VLLM_CPU_BLOCK = 128  # vllm/platforms/cpu.py's block size when none is set


@dataclass(slots=True)
class _Sample:
    """One sample of a request in flight (vLLM request "<id>.<j>")."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: str | None = None  # None while vLLM runs it
    error: str | None = None


@dataclass(slots=True)
class _Request:
    prompt: list[int]
    samples: list[_Sample]


class VLLMEngine:
    def __init__(self, model_config: ModelConfig, *, config: RolloutConfig, tp_group=None,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 eos_token_ids: list[int] | None = None, logprobs_mode: str = "processed_logprobs",
                 enforce_eager: bool = True, bucket_bytes: int = 256 << 20, idle_tp: int = 0, lora=None):
        """tp_group: this rank's generation TP group (None: tp=1). logprobs_mode: from
        rollout.vllm_support.logprobs_mode_for(). idle_tp > 0: a placeholder replica of that TP size on a
        rank without the rollout role (it only takes part in vLLM's collective start-up; see above). lora: a
        models.lora.LoRASpec whose adapters vLLM applies itself (see above); None: plain weights only."""
        problem = vllm_install_problem(installed_vllm_version())
        if problem is not None:
            raise RuntimeError(problem)
        config.validate()
        self.device = torch.device(device)
        if self.device.type == "cpu" and model_config.head_dim not in CPU_HEAD_DIMS:
            raise ValueError(f"vLLM's CPU attention supports head_dim in {CPU_HEAD_DIMS}, the model has "
                             f"{model_config.head_dim}; use another model (e.g. the tiny-hd32 preset)")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine lives in this process
        from vllm import LLM

        self.model_config, self.config, self.dtype = model_config, config, dtype
        self.tp_group, self.bucket_bytes, self.logprobs_mode = tp_group, bucket_bytes, logprobs_mode
        if not dist.is_initialized():
            raise RuntimeError("VLLMEngine runs inside a torch.distributed world (torchrun); initialise it first")
        if self.device.type == "cpu":
            isolate_cpu_shm_groups()  # its TP groups' shared memory, apart from other worlds' on this host
        if idle_tp:
            self.tp = idle_tp
        else:
            self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
            _check_tp_group_matches_vllm(tp_group, self.tp)
        if dist.get_world_size() % self.tp:
            raise ValueError(f"rollout.engine=vllm cuts the world into blocks of gen tp={self.tp} ranks; the world "
                             f"size {dist.get_world_size()} is not a multiple of it")
        self.eos_token_ids = list(model_config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self._rng = random.Random(config.seed)  # same seed on every TP rank -> same draws for unseeded requests
        cuda = self.device.type == "cuda"
        self.sleep_level = 2 if cuda and config.free_memory_on_sleep else 0
        kw = {}
        if cuda:
            kw["gpu_memory_utilization"] = config.gpu_memory_fraction
        else:  # vLLM's CPU default asks for most of host memory; give it what the native engine would take
            # vLLM's CPU backend hands out KV in blocks of 128 tokens: every sequence holds whole blocks
            per_seq = -(-config.max_model_len // VLLM_CPU_BLOCK) * VLLM_CPU_BLOCK
            tokens = max(config.kv_cache_tokens or 0, config.max_num_seqs * per_seq)
            kw["kv_cache_memory_bytes"] = tokens * kv_bytes_per_token(model_config, tp=self.tp, dtype=dtype)
        self._dir = tempfile.TemporaryDirectory(prefix="hybridrl-vllm-")
        write_hf_config(model_config, self._dir.name, dtype=dtype)
        self.llm = LLM(model=self._dir.name, skip_tokenizer_init=True, load_format="dummy", dtype=dtype,
                       tensor_parallel_size=self.tp, distributed_executor_backend="external_launcher",
                       max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                       max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_model_len),
                       enable_prefix_caching=True, logprobs_mode=logprobs_mode, seed=config.seed,
                       enforce_eager=enforce_eager, enable_sleep_mode=self.sleep_level > 0,
                       async_scheduling=False,  # the step API: nothing in flight between step() calls
                       **({"enable_lora": True, "max_lora_rank": vllm_lora_rank(lora.rank), "max_loras": 1}
                          if lora else {}), **kw)
        self.lora, self.lora_request, self._lora_version = lora, None, 0
        # vLLM's exit-time shutdown tears down the torch.distributed world (ours), which the launcher has
        # already destroyed by then (tracebacks at every exit); the process's exit frees the engine anyway
        finalizer = getattr(self.llm.llm_engine.engine_core, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        self._max_budget = max(config.max_num_batched_tokens, config.max_model_len)  # vLLM's buffers are this big
        self.asleep = False
        self.loaded = False
        if self.llm.llm_engine.engine_core.engine_core.batch_queue is not None:
            raise RuntimeError("vLLM runs with a batch queue (async scheduling or pipeline parallel): its step() "
                               "would leave an iteration in flight, which the step API's settle() cannot wait for")
        self._live: dict[int, _Request] = {}  # step-API requests in flight
        self._ready: list[Completion] = []  # bad requests' error completions, for the next step()
        self._next_request = 0
        # prompt tokens vLLM ran (prefill_tokens) and found in its prefix cache instead (kv_reused_tokens: an agent's
        # earlier turns, a GRPO group's shared prompt), and tokens sampled (sampled_tokens): the native engine's names
        # (ppo/agents/driver.py and the partial rollouts' async/generated_tokens read them)
        self.stats = {"prefill_tokens": 0, "kv_reused_tokens": 0, "sampled_tokens": 0}
        if idle_tp:
            self.sleep()  # never generates: on CUDA its weights and KV cache leave the GPU for good

    # ---- RolloutEngine protocol ----
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors, each this rank's generation TP shard; collective over the TP group."""
        if self.asleep:
            raise RuntimeError("update_weights on a sleeping engine: call wake_up() first")
        from models.lora import is_adapter_name

        named = list(named_tensors)
        base = [(n, t) for n, t in named if not is_adapter_name(n)]
        adapters = [(n, t) for n, t in named if is_adapter_name(n)]
        if adapters and self.lora is None:
            raise ValueError(f"{adapters[0][0]}: this vLLM engine was built without lora=, it takes merged weights")
        if base:
            full = gather_full_tensors(base, group=self.tp_group, bucket_bytes=self.bucket_bytes)
            # in-process executor: the iterator (and its collectives) runs right here, inside vLLM's loader
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": full})
            self.loaded = True
        if adapters:
            self._load_adapter(dict(gather_full_tensors(adapters, group=self.tp_group,
                                                        bucket_bytes=self.bucket_bytes)))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def holds_weights(self) -> bool:
        """Whether vLLM still holds the base weights (then an update may send the LoRA adapters alone)."""
        return self.loaded

    def _load_adapter(self, adapters: dict[str, torch.Tensor]) -> None:
        """Full adapter tensors -> a PEFT directory served as the next LoRARequest (the previous one removed)."""
        from vllm.lora.request import LoRARequest

        from models.lora import save_peft_adapter

        self._lora_version += 1
        path = save_peft_adapter(adapters, self.lora, os.path.join(self._dir.name, f"policy-v{self._lora_version}"))
        old, self.lora_request = self.lora_request, LoRARequest(f"policy-v{self._lora_version}", self._lora_version,
                                                                str(path))
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            import shutil

            shutil.rmtree(old.lora_path, ignore_errors=True)

    def sleep(self) -> None:
        if self.asleep:
            return
        if self.sleep_level:
            self.llm.sleep(level=self.sleep_level)
        self.asleep = True

    def wake_up(self) -> None:
        if not self.asleep:
            return
        if self.sleep_level:
            self.llm.wake_up()
            self.loaded = False  # level 2 discarded the weights: update_weights must come before generate
        self.asleep = False

    def generate(self, prompts: list[list[int]],
                 sampling: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """The batch call: every request added, then the engine stepped until all finished."""
        return generate_by_steps(self, prompts, sampling)

    # ---- step API (rollout/base.py: SteppingEngine) ----
    def add_request(self, prompt: list[int], params: SamplingParams) -> int:
        """Queue `params.n` samples of `prompt`; usable between step() calls. Returns the request id its completions
        carry as `Completion.prompt_index`; a bad request comes back as "error" completions from the next step().
        Sample j is vLLM request "<id>.<j>" seeded with the request's seed + j, the seed vLLM's own n-sampling gives
        its j-th child, so the samples are those one LLM.generate call with n would draw."""
        if self.asleep:
            raise RuntimeError("add_request on a sleeping engine: call wake_up() (and update_weights) first")
        if not self.loaded:
            raise RuntimeError("add_request before update_weights: the engine holds vLLM's dummy weights")
        if self.lora is not None and self.lora_request is None:
            raise RuntimeError("add_request before the LoRA adapters arrived: update_weights must carry them")
        rid, self._next_request = self._next_request, self._next_request + 1
        prompt = [int(t) for t in prompt]
        err = check_request(prompt, params, max_model_len=self.config.max_model_len,
                            vocab_size=self.model_config.vocab_size)
        if err is None:
            err = request_matches_mode(self.logprobs_mode, temperature=params.temperature, top_k=params.top_k,
                                       top_p=params.top_p)
        if err is not None:
            self._ready += error_completions(rid, prompt, params, err)
            return rid
        # unseeded requests draw their seed here, in request order, so every TP rank agrees
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        self._apply_token_budget()
        lora = {} if self.lora_request is None else {"lora_request": self.lora_request}
        self._live[rid] = _Request(prompt, [_Sample() for _ in range(params.n)])
        for j in range(params.n):
            vparams = self._vllm_params(params, seed + j, room=self.config.max_model_len - len(prompt))
            self.llm.llm_engine.add_request(f"{rid}.{j}", {"prompt_token_ids": prompt}, vparams, **lora)
        return rid

    def step(self) -> list[Completion]:
        """One vLLM scheduler iteration (prefills and one decode step); the completions of the requests that
        finished in it, each request's `n` samples together. vLLM's in-process engine returns only once the
        iteration ran (no batch queue: checked at start-up), so nothing is left in flight between calls."""
        ready, self._ready = self._ready, []
        if self._live:
            outs = self.llm.llm_engine.step()
            for out in outs:
                self._absorb(out)
            # a step that returned nothing and left vLLM running nothing: never wait on a request forever
            if not outs and not self.llm.llm_engine.has_unfinished_requests():
                for s in (s for r in self._live.values() for s in r.samples if s.reason is None):
                    s.reason, s.error = "error", "vLLM no longer runs this request"
        done = [rid for rid, r in self._live.items() if all(s.reason is not None for s in r.samples)]
        return ready + [c for rid in done for c in self._completions(rid, self._live.pop(rid))]

    def settle(self) -> list[Completion]:
        """Nothing is in flight between step() calls (see step); what finished without a step: bad requests."""
        ready, self._ready = self._ready, []
        return ready

    def abort(self, request_id: int) -> list[Completion]:
        """Stop a request now and free its KV; its samples as they stand (finish_reason "abort" for those still
        running). Unknown or finished ids: []."""
        req = self._live.pop(request_id, None)
        if req is None:
            return []
        running = [j for j, s in enumerate(req.samples) if s.reason is None]
        processor = self.llm.llm_engine.output_processor
        for j in running:
            # vLLM's output processor holds what a request reporting only at its end (FINAL_ONLY) has not returned
            for internal in processor.external_req_ids.get(f"{request_id}.{j}", []):
                state = processor.request_states[internal]
                tokens = list(state.detokenizer.output_token_ids)
                self._count(req, req.samples[j], tokens, [lp[t] for t, lp in
                                                          zip(tokens, state.logprobs_processor.logprobs)],
                            cached=state.num_cached_tokens)
            req.samples[j].reason = "abort"
        self.llm.llm_engine.abort_request([f"{request_id}.{j}" for j in running])
        return self._completions(request_id, req)

    def has_unfinished(self) -> bool:
        return bool(self._live or self._ready)

    def _absorb(self, out) -> None:
        """One finished vLLM request "<id>.<j>" (RequestOutputKind.FINAL_ONLY: its whole output)."""
        rid, j = map(int, out.request_id.split("."))
        req = self._live.get(rid)
        if req is None or not out.finished:  # aborted since (nothing reports before its end)
            return
        s, c = req.samples[j], out.outputs[0]
        self._count(req, s, list(c.token_ids), [lp[t] for t, lp in zip(c.token_ids, c.logprobs)],
                    cached=out.num_cached_tokens)
        s.reason = c.finish_reason if c.finish_reason in ("stop", "length") else "error"
        s.error = None if s.reason != "error" else f"vLLM finished with {c.finish_reason!r}"

    def _count(self, req: _Request, s: _Sample, tokens: list[int], logprobs: list, *, cached: int | None) -> None:
        """Sample `s`'s tokens and log-probs (vLLM's Logprob entries of them) as they stand at its end or abort, and
        the engine's counters: its prompt's tokens prefilled or served by the prefix cache, its tokens sampled."""
        s.tokens, s.logprobs = tokens, [float(lp.logprob) for lp in logprobs]
        self.stats["kv_reused_tokens"] += cached or 0
        self.stats["prefill_tokens"] += len(req.prompt) - (cached or 0)
        self.stats["sampled_tokens"] += len(tokens)

    @staticmethod
    def _completions(rid: int, req: _Request) -> list[Completion]:
        return [Completion(rid, j, list(req.prompt), s.tokens, s.logprobs, s.reason, s.error)
                for j, s in enumerate(req.samples)]

    def _apply_token_budget(self) -> None:
        """config.max_num_batched_tokens (the batch controller's knob) acts at the next request, as in the
        native engine: vLLM's scheduler budget per step, at most what vLLM sized its buffers for."""
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        scheduler.max_num_scheduled_tokens = min(max(self.config.max_num_batched_tokens, 1), self._max_budget)

    def _vllm_params(self, p: SamplingParams, seed: int, *, room: int):
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        stops = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
        # ignore_eos=True: vLLM's own EOS (from a tokenizer we do not give it) stays out; ours are stop ids
        # one sample a request, reported when it ends (abort() reads the tokens so far from vLLM's state)
        return VSamplingParams(n=1, temperature=p.temperature, top_k=max(p.top_k, 0), top_p=p.top_p,
                               max_tokens=min(p.max_tokens, room), seed=seed, stop_token_ids=stops,
                               ignore_eos=True, logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
