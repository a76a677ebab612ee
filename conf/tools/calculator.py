"""A calculator tool for data.task mul:2 (agent.tools_file=conf/tools/calculator.py agent.default=tool).

The policy calls it in the hermes format, `<tool_call>{"arguments":{"x":"12*34"},"name":"calc"}</tool_call>` (the
arguments first: the digits to copy stay close to the prompt's), and reads `<tool_response>\n408\n</tool_response>\n`
back. SFT_TURNS demonstrates that for the warm-up.
"""

import ast
import json
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError("only integers with + - * are allowed")


def calc(x: str) -> str:
    """Evaluate an integer arithmetic expression.

    Args:
        x: the expression, integers with + - * (e.g. "123*456")
    """
    return str(_value(ast.parse(x, mode="eval").body))


TOOLS = [calc]


def SFT_TURNS(prompt: str, answer: str) -> list[str]:
    """The warm-up's demonstration of a prompt "12*34=": call the calculator, then state its result."""
    call = json.dumps({"arguments": {"x": prompt.strip().rstrip("=")}, "name": "calc"}, separators=(",", ":"))
    return [f"<tool_call>{call}</tool_call>", answer]
