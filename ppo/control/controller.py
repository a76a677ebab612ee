"""Batch-size controller (NVML feedback on token budgets) and CUDA-OOM back-off.

    ctl = BatchController(rollout_tokens=65536, micro_batch_tokens=16384)
    ...                                               # one full PPO step runs with ctl's budgets
    util, mem = agree_feedback(summary.get("gpu/util_mean"), cuda_peak_mem_frac(), group=world)
    d = ctl.decide(util, mem)
    next_rollout, next_micro = d.rollout_tokens, d.micro_batch_tokens

`decide` is called at step boundaries only, never inside a step. Within a step the old
log-probs are recomputed with the same micro-batch shapes as the PPO update, so the
first update's ratio is exactly 1 (same kernels, same reduction order, same padding);
changing the micro-batch budget between the recompute and the update would make the
ratio drift from 1 by numerical noise and bias the first clipped update.

Every rank must get the same decision, or ranks would disagree on micro-batch counts and
hang in a collective: call `agree_feedback` (mean utilization, max memory over the group)
before `decide`, so all ranks feed identical numbers to identical controllers.

`run_with_oom_backoff(stage_fn, budget=...)` runs one stage with a token budget and,
on CUDA OOM, frees memory, halves the budget and reruns the stage on the same input.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")
# why a decision was taken, as the metric controller/cause reports it (the index into this tuple)
CAUSES = ("no_reading", "util_ok", "low_util", "mem_unknown", "would_pass_high_mem", "grow", "at_max",
          "mem_high", "at_min")
ACTIONS = {"shrink": -1, "hold": 0, "grow": 1}  # controller/action


@dataclass(slots=True)
class Decision:
    """What `BatchController.decide` chose for the next step."""

    step: int
    action: str  # "grow" | "shrink" | "hold"
    reason: str  # for a person: the numbers behind the decision
    cause: str  # for a metric: one of CAUSES
    rollout_tokens: int
    micro_batch_tokens: int
    util_mean: float | None
    mem_frac: float | None


class BatchController:
    """Grows token budgets while the GPUs are under-used, shrinks them under memory pressure.

    - memory above `high_mem` (fraction of device memory): shrink both budgets by `shrink` at once;
    - utilization below `low_util` for `hysteresis_steps` consecutive steps, with memory known
      and the grown budget projected under `high_mem`: grow both budgets by `grow`;
    - otherwise hold. After a shrink, growth stops one `grow` factor below the budget that hit
      the memory mark (a ceiling), so a shrink/grow cycle cannot oscillate.
    Budgets are clamped to [min, max] (default: initial/16 .. initial*8) and rounded to `multiple_of`.
    """

    def __init__(
        self,
        *,
        rollout_tokens: int,
        micro_batch_tokens: int,
        low_util: float = 0.60,
        high_mem: float = 0.85,
        grow: float = 1.2,
        shrink: float = 0.5,
        min_rollout_tokens: int | None = None,
        max_rollout_tokens: int | None = None,
        min_micro_batch_tokens: int | None = None,
        max_micro_batch_tokens: int | None = None,
        hysteresis_steps: int = 2,
        multiple_of: int = 1,
    ):
        if not (grow > 1.0 and 0.0 < shrink < 1.0):
            raise ValueError(f"need grow > 1 and 0 < shrink < 1, got grow={grow}, shrink={shrink}")
        if not (0.0 < low_util <= 1.0 and 0.0 < high_mem <= 1.0):
            raise ValueError(f"low_util({low_util}) and high_mem({high_mem}) are fractions in (0, 1]")
        if hysteresis_steps < 1 or multiple_of < 1:
            raise ValueError(f"hysteresis_steps({hysteresis_steps}) and multiple_of({multiple_of}) must be >= 1")
        self.low_util, self.high_mem = low_util, high_mem
        self.grow, self.shrink = grow, shrink
        self.hysteresis_steps, self.multiple_of = hysteresis_steps, multiple_of
        self.bounds = {
            "rollout_tokens": (min_rollout_tokens or max(multiple_of, rollout_tokens // 16),
                               max_rollout_tokens or rollout_tokens * 8),
            "micro_batch_tokens": (min_micro_batch_tokens or max(multiple_of, micro_batch_tokens // 16),
                                   max_micro_batch_tokens or micro_batch_tokens * 8),
        }
        for key, (lo, hi) in self.bounds.items():
            if lo > hi:
                raise ValueError(f"min {key}({lo}) > max {key}({hi}); fix the controller bounds")
        self.rollout_tokens = self._clamp("rollout_tokens", rollout_tokens)
        self.micro_batch_tokens = self._clamp("micro_batch_tokens", micro_batch_tokens)
        self.ceiling: dict[str, int | None] = {"rollout_tokens": None, "micro_batch_tokens": None}
        self.low_streak = 0
        self.step = 0
        self.history: list[dict[str, Any]] = []

    def _clamp(self, key: str, value: float) -> int:
        lo, hi = self.bounds[key]
        v = int(value) // self.multiple_of * self.multiple_of
        return max(lo, min(hi, v))

    def _grown(self, key: str, value: int) -> int:
        new = self._clamp(key, max(value * self.grow, value + self.multiple_of))
        cap = self.ceiling[key]
        if cap is not None:  # stay one growth factor under the budget that hit the memory mark
            new = min(new, max(value, self._clamp(key, cap / self.grow)))
        return new

    def decide(self, util_mean: float | None, mem_frac: float | None) -> Decision:
        """Budgets for the next step from this step's mean utilization and peak memory fraction.

        Both are fractions in [0, 1] (None: unknown, e.g. no NVML). Call between steps only.
        """
        for name, v in (("util_mean", util_mean), ("mem_frac", mem_frac)):
            if v is not None and not 0.0 <= v <= 1.0 + 1e-6:
                raise ValueError(f"{name}={v} is not a fraction in [0, 1]; pass percent / 100")
        self.step += 1
        action, reason, cause = "hold", "no utilization reading", "no_reading"
        if mem_frac is not None and mem_frac >= self.high_mem:
            for key in self.ceiling:  # keep the lowest budget known to be too big (an OOM's may be lower)
                cur = getattr(self, key)
                self.ceiling[key] = cur if self.ceiling[key] is None else min(cur, self.ceiling[key])
            new_r = self._clamp("rollout_tokens", self.rollout_tokens * self.shrink)
            new_m = self._clamp("micro_batch_tokens", self.micro_batch_tokens * self.shrink)
            self.low_streak = 0
            action = "shrink" if (new_r, new_m) != (self.rollout_tokens, self.micro_batch_tokens) else "hold"
            cause = "mem_high" if action == "shrink" else "at_min"
            reason = f"mem {mem_frac:.2f} >= high_mem {self.high_mem:.2f}" + ("" if action == "shrink" else
                                                                                " (at min bounds)")
            self.rollout_tokens, self.micro_batch_tokens = new_r, new_m
        elif util_mean is not None:
            if util_mean >= self.low_util:
                self.low_streak = 0
                reason, cause = f"util {util_mean:.2f} >= low_util {self.low_util:.2f}", "util_ok"
            else:
                self.low_streak += 1
                reason = f"util {util_mean:.2f} < low_util {self.low_util:.2f} for {self.low_streak} step(s)"
                cause = "low_util"
                if self.low_streak >= self.hysteresis_steps:
                    if mem_frac is None:
                        reason, cause = reason + "; memory unknown, not growing", "mem_unknown"
                    elif mem_frac * self.grow >= self.high_mem:
                        reason += f"; mem {mem_frac:.2f} x {self.grow} would pass high_mem"
                        cause = "would_pass_high_mem"
                    else:
                        new_r = self._grown("rollout_tokens", self.rollout_tokens)
                        new_m = self._grown("micro_batch_tokens", self.micro_batch_tokens)
                        if (new_r, new_m) != (self.rollout_tokens, self.micro_batch_tokens):
                            action, cause = "grow", "grow"
                            self.rollout_tokens, self.micro_batch_tokens = new_r, new_m
                        else:
                            reason, cause = reason + "; at max bounds / memory ceiling", "at_max"
                        self.low_streak = 0
        d = Decision(step=self.step, action=action, reason=reason, cause=cause, rollout_tokens=self.rollout_tokens,
                     micro_batch_tokens=self.micro_batch_tokens, util_mean=util_mean, mem_frac=mem_frac)
        self.history.append(asdict(d))
        # every decision is logged; holds at DEBUG so a steady run's log is not one line per step
        log.log(logging.DEBUG if action == "hold" else logging.INFO,
                "batch controller step %d: %s -> rollout_tokens=%d micro_batch_tokens=%d (%s)",
                d.step, action, d.rollout_tokens, d.micro_batch_tokens, reason)
        return d

    def record_oom(self, *, failed: int, new: int, key: str = "micro_batch_tokens") -> None:
        """An OOM back-off lowered a budget (`key`) from `failed` to `new`: adopt it, never grow back
        to `failed`. Fits `run_with_oom_backoff(on_oom=lambda f, n: ctl.record_oom(failed=f, new=n))`."""
        if key not in self.bounds:
            raise ValueError(f"unknown budget {key!r}; one of {sorted(self.bounds)}")
        self.ceiling[key] = failed if self.ceiling[key] is None else min(failed, self.ceiling[key])
        setattr(self, key, self._clamp(key, new))
        self.low_streak = 0
        self.history.append({"step": self.step, "action": "oom", "reason": f"CUDA OOM at {key}={failed}",
                             "cause": "oom",
                             "rollout_tokens": self.rollout_tokens, "micro_batch_tokens": self.micro_batch_tokens,
                             "util_mean": None, "mem_frac": None})
        log.warning("batch controller: OOM back-off set %s=%d (was %d)", key, getattr(self, key), failed)

    def state_dict(self) -> dict[str, Any]:
        return {"rollout_tokens": self.rollout_tokens, "micro_batch_tokens": self.micro_batch_tokens,
                "ceiling": dict(self.ceiling), "low_streak": self.low_streak, "step": self.step,
                "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rollout_tokens = self._clamp("rollout_tokens", state["rollout_tokens"])
        self.micro_batch_tokens = self._clamp("micro_batch_tokens", state["micro_batch_tokens"])
        self.ceiling = dict(state["ceiling"])
        self.low_streak, self.step = int(state["low_streak"]), int(state["step"])
        self.history = list(state["history"])


def cuda_peak_mem_frac(device: torch.device | int | None = None, *, reset: bool = True) -> float | None:
    """Peak allocated / total memory of a CUDA device since the last reset; None without CUDA.

    Preferred over NVML's memory reading for `decide`: NVML sees the caching allocator's
    reserve, which never shrinks, so it would keep the controller shrinking after one peak.
    """
    if not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device()).total_memory
    frac = torch.cuda.max_memory_allocated(device) / total
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return frac


def agree_feedback(
    util_mean: float | None, mem_frac: float | None, *, group: Any = None
) -> tuple[float | None, float | None]:
    """The same (utilization, memory) on every rank of `group`: the mean utilization over the ranks
    that have a reading and the max memory fraction (the fullest GPU decides). Identity without
    torch.distributed. Collective: every rank calls it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return util_mean, mem_frac
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    util = torch.tensor([util_mean or 0.0, float(util_mean is not None)], dtype=torch.float64, device=device)
    mem = torch.tensor([-1.0 if mem_frac is None else mem_frac], dtype=torch.float64, device=device)
    dist.all_reduce(util, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX, group=group)
    u_sum, n = util.tolist()
    m = mem.item()
    return (u_sum / n if n > 0 else None), (m if m >= 0 else None)


