"""Every config key with its type, default and one-line meaning, generated from the schema.

    python -m launcher.config                 # all sections
    python -m launcher.config rollout data    # some sections (or dotted prefixes: actor.optim)

The meanings are the comments written beside (or just above) each field of the dataclasses in
launcher/config/schema.py, so the listing cannot drift from the schema: a field without a comment shows
up in `undocumented_keys()`, which the tests keep empty.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import tokenize
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

from launcher.config.schema import CHOICES, Config


@dataclass(frozen=True, slots=True)
class KeyDoc:
    key: str  # dotted, e.g. "actor.optim.lr"; list elements as "placement.pools[].size"
    type: str
    default: str
    meaning: str


@cache
def _comments(path: str) -> dict[str, dict[str, str]]:
    """{class name: {field: comment}} of a source file: the comment on the field's own line, else the
    comment lines directly above it."""
    with open(path) as f:
        source = f.read()
    by_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out: dict[str, dict[str, str]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        fields = out.setdefault(node.name, {})
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            text = by_line.get(stmt.end_lineno or stmt.lineno)
            if text is None:  # a block of full-line comments right above the field
                above, n = [], stmt.lineno - 1
                while n >= 1 and lines[n - 1].strip().startswith("#"):
                    above.insert(0, by_line.get(n, ""))
                    n -= 1
                text = " ".join(above) or None
            if text:
                fields[stmt.target.id] = text
    return out


def _meaning(cls: type, name: str) -> str:
    """The comment of field `name`, from the class in cls's MRO that declares it."""
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}):
            return _comments(inspect.getsourcefile(klass)).get(klass.__name__, {}).get(name, "")
    return ""


def _type_name(t: Any) -> str:
    origin = typing.get_origin(t)
    if origin is list:
        return f"list[{_type_name(typing.get_args(t)[0])}]"
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(_type_name(a) for a in typing.get_args(t))
    if t is type(None):
        return "None"
    return getattr(t, "__name__", str(t))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _show(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list):
        return "[" + ",".join(_show(x) for x in v) + "]"
    return str(v)


def describe(cls: type | None = None, prefix: str = "", defaults: Any = None) -> list[KeyDoc]:
    """Every leaf key of the schema under `cls` (default: the whole Config), in declaration order. defaults: the
    section's default instance where its parent sets one (critic.optim's lr is not OptimConfig's)."""
    cls = cls or Config
    hints = typing.get_type_hints(cls)
    out: list[KeyDoc] = []
    for f in dataclasses.fields(cls):
        key, t = prefix + f.name, hints[f.name]
        elem = typing.get_args(t)[0] if typing.get_origin(t) is list else None
        default = getattr(defaults, f.name) if defaults is not None else _default(f)
        if dataclasses.is_dataclass(t):
            out += describe(t, key + ".", default)
            continue
        section = [a for a in typing.get_args(t) if dataclasses.is_dataclass(a)] if elem is None else []
        if section:  # an optional section (reward.model): null unless set; its keys with the class's defaults
            out.append(KeyDoc(key, f"{section[0].__name__} | None", "null", _meaning(cls, f.name)))
            out += describe(section[0], key + ".")
            continue
        meaning = _meaning(cls, f.name)
        choices = CHOICES.get(key)
        if choices and not set(choices) <= set(re.findall(r"[\w.:-]+", meaning)):
            meaning += f" (one of: {' | '.join(choices)})"
        out.append(KeyDoc(key, _type_name(t), _show(default), meaning))
        if elem is not None and dataclasses.is_dataclass(elem):
            out += describe(elem, key + "[].")
    return out


def undocumented_keys() -> list[str]:
    return [d.key for d in describe() if not d.meaning]


def render(docs: list[KeyDoc]) -> str:
    """Sections separated by a blank line; columns aligned: key, type, default, meaning."""
    kw = max(len(d.key) for d in docs)
    tw = max(len(d.type) for d in docs)
    dw = min(24, max(len(d.default) for d in docs))
    lines, section = [], None
    for d in docs:
        top = d.key.split(".")[0]
        if top != section:
            if section is not None:
                lines.append("")
            section = top
        default = d.default if len(d.default) <= dw else d.default[:dw - 3] + "..."
        lines.append(f"{d.key:<{kw}}  {d.type:<{tw}}  {default:<{dw}}  {d.meaning}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    docs = describe()
    if argv:
        picked = []
        for want in (a.rstrip(".") for a in argv):
            under = [d for d in docs if d.key == want or d.key.startswith((want + ".", want + "[]"))]
            if not under:
                sections = sorted({d.key.split(".")[0] for d in docs})
                print(f"error: no config keys under {want!r}; sections: {', '.join(sections)}", file=sys.stderr)
                return 2
            picked += [d for d in under if d not in picked]
        docs = picked
    print("key  type  default  meaning   (set with `key=value` after the YAML file, or in the YAML; "
          "lists as [a,b])\n")
    print(render(docs))
    return 0

