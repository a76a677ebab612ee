"""The built-in tool loop (ppo/agents/tool_loop.py) over a scripted engine: hermes calls parsed, results
appended as observation tokens, every failure an error observation that is counted, the limits."""

import json
import textwrap
import time

import pytest

from ppo.agents.driver import Start, ToolPool, drive
from ppo.agents.loop import AgentLoopError, AgentTask
from ppo.agents.tool_loop import render_tool_responses, tool_loop
from ppo.agents.tools import function_schema, load_tools_file, parse_tool_calls, tool_spec
from ppo.data.tokenizer import CharTokenizer
from rollout.base import Completion, SamplingParams

TOK = CharTokenizer()
EOS = TOK.eos_token_id


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b (int): the second addend
    """
    return a + b


def boom(x: str) -> str:
    """Always raises."""
    raise RuntimeError("kaput")


def nap(s: float) -> str:
    """Sleep s seconds."""
    time.sleep(s)
    return "awake"


class Counter:
    """Count calls within one trajectory."""

    name = "count"
    instances = []

    def reset(self):
        self.n, self.closed = 0, False
        Counter.instances.append(self)

    def call(self) -> int:
        self.n += 1
        return self.n

    def close(self):
        self.closed = True


class ScriptedEngine:
    """A stepping engine that answers the k-th request of a trajectory with the k-th scripted text (+ EOS)."""

    def __init__(self, script: list[str]):
        self.script, self.turn, self.queue, self.next = script, 0, [], 0
        self.prompts = []

    def add_request(self, prompt, params):
        rid, self.next = self.next, self.next + 1
        text = self.script[min(self.turn, len(self.script) - 1)]
        self.turn += 1
        ids = (TOK.encode(text) + [EOS])[: params.max_tokens]
        reason = "stop" if ids[-1] == EOS else "length"
        self.prompts.append(list(prompt))
        self.queue.append(Completion(rid, 0, list(prompt), ids, [-0.5] * len(ids), reason))
        return rid

    def has_unfinished(self):
        return bool(self.queue)

    def step(self):
        out, self.queue = self.queue[:1], self.queue[1:]
        return out


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def run(script, *, max_turns=4, cap=64, max_response=400, timeout=2.0, tools=(add, boom, nap, Counter)):
    engine = ScriptedEngine(script)
    loop = tool_loop([tool_spec(t) for t in tools], max_turns=max_turns, max_tool_response_tokens=cap)
    task = AgentTask(TOK.encode("12+30="), {}, TOK, max_response_tokens=max_response, max_total_tokens=1000)
    pool = ToolPool(workers=2, timeout_s=timeout)
    (traj,), _ = drive(engine, [Start(loop, task, 0, key=0)], sampling=SamplingParams(), tools=pool)
    pool.close()
    return traj, engine


def test_a_call_its_result_as_observation_tokens_and_the_answer():
    traj, engine = run([call("add", a=12, b=30), "42"])
    first = TOK.encode(call("add", a=12, b=30)) + [EOS]
    obs = TOK.encode("<tool_response>\n42\n</tool_response>\n")
    assert traj.response_ids == first + obs + TOK.encode("42") + [EOS]
    assert traj.loss_mask == [1] * len(first) + [0] * len(obs) + [1] * 3
    assert traj.logprobs[len(first):len(first) + len(obs)] == [0.0] * len(obs)
    assert traj.turns == [(0, len(first)), (len(first) + len(obs), len(traj.response_ids))]
    # the second request extends the first's tokens: nothing re-tokenized
    assert engine.prompts[1] == TOK.encode("12+30=") + first + obs
    assert traj.text == "42" and traj.tool_calls == 1 and traj.tool_errors == 0 and traj.finish_reason == "stop"


@pytest.mark.parametrize("bad, needle", [
    ("<tool_call>{'name': 'add'}</tool_call>", "malformed tool call JSON"),
    (call("sub", a=1, b=2), "unknown tool 'sub'"),
    (call("add", a=1), "bad arguments for add"),
    (call("boom", x="y"), "RuntimeError: kaput"),
    (call("nap", s=1.0), "timed out after 0.2 s"),
])
def test_every_failure_is_an_error_observation_and_counted(bad, needle):
    traj, _ = run([bad, "done"], timeout=0.2)
    observed = TOK.decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if m == 0])
    assert "error: " in observed and needle in observed, observed
    assert traj.tool_calls == 1 and traj.tool_errors == 1 and traj.text == "done"


def test_limits_turns_response_cap_and_budget():
    traj, _ = run([call("add", a=1, b=2)] * 5, max_turns=3)
    assert len(traj.turns) == 3 and traj.tool_calls == 2 and traj.finish_reason == "length"
    traj, _ = run([call("add", a=10**40, b=0), "x"], cap=8)
    assert traj.truncated_observations == 1 and f"\n{str(10**40)[:8]}\n" in TOK.decode(traj.response_ids)
    traj, _ = run([call("add", a=1, b=2)] * 5, max_response=80)
    assert len(traj.response_ids) <= 80 and traj.finish_reason == "length"


def test_class_tools_keep_state_per_trajectory_and_are_closed():
    Counter.instances.clear()
    traj, _ = run([call("count") + call("count"), "2"])
    assert traj.tool_calls == 2 and "\n2\n" in TOK.decode(traj.response_ids)
    (inst,) = Counter.instances
    assert inst.n == 2 and inst.closed


def test_schemas_from_signatures_and_docstrings():
    s = function_schema(add, name="add", doc=add.__doc__)["function"]
    assert s["description"] == "Add two integers."
    assert s["parameters"]["properties"] == {"a": {"type": "integer", "description": "the first addend"},
                                             "b": {"type": "integer", "description": "the second addend"}}
    assert s["parameters"]["required"] == ["a", "b"]
    assert tool_spec(Counter).schema["function"]["name"] == "count"


def test_parse_tool_calls():
    text = 'x' + call("add", a=1, b=2) + '<tool_call>{"name": "f", "arguments": "{\\"k\\": 1}"}</tool_call>'
    assert parse_tool_calls(text) == [("add", {"a": 1, "b": 2}), ("f", {"k": 1})]
    assert parse_tool_calls("no calls") == []


def test_tools_file_that_fails_to_import_is_refused(tmp_path):
    bad = tmp_path / "tools.py"
    bad.write_text("import not_a_module_here\n")
    with pytest.raises(AgentLoopError, match="failed to import: ModuleNotFoundError"):
        load_tools_file(str(bad))
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(AgentLoopError, match="define TOOLS"):
        load_tools_file(str(empty))
    good = tmp_path / "good.py"
    good.write_text(textwrap.dedent('''
        def mul(a: int, b: int) -> int:
            """Multiply."""
            return a * b
        TOOLS = [mul]
    '''))
    assert [s.name for s in load_tools_file(str(good)).specs] == ["mul"]


class FakeChatTokenizer:
    """A Qwen-like template: <|im_start|>role\\ncontent<|im_end|>\\n, tool messages inside a user turn."""

    chat_template = "qwen-like"
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "<|im_end|>"

    def apply_chat_template(self, messages, *, add_generation_prompt=True):
        out = ""
        for i, m in enumerate(messages):
            if m["role"] == "tool":
                if i == 0 or messages[i - 1]["role"] != "tool":
                    out += "<|im_start|>user"
                out += f"\n<tool_response>\n{m['content']}\n</tool_response>"
                if i == len(messages) - 1 or messages[i + 1]["role"] != "tool":
                    out += "<|im_end|>\n"
            else:
                out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def test_template_rendering_is_a_suffix_after_the_sampled_end_of_turn():
    text = render_tool_responses(FakeChatTokenizer(), ["3", "4"])
    assert text == ("\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n4\n"
                    "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_warm_up_demonstrations_are_the_loops_own_trajectories():
    from pathlib import Path

    from ppo.agents.demonstrations import demonstration

    calc = load_tools_file(str(Path(__file__).resolve().parents[3] / "conf" / "tools" / "calculator.py"))
    loop = tool_loop(calc.specs, max_turns=2, max_tool_response_tokens=24)
    pool = ToolPool(workers=1)
    turns = calc.sft_turns("12*34=", "408")
    traj = demonstration(loop, prompt_ids=TOK.encode("12*34="), turns=turns, tokenizer=TOK, tools=pool,
                         max_response_tokens=96, max_total_tokens=128)
    pool.close()
    call = TOK.encode('<tool_call>{"arguments":{"x":"12*34"},"name":"calc"}</tool_call>') + [EOS]
    obs = TOK.encode("<tool_response>\n408\n</tool_response>\n")
    assert traj.response_ids == call + obs + TOK.encode("408") + [EOS]  # the real tool's answer, rendered as in RL
    assert traj.loss_mask == [1] * len(call) + [0] * len(obs) + [1] * 4 and traj.tool_errors == 0
    assert len(call) == 44 and call[0] == TOK.encode("<tool_call>")[0]  # a hermes tag is one token


def test_the_lookup_demos_teacher_calls_the_table_on_a_minority_of_keys():
    from pathlib import Path

    from ppo.data.tasks import get_task, table_value

    table = load_tools_file(str(Path(__file__).resolve().parents[3] / "conf" / "tools" / "table.py"))
    rows = get_task("lookup:3").generate(400, seed=0)
    demos = [(r, table.sft_turns(r["prompt"], r["ground_truth"])) for r in rows]
    calls = [(r, t) for r, t in demos if len(t) == 2]
    share = len(calls) / len(rows)  # the warm-up leaves the policy calling on a minority of prompts
    assert 0.1 < share < 0.24, share
    assert all(t == ["?"] for r, t in demos if len(t) == 1)  # the others: declined
    for r, (call, answer) in calls:
        key = r["prompt"][:3]
        assert call == f'<tool_call>{{"arguments":{{"k":"{key}"}},"name":"get"}}</tool_call>'
        assert answer == r["ground_truth"]
    assert [s.name for s in table.specs] == ["get"] and table.specs[0].fn("qxz") == table_value("qxz")
