"""The built-in tool loop (agent name "tool"): generate, run the hermes tool calls of the turn, append their
responses as observation tokens, repeat until a turn calls no tool or a limit is reached.

    loop = tool_loop(load_tools_file("tools.py"), max_turns=4, max_tool_response_tokens=256)
    registry.loops["tool"] = loop

Observations are rendered with the tokenizer's chat template as tool messages and appended as new tokens:
earlier turns are never re-rendered, so the trainer sees exactly the tokens the engine sampled (a template
that rewrites history, e.g. one dropping earlier <think> blocks, cannot change them). A tokenizer without a
template (builtin:char) gets the hermes text `<tool_response>...</tool_response>` instead.
"""

from __future__ import annotations

from collections.abc import Callable

from ppo.agents.loop import AgentRun, AgentTask, CallTool, Generate, ToolFailure, TrajectoryBuilder
from ppo.agents.tools import ToolBox, ToolSpec, parse_tool_calls

_PROBE = [{"role": "user", "content": "x"}]


def render_tool_responses(tokenizer, results: list[str]) -> str:
    """The text that follows an assistant turn (ended by its stop token) to hand `results` back to the model
    and open the next assistant turn: the chat template's rendering of the tool messages, as a suffix."""
    if getattr(tokenizer, "chat_template", None) is None:
        return "".join(f"<tool_response>\n{r}\n</tool_response>\n" for r in results)
    base = tokenizer.apply_chat_template(_PROBE, add_generation_prompt=False)
    full = tokenizer.apply_chat_template(_PROBE + [{"role": "tool", "content": r} for r in results],
                                         add_generation_prompt=True)
    if not full.startswith(base):
        raise ValueError("the chat template renders a conversation's start differently once tool messages follow; "
                         "tool responses cannot be appended as a suffix with it")
    # what the template writes after an end-of-turn token (Qwen: a newline) is not sampled: add it here
    eos = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else ""
    tail = base[base.rfind(eos) + len(eos):] if eos and eos in base else ""
    return tail + full[len(base):]


def tool_loop(specs: list[ToolSpec], *, max_turns: int, max_tool_response_tokens: int
              ) -> Callable[[AgentTask], AgentRun]:
    """The loop over `specs`. max_turns: assistant turns at most (a turn that still calls a tool on the last
    one ends the trajectory as "length"); max_tool_response_tokens: each response's cap (cut, counted)."""

    def run(task: AgentTask) -> AgentRun:
        tok = task.tokenizer
        traj = TrajectoryBuilder(task.prompt_ids)
        box = ToolBox(specs)
        last: list[int] = []
        try:
            for turn in range(max_turns):
                budget = task.max_new_tokens(traj)
                if budget <= 0:
                    traj.finish_reason = "length"
                    break
                out = yield Generate(traj.token_ids, budget)
                traj.add_sampled(out)
                last = out.token_ids
                if out.finish_reason != "stop":
                    break
                calls = parse_tool_calls(tok.decode(out.token_ids))
                if not calls:
                    break  # an answer: the trajectory is done
                if turn == max_turns - 1:
                    traj.finish_reason = "length"  # still calling tools at the turn limit
                    break
                results = []
                for call in calls:
                    traj.counts["tool_calls"] += 1
                    error, result = (call, None) if isinstance(call, str) else (None, None)
                    if error is None:
                        try:
                            fn = box.bind(*call)
                        except ValueError as e:  # an unknown tool, arguments that do not bind
                            error = str(e)
                        else:
                            result = yield CallTool(fn)
                            error = result.error if isinstance(result, ToolFailure) else None
                    if error is not None:  # the model reads what went wrong, the metrics count it
                        traj.counts["tool_errors"] += 1
                        result = f"error: {error}"
                    results.append(_capped(tok, str(result), max_tool_response_tokens, traj))
                obs = tok.encode(render_tool_responses(tok, results))
                room = task.max_new_tokens(traj)
                if len(obs) >= room:  # no room left to answer after this observation
                    traj.add_observation(obs[:max(room, 0)])
                    traj.finish_reason = "length"
                    break
                traj.add_observation(obs)
        finally:
            box.close()
        text = tok.decode(_without_eos(last, tok.eos_token_id))
        return traj.finish(text=text)

    return run


def _without_eos(ids: list[int], eos: int | None) -> list[int]:
    return ids[:-1] if ids and eos is not None and ids[-1] == eos else ids


def _capped(tok, text: str, cap: int, traj: TrajectoryBuilder) -> str:
    ids = tok.encode(text)
    if len(ids) <= cap:
        return text
    traj.counts["truncated_observations"] += 1
    return tok.decode(ids[:cap])
