"""The step's agent loops by name, from the agent settings: `build_registry(...)`.

    registry = build_registry(default="tool", tools_file="tools.py", loop_file=None, max_turns=4,
                              max_tool_response_tokens=256)
    loop = registry.pick(row)   # the row's agent_name column, else the default
"""

from __future__ import annotations

from ppo.agents.loop import AgentRegistry, load_loop_file, single_turn
from ppo.agents.tool_loop import tool_loop
from ppo.agents.tools import ToolsFile, load_tools_file


def build_registry(*, default: str, tools_file: str | None, loop_file: str | None, max_turns: int,
                   max_tool_response_tokens: int) -> AgentRegistry:
    """single_turn always; "tool" with a tools file; a loop file's AGENT_LOOPS (which may replace neither)."""
    loops = {"single_turn": single_turn}
    tools = ToolsFile([])
    if tools_file:
        tools = load_tools_file(tools_file)
        loops["tool"] = tool_loop(tools.specs, max_turns=max_turns, max_tool_response_tokens=max_tool_response_tokens)
    if loop_file:
        from ppo.agents.loop import AgentLoopError

        user = load_loop_file(loop_file)
        taken = sorted(set(user) & set(loops))
        if taken:
            raise AgentLoopError(f"agent.loop_file {loop_file}: AGENT_LOOPS names {taken} are built in; rename them")
        loops.update(user)
    return AgentRegistry(loops, default=default, sft_turns=tools.sft_turns)
