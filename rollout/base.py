"""The rollout contract: `SamplingParams`, `Completion`, `RolloutConfig` and the `RolloutEngine` protocol.

The PPO trainer and the hybrid engine talk to every generation backend (native, Hugging Face,
vLLM) only through these types:

    engine.wake_up(); engine.update_weights(actor_shards); out = engine.generate(prompts, params)
    engine.sleep()   # give the KV cache and graphs back to training

`Completion.logprobs` is the log-probability of each sampled token under softmax(logits / T)
(T = 1 for greedy) *without* top-k/top-p renormalisation: the quantity the trainer recomputes, so
the PPO ratio is exactly 1 on-policy.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 -> greedy
    top_k: int = -1  # <= 0 disables
    top_p: float = 1.0
    max_tokens: int = 256
    n: int = 1  # samples per prompt, sharing one prefill (GRPO: 8-16)
    seed: int | None = None  # per-request seed -> reproducible whatever the batch around it
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass(slots=True)
class Completion:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]  # the stop/EOS token that ended a "stop" completion is included
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "error" | "abort" (step API: stopped by the caller)
    error: str | None = None
    # a mixture of experts (native engine): the experts each token the engine ran went to, [P + R - 1, L_moe, k]
    # int16 (prompt tokens, then every response token but the last, which was sampled and never run)
    routed_experts: torch.Tensor | None = None


DECODE_ATTENTION = ("auto", "triton", "sdpa", "sdpa-efficient", "sdpa-cudnn", "bmm")  # RolloutConfig.decode_attention
KV_CACHE_DTYPES = ("auto", "fp8")  # RolloutConfig.kv_cache_dtype


@dataclass(slots=True)
class RolloutConfig:
    """Sizing of the native engine. The KV cache is one contiguous slot of `max_model_len` tokens per
    running sequence (see rollout/kv_cache.py for why), so the number of slots is the concurrency."""

    gpu_memory_fraction: float = 0.5  # of the free GPU memory after weights, for the KV cache
    max_num_seqs: int = 256  # running sequences (KV slots) at most
    # KV slots beyond max_num_seqs where finished sequences keep their KV under a session (an agent's trajectory
    # while its tool runs, a partial rollout between steps) when more sequences wait than decode at once: a parked
    # slot a waiting sequence needs is copied there instead of evicted. 0: parked KV lives in the decode slots only
    max_parked_seqs: int = 0
    max_num_batched_tokens: int = 16384  # prefill budget per step, counted as padded rows x length
    max_model_len: int = 2048  # prompt + generated tokens of one sequence
    min_admit_fraction: float = 0.0625  # batch admissions: prefill once this share of slots is free
    # continuations (kept KV: an agent's next turn) wait for that many of them, or at most this many engine steps,
    # so returning turns share a prefill instead of each stalling the decode batch with its own
    continuation_wait_steps: int = 16
    # whether a new sequence may take a parked session's slot by evicting its KV (its next turn then prefills the
    # whole history) while other sequences run; False: it waits for a slot (an idle engine always admits). An
    # experiment until a GPU prices prefill steps (docs/agents.md)
    evict_parked_for_new: bool = True
    # single-sequence fresh rows (an agent's first turn, a turn whose KV was evicted) run in their prefill step's
    # continuation wave, from position 0, instead of a prompt forward of their own: one forward per prefill step,
    # replayed as a CUDA graph of its bucket (rollout/continuation_graphs.py) rather than launched from Python. Not
    # with an fp8 cache (the wave attends to the cache's dequantized K/V) or a mixture of experts (no wave graphs).
    # An experiment until a GPU prices it: a prefill step of the queued agents costs ~22 ms whatever its tokens
    fresh_rows_in_waves: bool = False
    block_size: int = 32  # granule of the decode KV-length buckets (one CUDA graph per bucket)
    enable_cuda_graph: bool = True  # CUDA only; CPU always runs eagerly
    kv_cache_tokens: int | None = None  # explicit KV size in tokens (overrides gpu_memory_fraction; CPU default)
    seed: int = 0  # draws the keys of requests without their own seed (identical on every TP rank)
    drop_weights_on_sleep: bool = True  # the engine's weights only mirror the trainer's: free them on sleep
    # False: sleep() frees nothing (KV cache, weights and CUDA graphs stay; update_weights copies in place),
    # for when training fits beside the engine: no re-allocation and no graph re-capture every step
    free_memory_on_sleep: bool = True
    decode_attention: str = "auto"  # "auto" (time the kernels below per graph shape on CUDA), "triton"
    # (rollout/triton_attention.py; CUDA), "sdpa", "sdpa-efficient", "sdpa-cudnn" (SDPA forced to one
    # backend) or "bmm" (two batched matmuls)
    fuse_projections: bool = True  # q/k/v and gate/up as one GEMM each (weights copied, not aliased)
    # with fuse_projections: the RMSNorm weights folded into the q/k/v and gate/up weights at load, the row
    # scale applied by the kernels after them and the residual adds inside the o/down GEMMs: no norm kernels
    # in a decode layer (rollout/folded_norms.py; layers with q/k/v biases or q/k norms keep theirs)
    fold_norms: bool = True
    # the triton decode kernel reads the prompt KV of the n samples admitted in one prefill row once per
    # group, not once per sample (rollout/shared_prefix.py); False: every row reads its own slot
    share_prompt_kv: bool = True
    compile: bool = False  # torch.compile the decode step (fuses norms/RoPE/SiLU/sampling; one dynamic-shape compile)
    # "auto": the engine's dtype; "fp8": float8 e4m3 values with one fp32 scale per (token, KV head) (about half
    # the KV bytes a decode step reads, twice the sequences per GB; rollout/kv_cache.py)
    kv_cache_dtype: str = "auto"

    def validate(self) -> None:
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction={self.gpu_memory_fraction} must be in (0, 1]")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} leaves no room for a prompt and a token")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.max_model_len:
            raise ValueError(f"kv_cache_tokens={self.kv_cache_tokens} cannot hold one sequence of max_model_len="
                             f"{self.max_model_len}; raise kv_cache_tokens or lower max_model_len")
        if self.max_parked_seqs < 0:
            raise ValueError(f"max_parked_seqs={self.max_parked_seqs} must be >= 0")
        if self.continuation_wait_steps < 0:
            raise ValueError(f"continuation_wait_steps={self.continuation_wait_steps} must be >= 0")
        if not 0.0 <= self.min_admit_fraction <= 1.0:
            raise ValueError(f"min_admit_fraction={self.min_admit_fraction} must be in [0, 1]")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}; choose one of {KV_CACHE_DTYPES}")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention={self.decode_attention!r}; choose one of {DECODE_ATTENTION}")


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]],
                 sampling: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Completions in prompt-major order, `n` per prompt (bad requests come back as "error")."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors, each THIS rank's generation TP shard (parallel/sharding.tp_slices)."""
        ...

    def sleep(self) -> None:
        """Free the KV cache, CUDA graphs and any generation-only memory."""
        ...

    def wake_up(self) -> None:
        """Re-create what sleep() freed."""
        ...