def is_cuda_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError)


def free_accelerator_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class OOMBackoffExhausted(RuntimeError):
    """A stage kept running out of memory after every allowed halving of its budget."""


def run_with_oom_backoff(
    stage_fn: Callable[[int], T],
    *,
    budget: int,
    min_budget: int,
    max_retries: int = 3,
    on_oom: Callable[[int, int], None] | None = None,
    is_oom: Callable[[BaseException], bool] = is_cuda_oom,
    name: str = "stage",
) -> tuple[T, int]:
    """Run `stage_fn(budget)`; on OOM free memory, halve the budget and rerun. -> (result, final budget).

    `stage_fn` must be re-runnable: it gets the full input again on every call (the caller
    closes over the whole batch and only the micro-batch budget changes), so no sample is lost.
    For the actor, wrap old-log-prob recompute and the update in one stage function: a retry
    then recomputes the old log-probs with the halved micro-batches too, and ratio == 1 holds.
    `on_oom(old_budget, new_budget)` is called before each retry (e.g. `BatchController.record_oom`).
    """
    if min_budget < 1 or budget < min_budget:
        raise ValueError(f"{name}: need 1 <= min_budget({min_budget}) <= budget({budget})")
    tried = [budget]
    retries = 0
    while True:
        oom_msg = None
        try:
            return stage_fn(budget), budget
        except BaseException as err:  # noqa: BLE001 - filtered by is_oom right below
            if not is_oom(err):
                raise
            oom_msg = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            if retries >= max_retries or budget <= min_budget:
                raise OOMBackoffExhausted(
                    f"{name} ran out of memory at budgets {' -> '.join(map(str, tried))} tokens "
                    f"(min_budget {min_budget}, max_retries {max_retries}); last error {oom_msg}. "
                    "Lower the micro-batch token budget, raise tensor/pipeline parallelism, or enable offload."
                ) from err
        # outside the except block: the traceback (and the frames holding activations) is dropped,
        # so gc + empty_cache can actually return that memory before the retry
        free_accelerator_memory()
        new_budget = max(min_budget, budget // 2)
        log.warning("%s: CUDA OOM at budget %d (%s); retrying with %d", name, budget, oom_msg, new_budget)
        if on_oom is not None:
            on_oom(budget, new_budget)
        budget = new_budget
        tried.append(budget)
        retries += 1
