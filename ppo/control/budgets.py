"""The step's token budgets and their one owner: the CUDA-OOM back-off and the batch controller both
change them here, and nowhere else.

    budgets = TokenBudgets({"actor": 16384, "ref": 16384}, controller=BatchController(...), max_oom_retries=3)
    out = budgets.run("update_actor", "actor", lambda b: update(max_tokens=b), retry_safe=...)  # halves on OOM
    metrics.update(budgets.control(util_mean=0.42, mem_frac=0.61))   # step boundary only

A role's budget is the micro-batch token count its forwards and updates pack. The controller decides one
micro-batch budget (for the actor) and every role's budget follows it in proportion to its configured
value; the rollout engine's token budget is handed to `set_rollout_tokens`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from ppo.control.controller import ACTIONS, CAUSES, BatchController, is_cuda_oom, run_with_oom_backoff

T = TypeVar("T")
log = logging.getLogger("hybridrl")
MIN_BUDGET = 256  # tokens: neither the back-off nor the controller goes below it (or below the configured value)


class TokenBudgets:
    """Micro-batch token budgets per role (`actor`, `ref`, `critic`, ...)."""

    def __init__(self, configured: dict[str, int], *, controller: BatchController | None = None,
                 max_oom_retries: int = 3, set_rollout_tokens: Callable[[int], None] | None = None,
                 rank: int = 0):
        self.configured = dict(configured)  # role -> the configured budget (the controller scales these)
        self.current = dict(configured)
        self.controller, self.max_oom_retries = controller, max_oom_retries
        self.set_rollout_tokens, self.rank = set_rollout_tokens, rank

    def __getitem__(self, role: str) -> int:
        return self.current[role]

    def run(self, stage: str, role: str, fn: Callable[[int], T], *,
            retry_safe: Callable[[], bool] | None = None) -> T:
        """fn(budget) with the role's budget; on CUDA OOM halve it and rerun (no sample is lost: fn re-reads
        the whole batch). retry_safe() says whether a rerun is still safe (an update retries only before its
        first optimizer step, so no mini-batch is applied twice). The lowered budget stays for later steps."""
        def safe_oom(err: BaseException) -> bool:
            return is_cuda_oom(err) and (retry_safe is None or retry_safe())

        def record(old: int, new: int) -> None:
            log.warning("%s: CUDA out of memory at %d tokens per micro-batch; retrying with %d", stage, old, new)
            self.current[role] = new
            if self.controller is not None and role == "actor":
                self.controller.record_oom(failed=old, new=new)

        budget = self.current[role]
        out, self.current[role] = run_with_oom_backoff(
            fn, budget=budget, min_budget=min(MIN_BUDGET, budget), max_retries=self.max_oom_retries,
            on_oom=record, is_oom=safe_oom, name=stage)
        return out

    def control(self, *, util_mean: float | None, mem_frac: float | None) -> dict[str, float]:
        """Step boundary only: the controller's decision from this step's utilization and memory (fractions
        in [0, 1], the same on every rank) resizes every role's budget. -> controller/* metrics."""
        if self.controller is None:
            return {}
        d = self.controller.decide(util_mean, mem_frac)
        scale = d.micro_batch_tokens / self.configured["actor"]
        for role, base in self.configured.items():
            self.current[role] = max(MIN_BUDGET, int(base * scale))
        if self.set_rollout_tokens is not None:
            self.set_rollout_tokens(d.rollout_tokens)
        if self.rank == 0 and d.action != "hold":
            log.info("batch controller: %s (%s) -> micro-batch %d tokens, rollout %d tokens",
                     d.action, d.reason, d.micro_batch_tokens, d.rollout_tokens)
        out = {"controller/micro_batch_tokens": float(d.micro_batch_tokens),
               "controller/rollout_tokens": float(d.rollout_tokens),
               "controller/action": float(ACTIONS[d.action]),
               "controller/cause": float(CAUSES.index(d.cause))}
        if util_mean is not None:
            out["controller/util_mean"] = util_mean
        if mem_frac is not None:
            out["controller/mem_frac"] = mem_frac
        return out
