"""How a user reward function is called: hybridrl's convention or verl's, chosen by its signature.

    call = plan_reward_call(fn, signature="auto", columns=dataset.columns)   # checks named columns
    score, extras = call_reward(call, fn, response, ground_truth, prompt=p, sample_id=i, extra=row_info)

hybridrl: `fn(response, ground_truth, **extra)` with extra from prompt, sample_id, data_source,
extra_info, response_length. verl: `compute_score(data_source=, solution_str=, ground_truth=,
extra_info=)`, by keyword as verl's reward managers call it (so verl's own
`gsm8k.compute_score(solution_str, ground_truth, ...)` works too). In both, a parameter named after a
data column receives that column. A dict result's "score" is the reward; its other numeric keys
come back as extras (logged as `reward/<key>/mean`).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


class RewardFunctionError(ValueError):
    """A user reward function that cannot be loaded or called as configured; the launcher exits with
    code 2 on it."""


REWARD_SIGNATURES = ("auto", "hybridrl", "verl")
# verl's reward managers call compute_score(data_source=, solution_str=, ground_truth=, extra_info=)
VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
# what every sample offers a hybridrl-convention function beyond (response, ground_truth)
STANDARD_EXTRAS = ("prompt", "sample_id", "data_source", "extra_info", "response_length")
# a score beyond this magnitude is a reward failure: the advantages are fp32 (max 3.4e38), a group's std squares
# the scores (1e20 overflows), and one score of 1e7 beside 0/1 scores leaves the others no signal
MAX_ABS_SCORE = 1e6


@dataclass(frozen=True, slots=True)
class RewardCall:
    """How one reward function is called: its convention, the keywords it takes (None: it takes
    **kwargs) and the data columns it names as parameters (passed from each sample's row)."""

    signature: str  # hybridrl | verl
    accepts: frozenset[str] | None
    columns: tuple[str, ...]


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins have no signature: call them the plain way
        return None


def detect_signature(fn: Callable[..., Any]) -> str:
    """'verl' when fn names verl's `solution_str` or starts with `data_source`, else 'hybridrl'."""
    params = _parameters(fn) or []
    names = [p.name for p in params]
    return "verl" if "solution_str" in names or names[:1] == ["data_source"] else "hybridrl"


def plan_reward_call(fn: Callable[..., Any], *, signature: str = "auto",
                     columns: Iterable[str] | None = None) -> RewardCall:
    """Decide how to call fn. `columns` (the data's column names, when known) turns a required
    parameter that names no column into a RewardFunctionError naming it and the columns."""
    if signature not in REWARD_SIGNATURES:
        raise RewardFunctionError(f"reward.signature={signature!r} is not one of {', '.join(REWARD_SIGNATURES)}")
    name = getattr(fn, "__qualname__", repr(fn))
    params = _parameters(fn)
    if params is None:
        return RewardCall("verl" if signature == "verl" else "hybridrl", None, ())
    sig = detect_signature(fn) if signature == "auto" else signature
    named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    if sig == "verl":
        if "solution_str" not in named and not takes_kwargs:
            raise RewardFunctionError(f"reward.signature=verl but {name}{inspect.signature(fn)} has no "
                                      f"'solution_str' parameter (verl calls compute_score(data_source, "
                                      f"solution_str, ground_truth, extra_info)); use reward.signature=hybridrl "
                                      f"for fn(response, ground_truth, **extra)")
        own = set(VERL_PARAMS)
    else:
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
            raise RewardFunctionError(f"reward function {name}{inspect.signature(fn)} must take (response, "
                                      f"ground_truth, ...) or verl's (data_source, solution_str, ground_truth, "
                                      f"extra_info)")
        own = {p.name for p in positional[:2]} | set(STANDARD_EXTRAS)
    wanted = []
    known = None if columns is None else set(columns)
    for p in named.values():
        if p.name in own:
            continue
        if known is None or p.name in known:
            wanted.append(p.name)
        elif p.default is p.empty:
            raise RewardFunctionError(
                f"reward function {name} asks for {p.name!r}, which names no data column (columns: "
                f"{sorted(known)}); rename the parameter to a column, give it a default, or add the column")
    return RewardCall(sig, None if takes_kwargs else frozenset(named), tuple(wanted))


def _numeric(v: Any) -> float | None:
    if isinstance(v, bool | int | float) or (hasattr(v, "item") and getattr(v, "ndim", 1) == 0):
        x = float(v)
        return x if math.isfinite(x) else None
    return None


def call_reward(call: RewardCall, fn: Callable[..., Any], response: str, ground_truth: Any, *, prompt: str,
                sample_id: Any, extra: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """(score, {extra numeric key: value}) of one sample. Raises on a non-number, NaN or a dict
    without "score" (the caller decides what a failure costs)."""
    columns = {k: extra[k] for k in call.columns if k in extra}
    if call.signature == "verl":
        kw = {"data_source": extra.get("data_source"), "solution_str": response, "ground_truth": ground_truth,
              "extra_info": extra.get("extra_info"), **columns}
    else:
        kw = {"prompt": prompt, "sample_id": sample_id, **{k: extra[k] for k in STANDARD_EXTRAS if k in extra},
              **columns}
    if call.accepts is not None:
        kw = {k: v for k, v in kw.items() if k in call.accepts}
    out = fn(**kw) if call.signature == "verl" else fn(response, ground_truth, **kw)
    extras: dict[str, float] = {}
    if isinstance(out, dict):
        if "score" not in out:
            raise TypeError(f"reward dict has no 'score' key (keys: {sorted(out)})")
        extras = {str(k): x for k, v in out.items() if k != "score" and (x := _numeric(v)) is not None}
        out = out["score"]
    if isinstance(out, str) or not (isinstance(out, numbers.Real) or getattr(out, "ndim", None) == 0):
        raise TypeError(f"reward is a {type(out).__name__} ({str(out)[:50]!r}), not a number")
    value = float(out)  # bools, numpy scalars and 0-d tensors are fine
    if not math.isfinite(value):
        raise ValueError(f"reward is {value}")
    if abs(value) > MAX_ABS_SCORE:
        raise ValueError(f"reward {value:g} is beyond +-{MAX_ABS_SCORE:g}: such a score overflows (or swamps) the "
                         f"fp32 advantages; it is failed, not clamped")
    return value, extras
