"""Memory settings left unset, chosen at launch by the cost model: the fastest choice that fits the GPU.

    choices = fit_memory(cfg, lambda c: compute_plan(c, world_size=8, model=m).predicted, device_gb=80.0)

Unset keys:
- `<role>.activation_checkpointing` and `<role>.offload_optimizer` of the trained roles (actor, critic; the
  forward-only roles keep no activations for a backward and have no such key). The trained roles of the native
  backend try, in this order, (no recompute, Adam on the GPU), (no recompute, Adam's moments streamed from host
  memory), (full recompute, Adam on the GPU), (full recompute, host moments). The megatron backend keeps its Adam on
  the GPU and recomputes nothing unless told (its full recompute is its own).
- `<role>.max_tokens_per_micro_batch` of every model role (actor, critic, ref, reward.model): the largest budgets, up
  to BUDGET_CAPS, whose predicted training peak (states, the largest micro-batch's activations, an engine kept
  resident) is at most BUDGET_MEMORY_FRACTION of the GPU, the batch controller's default shrink threshold, so a run
  starts where the controller would hold it. The unset roles' budgets shrink together along BUDGET_SCALES of their
  caps, never below the longest sample (data.max_prompt_length + rollout.max_response_length). The caps: past ~16k
  tokens a micro-batch's GEMMs gain nothing at these widths, while its activations and logits keep growing.

Each (recompute, offload) candidate gets the largest budgets it fits; the cost model's fastest candidate that fits
wins, and when none fits, the most frugal is taken (its plan then says by how much it misses; the CUDA-OOM back-off
lowers a budget that still does not fit). Off CUDA nothing needs fitting (launcher.config.auto chose the CPU
budgets). Each choice returns as one log line with its reason.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

from launcher.config.schema import MODEL_ROLES, Config, active_roles, role_section, section_name
from launcher.errors import UserError

TRAINED = ("actor", "critic")
CANDIDATES = (("none", False), ("none", True), ("full", False), ("full", True))
BUDGET_CAPS = {"actor": 16384, "critic": 16384, "ref": 32768, "reward": 32768}  # tokens per micro-batch
BUDGET_SCALES = (1.0, 0.75, 0.5, 0.375, 0.25, 0.1875, 0.125, 0.0625)  # of the caps, tried in this order
BUDGET_MEMORY_FRACTION = 0.85  # of the GPU: ppo.control.controller's default high_mem
BUDGET_ALIGN = 512  # tokens


def fit_memory(cfg: Config, predict: Callable[[Config], dict], *, cuda: bool | None = None,
               device_gb: float | None = None) -> list[str]:
    """Resolve the unset memory keys of `cfg` in place. predict: a config -> its plan's cost-model prediction
    (`compute_plan(c, ...).predicted`; passed in, so planning imports this module and not the reverse).
    device_gb: the GPU's memory where it is known (launch); the calibration's otherwise, and the smaller of the two
    bounds the budgets. -> one line per choice: key=value (auto: why)."""
    from launcher.config.auto import CPU_MICRO_BATCH_TOKENS, on_cuda

    cuda = on_cuda(cfg) if cuda is None else cuda
    used = set(active_roles(cfg))
    for role in TRAINED:  # a role the run does not use: nothing to fit (no line)
        sec = getattr(cfg, role)
        if role not in used and _unset(cfg, role):
            sec.activation_checkpointing = sec.activation_checkpointing or "none"
            sec.offload_optimizer = bool(sec.offload_optimizer)
    budgets = []
    for role in MODEL_ROLES:
        sec = role_section(cfg, role)
        if sec is None or sec.max_tokens_per_micro_batch is not None:
            continue
        if role in used and cuda:
            budgets.append(role)
        else:  # CPU (launcher.config.auto chose already, unless told cuda=False here), or a role the run does not use
            sec.max_tokens_per_micro_batch = (BUDGET_CAPS if cuda else CPU_MICRO_BATCH_TOKENS)[role]
    if cfg.actor.offload_optimizer is None and cfg.actor.offload_optimizer_while_generating:
        cfg.actor.offload_optimizer = False  # the two are exclusive (validation); the one set wins (no line)
    open_roles = [r for r in TRAINED if _unset(cfg, r)]
    native = [r for r in open_roles if getattr(cfg, r).backend == "native"] if cuda else []
    for role in open_roles:  # the defaults first: what stays unset below is searched
        sec = getattr(cfg, role)
        if role not in native:
            sec.activation_checkpointing = sec.activation_checkpointing or "none"
            sec.offload_optimizer = bool(sec.offload_optimizer)
    if not native and not budgets:
        return []
    (ac, offload, sizes), pred, fits = _search(cfg, native, budgets, predict, device_gb=device_gb)
    lines = []
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
    limit = _memory_limit(pred, device_gb)
    for role in budgets:
        role_section(cfg, role).max_tokens_per_micro_batch = sizes[role]
        name = section_name(role)
        cap = BUDGET_CAPS[role]
        why = (f"the largest up to {cap} that fits: predicted training peak {pred['train_peak_gb']:.1f} GB <= "
               f"{BUDGET_MEMORY_FRACTION:.0%} of {limit / BUDGET_MEMORY_FRACTION:.0f} GB" if fits else
               f"none up to {cap} fits {BUDGET_MEMORY_FRACTION:.0%} of {limit / BUDGET_MEMORY_FRACTION:.0f} GB; the "
               f"smallest tried: predicted training peak {pred['train_peak_gb']:.1f} GB (the CUDA-OOM back-off "
               f"halves it if it does not fit)")
        lines.append(f"{name}.max_tokens_per_micro_batch={sizes[role]} (auto: {why})")
    return lines


def micro_batch_ladder(cfg: Config, roles: list[str]) -> list[dict[str, int]]:
    """The budgets tried for `roles`, largest first: each role's cap scaled by BUDGET_SCALES, aligned, at least the
    longest sample; repeats (where every role sits at its floor) dropped."""
    floor = -(-(cfg.data.max_prompt_length + cfg.rollout.max_response_length) // BUDGET_ALIGN) * BUDGET_ALIGN
    ladder: list[dict[str, int]] = []
    for scale in BUDGET_SCALES:
        sizes = {r: max(floor, int(BUDGET_CAPS[r] * scale) // BUDGET_ALIGN * BUDGET_ALIGN) for r in roles}
        if not ladder or sizes != ladder[-1]:
            ladder.append(sizes)
    return ladder


def _memory_limit(pred: dict, device_gb: float | None) -> float:
    hbm = pred.get("hbm_gb", math.inf)
    return BUDGET_MEMORY_FRACTION * min(hbm, device_gb or math.inf)


def _unset(cfg: Config, role: str) -> bool:
    sec = getattr(cfg, role)
    return sec.activation_checkpointing is None or sec.offload_optimizer is None


def _search(cfg: Config, roles: list[str], budgets: list[str], predict: Callable[[Config], dict], *,
            device_gb: float | None):
    """-> ((ac, offload, {role: budget}), the plan's prediction, fits) of the chosen candidate."""
    tried = []
    for ac, offload in CANDIDATES if roles else ((None, None),):
        for sizes in micro_batch_ladder(cfg, budgets) if budgets else [{}]:
            trial = copy.deepcopy(cfg)
            for role in roles:
                sec = getattr(trial, role)
                if sec.activation_checkpointing is None:
                    sec.activation_checkpointing = ac
                if sec.offload_optimizer is None:
                    sec.offload_optimizer = offload
            for role, size in sizes.items():
                role_section(trial, role).max_tokens_per_micro_batch = size
            try:
                pred = predict(trial)
            except UserError:  # a layout the planner refuses whatever the memory: compute_plan will say so
                pred = {"predicted_step_s": math.inf, "peak_gb": math.inf, "train_peak_gb": math.inf,
                        "reject": "refused"}
            fits = pred.get("reject") is None and (
                not budgets or pred["train_peak_gb"] <= _memory_limit(pred, device_gb))
            tried.append(((ac, offload, sizes), pred, fits))
            if fits:  # the largest budgets this candidate fits
                break
    feasible = [t for t in tried if t[2]]
    if feasible:
        return min(feasible, key=lambda t: t[1]["predicted_step_s"])
    return min(tried, key=lambda t: (t[1]["peak_gb"], t[1]["train_peak_gb"]))
