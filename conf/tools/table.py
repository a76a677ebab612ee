"""A table-lookup tool: the tools file of conf/agent_tool_tiny.yaml (agent.tools_file), for data.task lookup:3.

A prompt is a key ("qxz="); its answer is the key's value in a hashed table (ppo/data/tasks.py `table_value`)
that a model cannot compute from the key. The policy calls the tool in the hermes format,
`<tool_call>{"arguments":{"k":"qxz"},"name":"get"}</tool_call>` (the arguments first: the letters to copy stay
close to the prompt's), reads `<tool_response>\n47\n</tool_response>\n` back and answers "47". SFT_TURNS
demonstrates that for the warm-up.
"""

import json
import zlib

from ppo.data.tasks import table_value


def get(k: str) -> str:
    """The value stored under a key.

    Args:
        k: the key, lowercase letters (e.g. "qxz")
    """
    if not k.isalpha() or not k.islower():
        raise ValueError(f"keys are lowercase letters, got {k!r}")
    return table_value(k)


TOOLS = [get]


# The warm-up's teacher looks up one key in TOOL_SHARE (chosen by a hash of the key) and declines the others with
# "?" (reward 0): the student learns the call and the copy of the value, but calls on about 1 prompt in
# TOOL_SHARE; GRPO then finds that calling pays.
TOOL_SHARE = 6


def SFT_TURNS(prompt: str, answer: str) -> list[str]:
    """The warm-up's demonstration of a prompt "qxz=": look the key up and state the value read, or (5 keys in
    6) decline with "?"."""
    key = prompt.strip().rstrip("=")
    if zlib.crc32(key.encode()) % TOOL_SHARE:
        return ["?"]
    call = json.dumps({"arguments": {"k": key}, "name": "get"}, separators=(",", ":"))
    return [f"<tool_call>{call}</tool_call>", answer]
