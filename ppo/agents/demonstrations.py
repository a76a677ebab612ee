"""Supervised demonstrations of an agent loop: the warm-up's examples of tool use, produced by the loop itself.

    traj = demonstration(loop, prompt_ids=p, turns=['<tool_call>{...}</tool_call>', "42"], tokenizer=tok,
                         tools=pool, max_response_tokens=128, max_total_tokens=256)
    traj.response_ids, traj.loss_mask   # the calls and the answer (mask 1), the real tool responses (mask 0)

A scripted teacher stands in for the engine: it answers the loop's k-th Generate with turns[k] + EOS. The
loop runs the real tools and renders their responses exactly as in RL, so the warm-up trains on the token
layout the policy will see; the tool responses are observation tokens (mask 0), as in RL.
"""

from __future__ import annotations

from collections.abc import Callable

from ppo.agents.driver import Start, ToolPool, drive
from ppo.agents.loop import AgentRun, AgentTask, Trajectory
from rollout.base import Completion, SamplingParams


class ScriptedTeacher:
    """A stepping engine (rollout/base.py SteppingEngine's calls the driver makes) that answers its k-th
    request with turns[k] + EOS, cut to the request's max_tokens."""

    def __init__(self, turns: list[str], *, tokenizer):
        self.turns, self.tok, self.done, self.asked = turns, tokenizer, [], 0

    def add_request(self, prompt: list[int], params: SamplingParams) -> int:
        text = self.turns[min(self.asked, len(self.turns) - 1)]
        ids = self.tok.encode(text) + [self.tok.eos_token_id]
        cut = ids[: params.max_tokens]
        self.done.append(Completion(self.asked, 0, list(prompt), cut, [0.0] * len(cut),
                                    "stop" if len(cut) == len(ids) else "length"))
        self.asked += 1
        return self.asked - 1

    def has_unfinished(self) -> bool:
        return bool(self.done)

    def step(self) -> list[Completion]:
        out, self.done = self.done, []
        return out


def demonstration(loop: Callable[[AgentTask], AgentRun], *, prompt_ids: list[int], turns: list[str], tokenizer,
                  tools: ToolPool, max_response_tokens: int, max_total_tokens: int) -> Trajectory:
    """The trajectory `loop` makes of `prompt_ids` when the policy says `turns` (assistant texts, in order)."""
    task = AgentTask(list(prompt_ids), {}, tokenizer, max_response_tokens, max_total_tokens)
    (traj,), _ = drive(ScriptedTeacher(turns, tokenizer=tokenizer), [Start(loop, task, 0, key=0)],
                       sampling=SamplingParams(), tools=tools)
    return traj
