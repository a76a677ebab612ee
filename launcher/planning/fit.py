"""Memory settings left unset, chosen at launch by the cost model: the fastest choice that fits the GPU.

    choices = fit_memory(cfg, lambda c: compute_plan(c, world_size=8, model=m).predicted)  # before planning

Unset keys: `<role>.activation_checkpointing` and `<role>.offload_optimizer` of the trained roles (actor,
critic; the forward-only roles keep no activations for a backward and have no such key). The trained roles
of the native backend try, in this order, (no recompute, Adam on the GPU), (no recompute, Adam's moments
streamed from host memory), (full recompute, Adam on the GPU), (full recompute, host moments); the cost
model's fastest candidate whose predicted peak fits wins, and when none fits, the most frugal is taken
(its plan then says by how much it misses). The megatron backend keeps its Adam on the GPU and recomputes
nothing unless told (its full recompute is its own). Off CUDA nothing needs fitting. Each choice returns as
one log line with the predicted step time and peak.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

from launcher.config.schema import Config, active_roles
from launcher.errors import UserError

TRAINED = ("actor", "critic")
CANDIDATES = (("none", False), ("none", True), ("full", False), ("full", True))


def fit_memory(cfg: Config, predict: Callable[[Config], dict], *, cuda: bool | None = None) -> list[str]:
    """Resolve the unset memory keys of `cfg` in place. predict: a config -> its plan's cost-model prediction
    (`compute_plan(c, ...).predicted`; passed in, so planning imports this module and not the reverse).
    -> one line per choice: key=value (auto: why)."""
    from launcher.config.auto import on_cuda

    cuda = on_cuda(cfg) if cuda is None else cuda
    lines: list[str] = []
    for role in TRAINED:  # a role the run does not use: nothing to fit (no line)
        sec = getattr(cfg, role)
        if role not in active_roles(cfg) and _unset(cfg, role):
            sec.activation_checkpointing = sec.activation_checkpointing or "none"
            sec.offload_optimizer = bool(sec.offload_optimizer)
    if cfg.actor.offload_optimizer is None and cfg.actor.offload_optimizer_while_generating:
        cfg.actor.offload_optimizer = False  # the two are exclusive (validation); the one set wins (no line)
    open_roles = [r for r in TRAINED if _unset(cfg, r)]
    if not open_roles:
        return lines
    native = [r for r in open_roles if getattr(cfg, r).backend == "native"]
    for role in open_roles:  # the defaults first: what stays unset below is searched
        sec = getattr(cfg, role)
        if role not in native or not cuda:
            sec.activation_checkpointing = "none" if sec.activation_checkpointing is None else \
                sec.activation_checkpointing
            sec.offload_optimizer = False if sec.offload_optimizer is None else sec.offload_optimizer
    if not cuda or not native:
        return lines
    best = _search(cfg, native, predict)
    (ac, offload), pred, fits = best
    why = (f"the fastest that fits: predicted step {pred['predicted_step_s']:.1f} s, peak {pred['peak_gb']:.0f} GB"
           if fits else f"nothing fits; the most frugal: predicted peak {pred['peak_gb']:.0f} GB")
    for role in native:
        sec = getattr(cfg, role)
        if sec.activation_checkpointing is None:
            sec.activation_checkpointing = ac
            lines.append(f"{role}.activation_checkpointing={ac} (auto: {why})")
        if sec.offload_optimizer is None:
            sec.offload_optimizer = offload
            lines.append(f"{role}.offload_optimizer={str(offload).lower()} (auto: {why})")
    return lines


def _unset(cfg: Config, role: str) -> bool:
    sec = getattr(cfg, role)
    return sec.activation_checkpointing is None or sec.offload_optimizer is None


def _search(cfg: Config, roles: list[str], predict: Callable[[Config], dict]):
    """-> ((ac, offload), the plan's prediction, fits) of the chosen candidate."""
    tried = []
    for ac, offload in CANDIDATES:
        trial = copy.deepcopy(cfg)
        for role in roles:
            sec = getattr(trial, role)
            if sec.activation_checkpointing is None:
                sec.activation_checkpointing = ac
            if sec.offload_optimizer is None:
                sec.offload_optimizer = offload
        try:
            pred = predict(trial)
        except UserError:  # a layout the planner refuses whatever the memory: compute_plan will say so
            pred = {"predicted_step_s": math.inf, "peak_gb": math.inf, "reject": "refused"}
        tried.append(((ac, offload), pred, pred.get("reject") is None))
    feasible = [t for t in tried if t[2]]
    if feasible:
        return min(feasible, key=lambda t: t[1]["predicted_step_s"])
    return min(tried, key=lambda t: t[1]["peak_gb"])
