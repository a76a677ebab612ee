"""Rule-based rewards, user reward functions, and the batch scorer that never stops a run.

    fn = load_reward_function("my_rewards.py:score")      # fn(response, ground_truth, **extra) -> float
    manager = RewardManager(fn, default_score=0.0, logger=log)
    result = manager.score([RewardSample("s0", prompt, response, "42")])
    result.scores, result.num_failed, result.extras          # extras: a dict result's other numeric keys

Two calling conventions, told apart by the function's parameter names (or `reward.signature`):
hybridrl's `fn(response, ground_truth, **extra)` and verl's
`compute_score(data_source, solution_str, ground_truth, extra_info)`, called by keyword as verl
calls it. Either may also name data columns as parameters (`difficulty=None`): they are passed
from the sample's data row (`plan_reward_call` checks them against the data's columns).

Built-ins: `math_answer_reward` (GSM8K `#### 42` / `\\boxed{42}` answers), `format_reward`
(regex), `length_penalty` (DAPO's soft over-long punishment).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import re
import signal
import threading
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from ppo.data.reward_calls import RewardFunctionError, call_reward, plan_reward_call

_log = logging.getLogger(__name__)


# ---------------------------------------------------------------- answer extraction

_GSM8K = re.compile(r"####\s*(-?[$0-9.,]+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) with nested braces balanced; None if absent
    or unclosed."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str, *, method: str = "strict") -> str | None:
    """Final answer of a solution text, or None.

    strict: the last `#### <number>` (GSM8K) or the last `\\boxed{...}`, whichever comes later.
    flexible: as strict, else the last number anywhere in the text.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"extract_answer method must be 'strict' or 'flexible' (got {method!r})")
    gsm = list(_GSM8K.finditer(text))
    boxed_at = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    boxed = last_boxed(text)
    if gsm and (boxed is None or gsm[-1].start() > boxed_at):
        return gsm[-1].group(1).rstrip(".,")
    if boxed is not None:
        return boxed.strip()
    if method == "flexible":
        nums = _NUMBER.findall(text)
        return nums[-1] if nums else None
    return None


