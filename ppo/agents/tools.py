"""Tools for agent loops: plain Python functions or classes, their JSON schemas, the hermes call format.

A tools file (agent.tools_file) defines `TOOLS = [...]`:

    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: the first addend
            b: the second addend
        \"\"\"
        return a + b

    class Notebook:                      # per-trajectory state: one instance per trajectory
        \"\"\"Remember a note for later turns.\"\"\"
        name = "note"
        def reset(self): self.notes = []          # optional: before the trajectory's first call
        def call(self, text: str) -> str: ...     # the tool itself (its schema: this signature)
        def close(self): ...                      # optional: after the trajectory ends

    TOOLS = [add, Notebook]

    def SFT_TURNS(prompt: str, answer: str) -> list[str]:   # optional: the SFT warm-up's demonstrations
        return [f'<tool_call>{{"name": "add", "arguments": ...}}</tool_call>', answer]

The model calls a tool as Qwen3's chat template asks (hermes format):
`<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>`.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ppo.agents.loop import AgentLoopError, import_file

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _json_type(annotation: Any) -> str:
    origin = typing.get_origin(annotation) or annotation
    return _JSON_TYPES.get(origin, "string")


def _arg_docs(doc: str) -> dict[str, str]:
    """'name: text' or 'name (type): text' lines of a Google-style Args: section."""
    out, in_args = {}, False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
            continue
        if in_args:
            m = re.match(r"(\w+)\s*(\([^)]*\))?\s*:\s*(.*)", stripped)
            if m:
                out[m.group(1)] = m.group(3)
            elif stripped and not line.startswith((" ", "\t")):
                in_args = False
    return out


def function_schema(fn: Callable, *, name: str, doc: str | None) -> dict:
    """The OpenAI/hermes function schema of `fn` from its signature and docstring."""
    doc = inspect.cleandoc(doc or "")
    hints = typing.get_type_hints(fn) if not inspect.isclass(fn) else {}
    args = _arg_docs(doc)
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        props[p.name] = {"type": _json_type(hints.get(p.name, str))}
        if p.name in args:
            props[p.name]["description"] = args[p.name]
        if p.default is p.empty:
            required.append(p.name)
    description = doc.split("\n\n")[0].strip() if doc else name
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": required}}}


@dataclass(slots=True)
class ToolSpec:
    name: str
    schema: dict
    fn: Callable | None = None  # a function tool
    cls: type | None = None  # a class tool: one instance per trajectory


def tool_spec(tool: Any) -> ToolSpec:
    if inspect.isclass(tool):
        if not callable(getattr(tool, "call", None)):
            raise AgentLoopError(f"tool class {tool.__name__} has no call(self, ...) method")
        name = getattr(tool, "name", tool.__name__)
        return ToolSpec(name, function_schema(tool.call, name=name, doc=tool.__doc__ or tool.call.__doc__), cls=tool)
    if callable(tool):
        return ToolSpec(tool.__name__, function_schema(tool, name=tool.__name__, doc=tool.__doc__), fn=tool)
    raise AgentLoopError(f"TOOLS holds {tool!r}: give functions or classes with a call method")


@dataclass(slots=True)
class ToolsFile:
    """A tools file: its tools, and its SFT_TURNS(prompt, answer) -> assistant turns (None: not defined), the
    demonstrations the supervised warm-up trains the tool loop on (ppo/agents/demonstrations.py)."""

    specs: list[ToolSpec]
    sft_turns: Callable[[str, str], list[str]] | None = None


def load_tools_file(path: str) -> ToolsFile:
    """The tools of a tools file's `TOOLS` list (AgentLoopError: the launcher exits 2 before launch)."""
    module = import_file(path, "hybridrl_user_tools", what="agent.tools_file")
    tools = getattr(module, "TOOLS", None)
    if not isinstance(tools, list | tuple) or not tools:
        raise AgentLoopError(f"agent.tools_file {path}: define TOOLS = [function_or_class, ...]")
    specs = [tool_spec(t) for t in tools]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise AgentLoopError(f"agent.tools_file {path}: tool names repeat: {names}")
    sft_turns = getattr(module, "SFT_TURNS", None)
    if sft_turns is not None and not callable(sft_turns):
        raise AgentLoopError(f"agent.tools_file {path}: SFT_TURNS must be a function (prompt, answer) -> [turn texts]")
    return ToolsFile(specs, sft_turns)


class ToolBox:
    """One trajectory's tools: class tools instantiated and reset, closed at the end."""

    def __init__(self, specs: list[ToolSpec]):
        self.specs = {s.name: s for s in specs}
        self._instances: dict[str, Any] = {}

    def _callable(self, name: str) -> Callable:
        spec = self.specs[name]
        if spec.fn is not None:
            return spec.fn
        if name not in self._instances:
            inst = spec.cls()
            if hasattr(inst, "reset"):
                inst.reset()
            self._instances[name] = inst
        return self._instances[name].call

    def bind(self, name: str, arguments: dict) -> Callable[[], Any]:
        """A no-argument call of tool `name`; ValueError when the name or the arguments do not fit."""
        if name not in self.specs:
            raise ValueError(f"unknown tool {name!r}; the tools are {sorted(self.specs)}")
        fn = self._callable(name)
        try:
            bound = inspect.signature(fn).bind(**arguments)
        except TypeError as e:
            raise ValueError(f"bad arguments for {name}: {e}") from None
        return lambda: fn(*bound.args, **bound.kwargs)

    def close(self) -> None:
        for inst in self._instances.values():
            if hasattr(inst, "close"):
                inst.close()
        self._instances.clear()


def parse_tool_calls(text: str) -> list[tuple[str, dict] | str]:
    """The hermes tool calls in `text`, in order: (name, arguments) or, for a call that cannot be read, the
    reason (an error observation for the model)."""
    out: list[tuple[str, dict] | str] = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            out.append(f"malformed tool call JSON: {e.msg} at {e.pos}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            out.append('a tool call needs {"name": ..., "arguments": {...}}')
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):  # some templates emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            out.append(f"arguments of {call['name']} must be a JSON object")
            continue
        out.append((call["name"], args))
    return out