class SteppingEngine(RolloutEngine, Protocol):
    """An engine the caller drives one iteration at a time (agent loops, partial rollouts): requests are
    added while it runs, step() advances every running request by one prefill or decode step and returns
    the requests that finished, abort() stops one and returns its tokens so far. `generate()` is a loop
    over these. Under TP every rank makes the same calls in the same order.

        rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=64, n=1))
        while engine.has_unfinished():
            for c in engine.step():   # Completion.prompt_index is the request id
                ...                   # e.g. add a follow-up request with c.prompt_ids + c.token_ids + obs
        engine.settle()               # no device work in flight: weights may be swapped here

    The native engine also keeps KV between requests: `add_request(prompt, params, sessions=[key] * n)` parks each
    finished sample's KV slot under its key, a later request under that key whose prompt extends the sample's
    tokens prefills only the new ones, `release_session(key)` frees it, `abort(rid, park=True)` parks the unfinished
    ones (docs/agents.md, kept KV). Callers check for `release_session` before using them.
    """

    def add_request(self, prompt: list[int], params: SamplingParams) -> int:
        """Queue `params.n` samples of `prompt`; returns the request id (a bad one finishes as "error")."""
        ...

    def step(self) -> list[Completion]:
        """Advance the engine one iteration; completions of the requests whose every sample finished."""
        ...

    def abort(self, request_id: int) -> list[Completion]:
        """Stop a request, free its KV; its samples so far (finish_reason "abort" where still running)."""
        ...

    def settle(self) -> list[Completion]:
        """Finish the step in flight so no device work is pending; what finished in it."""
        ...

    def has_unfinished(self) -> bool:
        ...