def normalize_answer(ans: str) -> str:
    """Canonical text of an answer: no whitespace, '$', '%', thousands commas, '\\text{}' or trailing
    '.', and numbers as exact fractions in lowest terms ('3.0' -> '3', '0.5' and '\\frac{1}{2}' ->
    '1/2', '1,000.50' -> '2001/2'); anything else is compared as the cleaned text."""
    s = ans.strip()
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = s.replace("$", "").replace("\\!", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    # only thousands separators: "1,000" -> "1000", but a list "1,2" stays (it is not a number)
    s = re.sub(r"(?<=\d),(?=\d{3}(\D|$))", "", s)
    value = _as_number(s)
    if value is None:
        return s
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _as_number(s: str) -> Fraction | None:
    m = re.fullmatch(r"\(?(\+?-?[\d.]+)\)?(?:/\(?(\+?-?[\d.]+)\)?)?", s)
    if not m:
        return None
    try:
        num = Fraction(m.group(1).lstrip("+"))
        return num / Fraction(m.group(2).lstrip("+")) if m.group(2) else num
    except (ValueError, ZeroDivisionError):
        return None


def math_answer_reward(response: str, ground_truth: Any, *, method: str = "strict", correct: float = 1.0,
                       incorrect: float = 0.0, **extra: Any) -> float:
    """`correct` if the response's extracted final answer equals the ground truth after
    normalisation (numbers compared exactly as fractions), else `incorrect`. The ground truth may
    itself be a full GSM8K solution ending in '#### 42'."""
    got = extract_answer(response, method=method)
    if got is None:
        return incorrect
    gt = str(ground_truth)
    gt = extract_answer(gt, method="strict") or gt
    return correct if normalize_answer(got) == normalize_answer(gt) else incorrect


def format_reward(response: str, *, pattern: str, score: float = 1.0, match: str = "fullmatch") -> float:
    """`score` when the response matches the regex `pattern` (DOTALL; match='fullmatch' or
    'search'), else 0. e.g. pattern=r"<think>.*</think>\\s*<answer>.*</answer>"."""
    if match not in ("fullmatch", "search"):
        raise ValueError(f"format_reward match must be 'fullmatch' or 'search' (got {match!r})")
    f = re.fullmatch if match == "fullmatch" else re.search
    return score if f(pattern, response.strip(), flags=re.DOTALL) else 0.0


def length_penalty(response_length: int, *, max_length: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft over-long punishment (<= 0): 0 up to max_length - buffer, then linear down to
    -penalty at max_length, -penalty beyond."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"length_penalty needs 0 < buffer({buffer}) <= max_length({max_length})")
    free = max_length - buffer
    if response_length <= free:
        return 0.0
    if response_length <= max_length:
        return (free - response_length) / buffer * penalty
    return -penalty


# ---------------------------------------------------------------- user functions


BUILTIN_REWARDS = ("builtin:math", "builtin:math_flexible", "builtin:task:<task>")


def load_reward_function(spec: str) -> Callable[..., Any]:
    """"path/to/file.py:fn" (or "package.module:fn") -> the callable fn(response, ground_truth, **extra).

    Built-ins: "builtin:math" (math_answer_reward, strict extraction), "builtin:math_flexible",
    "builtin:task:<task>" (exact match for a ppo/data/tasks.py task, e.g. builtin:task:reverse:3).
    Raises RewardFunctionError naming the file and function on any problem (no colon, missing
    file, the file failing to import, no such function, not callable).
    """
    if spec.startswith("builtin:"):
        return _builtin_reward(spec)
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise RewardFunctionError(f"reward function {spec!r} must look like 'path/to/file.py:function_name'")
    if path.endswith(".py") or os.sep in path:
        if not os.path.isfile(path):
            raise RewardFunctionError(f"reward function file {path!r} does not exist (from {spec!r}; "
                                      f"relative paths are from {os.getcwd()})")
        # a unique module name per file: two reward files both called rewards.py must not collide
        mod_name = "hybridrl_reward_" + re.sub(r"\W", "_", os.path.abspath(path))
        try:
            mod_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        except Exception as e:
            raise RewardFunctionError(f"importing reward file {path!r} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(path)
        except Exception as e:
            raise RewardFunctionError(f"importing reward module {path!r} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardFunctionError(f"{path!r} has no function {name!r}; callables defined there: {public}")
    if not callable(fn):
        raise RewardFunctionError(f"{path}:{name} is a {type(fn).__name__}, not a function")
    return fn


def _builtin_reward(spec: str) -> Callable[..., Any]:
    if spec == "builtin:math":
        return math_answer_reward
    if spec == "builtin:math_flexible":
        return lambda response, ground_truth, **extra: math_answer_reward(response, ground_truth, method="flexible")
    if spec.startswith("builtin:task:"):
        from ppo.data.tasks import task_reward_fn

        try:
            return task_reward_fn(spec[len("builtin:task:"):])
        except ValueError as e:
            raise RewardFunctionError(f"reward function {spec!r}: {e}") from None
    raise RewardFunctionError(f"unknown built-in reward {spec!r}; built-ins: {', '.join(BUILTIN_REWARDS)}")


# ---------------------------------------------------------------- batch scoring


@dataclass(slots=True)
class RewardSample:
    sample_id: Any
    prompt: str
    response: str
    ground_truth: Any
    extra: dict[str, Any] = field(default_factory=dict)  # data_source, extra_info, the row's columns, ...


@dataclass(slots=True)
class RewardResult:
    scores: list[float]
    num_failed: int
    failures: dict[Any, str]  # sample_id -> "ExcType: message" for this batch
    extras: list[dict[str, float]] = field(default_factory=list)  # per sample: a dict result's numeric keys


class RewardTimeout(TimeoutError):
    """A reward call ran past reward.timeout_s (raised from SIGALRM inside the call)."""


class RewardNotCalled(Exception):
    """A sample failed without a call: the function timed out on MAX_TIMEOUTS_IN_A_ROW samples before it."""


# after this many timeouts in a row the rest of the batch is failed without calling: a function that
# hangs on every sample costs 3 timeouts per step, not batch x timeout_s
MAX_TIMEOUTS_IN_A_ROW = 3


class RewardFailureError(RuntimeError):
    """A step's reward failures reached reward.stop_failed_fraction; the launcher exits with 2."""


def should_stop(failed_frac: float, limit: float) -> bool:
    """reward.stop_failed_fraction: stop once this fraction of a step's samples failed (a step without failures
    never stops, even at limit 0)."""
    return failed_frac > 0.0 and failed_frac >= limit


def failure_error(*, step: int, failed: int, num_samples: int, limit: float, function: str,
                  errors: list[str]) -> RewardFailureError:
    """The stop's message: the function, the count, the setting and the distinct errors (every rank's)."""
    frac = failed / max(num_samples, 1)
    return RewardFailureError(
        f"step {step + 1}: the reward function ({function}) failed on {failed} of {num_samples} samples "
        f"({frac:.0%}, reward.stop_failed_fraction={limit:g}); the run stops instead of training on "
        f"reward.default_score. Distinct errors so far: " + " | ".join(errors[:5])
        + (f" (+{len(errors) - 5} more in logs/rank_*.log)" if len(errors) > 5 else ""))


class RewardManager:
    """Scores batches with a user function; a sample whose call raises (or returns a non-number /
    NaN, or runs past timeout_s) gets `default_score` and is counted as failed (the trainer reports
    `reward/failed` and stops past reward.stop_failed_fraction). Every distinct error (exception
    type and the line that raised it) is logged once, with the sample that hit it first; `errors`
    keeps {error: example} for the stop message.

    fn follows hybridrl's `fn(response, ground_truth, **extra)` or verl's `compute_score(data_source,
    solution_str, ground_truth, extra_info)` (`signature`: auto | hybridrl | verl). It may return a
    float or a dict with a "score" key (verl style); the dict's other numeric keys come back in
    `RewardResult.extras`. Only the keywords fn accepts are passed, so plain fn(response, gt)
    works. timeout_s bounds each call (SIGALRM; main thread on Unix only) so a hanging rule costs
    one sample, not the run.
    """

    def __init__(self, fn: Callable[..., Any], *, default_score: float = 0.0,
                 logger: logging.Logger | None = None, timeout_s: float | None = None, signature: str = "auto",
                 worker=None):
        """worker: a ppo.data.reward_worker.RewardWorker serving the same function in a child process (user
        functions: ppo.data.reward_worker.build_reward_manager); None calls fn in this process (built-in rules)."""
        self.fn, self.worker = fn, worker
        self.timeout_s = timeout_s
        self.default_score = float(default_score)
        self.logger = logger or _log
        self.total_failed = 0
        self.total_scored = 0
        self.errors: dict[tuple[str, str], str] = {}  # (type, raising line) -> first message with its sample
        self.call = plan_reward_call(fn, signature=signature)

    def _call_bounded(self, s: RewardSample) -> tuple[float, dict[str, float]]:
        if not self.timeout_s or threading.current_thread() is not threading.main_thread() \
                or not hasattr(signal, "setitimer"):
            return self._call(s)

        def expire(signum, frame):
            raise RewardTimeout(f"reward function ran longer than reward.timeout_s={self.timeout_s:g} s")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
        try:
            return self._call(s)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def _call(self, s: RewardSample) -> tuple[float, dict[str, float]]:
        return call_reward(self.call, self.fn, s.response, s.ground_truth, prompt=s.prompt,
                           sample_id=s.sample_id, extra=s.extra)

    def _outcomes(self, samples: list[RewardSample]) -> Iterable[tuple[float, dict[str, float]] | Exception]:
        """One outcome per sample, in order: (score, extras) or the exception of its failed call."""
        if self.worker is not None:
            yield from self.worker.score([(s.response, s.ground_truth, s.prompt, s.sample_id, s.extra)
                                          for s in samples], timeout_s=self.timeout_s,
                                         max_timeouts_in_a_row=MAX_TIMEOUTS_IN_A_ROW)
            return
        timeouts_in_a_row = 0
        for s in samples:
            if timeouts_in_a_row >= MAX_TIMEOUTS_IN_A_ROW:
                yield RewardNotCalled(f"not called: the reward function timed out on {timeouts_in_a_row} samples "
                                      f"in a row in this batch")
                continue
            try:
                yield self._call_bounded(s)
                timeouts_in_a_row = 0
            except Exception as e:  # a user function must not be able to kill the run
                timeouts_in_a_row = timeouts_in_a_row + 1 if isinstance(e, RewardTimeout) else 0
                yield e

    def score(self, samples: Iterable[RewardSample | tuple]) -> RewardResult:
        samples = [s if isinstance(s, RewardSample) else RewardSample(*s) for s in samples]
        scores: list[float] = []
        extras: list[dict[str, float]] = []
        failures: dict[Any, str] = {}
        for s, out in zip(samples, self._outcomes(samples)):
            if isinstance(out, Exception):
                scores.append(self.default_score)
                extras.append({})
                kind = getattr(out, "kind", type(out).__name__)
                if isinstance(out, RewardNotCalled) or kind == "NotCalled":
                    failures[s.sample_id] = str(out)  # counted; the timeouts before it were logged
                    continue
                failures[s.sample_id] = f"{kind}: {out}"
                self._log_if_new(out, s)
            else:
                scores.append(out[0])
                extras.append(out[1])
        self.total_failed += len(failures)
        self.total_scored += len(scores)
        return RewardResult(scores=scores, num_failed=len(failures), failures=failures, extras=extras)

    def close(self) -> None:
        """Stop the worker process (and whatever the function forked), if any."""
        if self.worker is not None:
            self.worker.close()

    def _log_if_new(self, e: Exception, s: RewardSample) -> None:
        tb = traceback.extract_tb(e.__traceback__)
        where = getattr(e, "where", None) or (f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else "?")
        kind = getattr(e, "kind", type(e).__name__)
        key = (kind, where)
        if key in self.errors:
            return
        self.errors[key] = (f"{kind}: {e} (at {where}; first on sample {s.sample_id}, response "
                            f"{s.response[:200]!r}, ground truth {str(s.ground_truth)[:100]!r})")
        self.logger.warning("reward function %s failed: %s; the sample scores reward.default_score=%s (further "
                            "failures with this error are counted in reward/failed, not logged)",
                            getattr(self.fn, "__qualname__", self.fn), self.errors[key], self.default_score)

    def score_batch(self, samples: Iterable[RewardSample | tuple]) -> list[float]:
        """Just the scores of `score()` (failures logged and counted in total_failed all the same)."""
        return self.score(samples).scores
