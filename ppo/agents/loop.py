"""The agent-loop interface: a trajectory is token ids in, token ids and behaviour log-probs out.

An agent loop is a generator function `run(task: AgentTask)` that yields actions and returns a `Trajectory`:

    def run(task):
        traj = TrajectoryBuilder(task.prompt_ids)
        out = yield Generate(traj.token_ids, max_tokens=task.max_new_tokens(traj))   # -> Generated
        traj.add_sampled(out)
        result = yield CallTool(lambda: "42")          # -> the callable's return value (or ToolFailure)
        traj.add_observation(task.tokenizer.encode(result))
        ...
        return traj.finish(text=task.tokenizer.decode(out.token_ids))

The driver (ppo/agents/driver.py) runs every trajectory of a step over one engine: while one waits for a tool
(run in a thread pool with a timeout), the others decode. Sampled tokens get loss mask 1 and the engine's
log-probs; prompt and observation tokens mask 0: the trainer trains on exactly the tokens the engine sampled,
never on re-tokenized text.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class Generate:
    """Ask the engine to continue `token_ids` (the prompt and everything so far) by at most `max_tokens`."""

    token_ids: list[int]
    max_tokens: int


@dataclass(slots=True)
class Generated:
    """The engine's answer to a Generate: the sampled tokens (a stop token included) and their log-probs."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None  # why the engine refused the request ("error")
    routed_experts: object | None = None  # a mixture of experts: rollout.base.Completion.routed_experts


@dataclass(slots=True)
class CallTool:
    """Run `call()` off the engine's loop (a thread of the driver's pool) with the driver's timeout."""

    call: Callable[[], Any]


@dataclass(slots=True)
class ToolFailure:
    """What a CallTool sends back when the call raised or ran past its timeout."""

    error: str


@dataclass(slots=True)
class Trajectory:
    """One rollout. response_ids: every token after the prompt, sampled or observed, in order; loss_mask and
    logprobs align with it (1 and the behaviour log-prob on sampled tokens, 0 and 0.0 elsewhere; loss_mask None:
    every response token was sampled); turns: the
    [start, end) spans of response_ids each Generate produced; text: what the reward reads (None: the response
decoded, as for plain generation)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int] | None
    logprobs: list[float]
    turns: list[tuple[int, int]]
    finish_reason: str  # the last generation's ("stop" | "length" | "error"), or "length" when a limit cut it
    text: str | None
    tool_calls: int = 0
    tool_errors: int = 0
    truncated_observations: int = 0  # tool responses cut to the token cap
    error: str | None = None
    # a mixture of experts: the experts the engine ran at every position [P + R - 1, L_moe, k] (the last
    # generation's record, which re-prefilled the whole trajectory); None when an observation came after it
    routed_experts: object | None = None


class TrajectoryBuilder:
    """Accumulates a trajectory's tokens, mask and log-probs, turn by turn (loops append, never re-tokenize).
    The first turn's lists are taken over, not copied, and the mask exists only once an observation does:
    a single turn costs no per-token work here."""

    def __init__(self, prompt_ids: list[int]):
        self.prompt_ids = prompt_ids
        self.response_ids: list[int] = []
        self.loss_mask: list[int] | None = None  # None while every response token was sampled
        self.logprobs: list[float] = []
        self.turns: list[tuple[int, int]] = []
        self.finish_reason = "stop"
        self.counts = {"tool_calls": 0, "tool_errors": 0, "truncated_observations": 0}
        self.error: str | None = None
        self.routed_experts = None

    @property
    def token_ids(self) -> list[int]:
        """The prompt and the response so far (read-only: the prompt itself while the response is empty)."""
        return self.prompt_ids + self.response_ids if self.response_ids else self.prompt_ids

    def add_sampled(self, out: Generated) -> None:
        start = len(self.response_ids)
        if start == 0:  # the engine's lists are the driver's to give: take them over
            self.response_ids, self.logprobs = out.token_ids, out.logprobs
        else:
            self.response_ids += out.token_ids
            self.logprobs += out.logprobs
        if self.loss_mask is not None:
            self.loss_mask += [1] * len(out.token_ids)
        self.turns.append((start, len(self.response_ids)))
        self.finish_reason = out.finish_reason
        self.routed_experts = out.routed_experts
        if out.error is not None:
            self.error = out.error

    def add_observation(self, token_ids: list[int]) -> None:
        if self.loss_mask is None:
            self.loss_mask = [1] * len(self.response_ids)
        self.response_ids += token_ids
        self.routed_experts = None  # recorded up to the last generation only
        self.loss_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)

    def finish(self, *, text: str | None, finish_reason: str | None = None) -> Trajectory:
        return Trajectory(self.prompt_ids, self.response_ids, self.loss_mask, self.logprobs, self.turns,
                          finish_reason or self.finish_reason, text, error=self.error,
                          routed_experts=self.routed_experts, **self.counts)


@dataclass(slots=True)
class AgentTask:
    """What a loop gets for one trajectory: its prompt, its data row's columns, the tokenizer, and the
    rollout's limits (max_total_tokens: prompt and response together; max_response_tokens: the response)."""

    prompt_ids: list[int]
    row: dict
    tokenizer: Any
    max_response_tokens: int
    max_total_tokens: int

    def max_new_tokens(self, traj: TrajectoryBuilder) -> int:
        """What the next Generate may ask for: what is left of the response and total budgets (<= 0: none)."""
        return min(self.max_response_tokens - len(traj.response_ids),
                   self.max_total_tokens - len(traj.prompt_ids) - len(traj.response_ids))