def check_request(prompt: list[int], params: SamplingParams, *, max_model_len: int, vocab_size: int) -> str | None:
    """The reason request (prompt, params) cannot run, or None when it is valid."""
    if not isinstance(params, SamplingParams):
        return f"sampling params must be SamplingParams, got {type(params).__name__}"
    if len(prompt) == 0:
        return "empty prompt: give at least one token id (e.g. the BOS token)"
    if len(prompt) >= max_model_len:
        return (f"prompt of {len(prompt)} tokens leaves no room to generate within max_model_len="
                f"{max_model_len}; shorten the prompt or raise max_model_len")
    bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
    if bad:
        return f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
    if not params.temperature >= 0.0:  # also catches NaN
        return f"temperature={params.temperature} must be >= 0 (0 means greedy)"
    if not 0.0 < params.top_p <= 1.0:
        return f"top_p={params.top_p} must be in (0, 1] (1 disables)"
    if not isinstance(params.top_k, int):
        return f"top_k={params.top_k!r} must be an int (<= 0 disables)"
    if not isinstance(params.n, int) or params.n < 1:
        return f"n={params.n} must be an int >= 1"
    if not isinstance(params.max_tokens, int) or params.max_tokens < 1:
        return f"max_tokens={params.max_tokens} must be an int >= 1"
    if params.seed is not None and not isinstance(params.seed, int):
        return f"seed={params.seed!r} must be an int or None"
    return None


def error_completions(prompt_index: int, prompt: list[int], params: SamplingParams, error: str) -> list[Completion]:
    """The failed request's completions (one per sample, at least one)."""
    n = params.n if isinstance(getattr(params, "n", None), int) and params.n >= 1 else 1
    return [Completion(prompt_index, i, list(prompt), [], [], "error", error) for i in range(n)]


def generate_by_steps(engine: SteppingEngine, prompts: list[list[int]],
                      sampling: SamplingParams | list[SamplingParams]) -> list[Completion]:
    """A stepping engine's `generate`: every request added, then the engine stepped until all finished; the
    completions in prompt-major order, `prompt_index` the prompt's position."""
    if engine.has_unfinished():
        raise RuntimeError("generate() while step-API requests are unfinished: step or abort them first")
    params = expand_sampling(sampling, len(prompts))
    index = {engine.add_request(prompt, p): i for i, (prompt, p) in enumerate(zip(prompts, params))}
    results: dict[int, list[Completion]] = {}
    while engine.has_unfinished():
        for c in engine.step():
            c.prompt_index = index[c.prompt_index]
            results.setdefault(c.prompt_index, []).append(c)
    return [c for i in range(len(prompts)) for c in sorted(results[i], key=lambda c: c.sample_index)]


def expand_sampling(sampling: SamplingParams | list[SamplingParams], num_prompts: int) -> list[SamplingParams]:
    """One SamplingParams per prompt; a list of the wrong length is a caller bug and raises."""
    if isinstance(sampling, list):
        if len(sampling) != num_prompts:
            raise ValueError(f"got {len(sampling)} SamplingParams for {num_prompts} prompts; "
                             "pass one, or one per prompt")
        return sampling
    return [sampling] * num_prompts