AgentRun = Generator[Generate | CallTool, Any, Trajectory]


def single_turn(task: AgentTask) -> AgentRun:
    """Plain generation: one Generate from the prompt; the reward reads the response (text=None)."""
    traj = TrajectoryBuilder(task.prompt_ids)
    traj.add_sampled((yield Generate(traj.token_ids, task.max_new_tokens(traj))))
    return traj.finish(text=None)


class AgentLoopError(ValueError):
    """An agent-loop file that cannot be used (the launcher refuses it before launch, exit code 2)."""


def load_loop_file(path: str) -> dict[str, Callable[[AgentTask], AgentRun]]:
    """The loops a user's Python file defines: its `AGENT_LOOPS = {name: generator function}`."""
    module = import_file(path, "hybridrl_user_agent_loops", what="agent.loop_file")
    loops = getattr(module, "AGENT_LOOPS", None)
    if not isinstance(loops, dict) or not loops:
        raise AgentLoopError(f"agent.loop_file {path}: define AGENT_LOOPS = {{'name': run}} where run(task) is a "
                             "generator function yielding Generate / CallTool and returning a Trajectory")
    for name, fn in loops.items():
        if not inspect.isgeneratorfunction(fn):
            raise AgentLoopError(f"agent.loop_file {path}: AGENT_LOOPS[{name!r}] is not a generator function "
                                 "(def run(task): ... yield Generate(...) ... return traj.finish(...))")
    return loops


def import_file(path: str, name: str, *, what: str):
    """Import a user's Python file as module `name`; any failure is an AgentLoopError naming the file."""
    p = Path(path)
    if not p.is_file():
        raise AgentLoopError(f"{what}: no file {path}")
    try:
        spec = importlib.util.spec_from_file_location(name, p)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except Exception as e:  # the user's code: any exception means the file cannot be used
        sys.modules.pop(name, None)
        raise AgentLoopError(f"{what} {path} failed to import: {type(e).__name__}: {e}") from e
    return module


@dataclass(slots=True)
class AgentRegistry:
    """Loops by name; a data row's `agent_name` column picks one, `default` serves the rest."""

    loops: dict[str, Callable[[AgentTask], AgentRun]] = field(default_factory=dict)
    default: str = "single_turn"
    # the tools file's SFT_TURNS(prompt, answer) -> assistant turns: the warm-up's demonstrations of the default
    # loop (ppo/agents/demonstrations.py); None: the warm-up trains on plain answers
    sft_turns: Callable[[str, str], list[str]] | None = None

    def pick(self, row: dict) -> Callable[[AgentTask], AgentRun]:
        name = (row.get("columns") or {}).get("agent_name") or row.get("agent_name") or self.default
        if name not in self.loops:
            raise AgentLoopError(f"data row {row.get('index')} asks for agent_name {name!r}; the loops are "
                                 f"{sorted(self.loops)} (agent.loop_file adds yours, agent.tools_file 'tool')")
        return self.loops[name]
