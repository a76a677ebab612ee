"""The project's import graph: no circle anywhere, and every import points down the layering of
docs/design.md (launcher -> ppo -> rollout -> parallel -> models; inside ppo, the wings' order).

Imports inside functions count too: a lazy import hides a circle from the interpreter, not from a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("launcher", "ppo", "rollout", "parallel", "models")
LAYERS = {name: i for i, name in enumerate(PACKAGES)}  # an import may point to its own layer or a later one
# inside ppo: a wing may import itself and the wings after it; settings.py is a leaf everyone may read
PPO_WINGS = ("trainer", "control", "metrics", "run", "roles", "agents", "batch", "data", "settings", "algos")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """Project modules that `name` imports anywhere in its file (module level or inside functions)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import fn` imports mod
            targets = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            targets = targets or [base]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `from pkg import mod` names a module; `from mod import fn` does not
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = project_modules()
    known = set(mods)
    return {name: imports_of(path, name, known) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def ppo_wing(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else "ppo"


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_imports_point_down_the_layers():
    wrong = []
    for mod, targets in import_graph().items():
        for t in targets:
            a, b = mod.split(".")[0], t.split(".")[0]
            if LAYERS[b] < LAYERS[a]:
                wrong.append(f"{mod} -> {t}")
            elif a == b == "ppo" and mod != "ppo" and t != "ppo":
                wa, wb = ppo_wing(mod), ppo_wing(t)
                if wa in PPO_WINGS and wb in PPO_WINGS and PPO_WINGS.index(wb) < PPO_WINGS.index(wa):
                    wrong.append(f"{mod} -> {t} (ppo wing {wa} may not import wing {wb})")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_ppo_is_grouped_in_wings():
    loose = sorted(p.name for p in (ROOT / "ppo").glob("*.py") if p.name not in ("__init__.py",
                                                                                   "settings.py"))
    assert not loose, f"modules outside a wing of ppo/: {loose}"


def test_ppo_reads_typed_settings_not_the_config_tree():
    """launcher/handoff.py builds ppo/settings.py's dataclasses once; no ppo module reads a section of the
    launcher's config tree (an untyped `cfg` passed through would hide the dependency from the import graph)."""
    import re

    sections = "trainer|model|actor|critic|ref|reward|rollout|data|algorithm|placement|monitor|controller"
    tree_read = re.compile(rf"\b\w*(cfg|config)\.({sections})\.\w")
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in sorted((ROOT / "ppo").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if tree_read.search(line) and not line.lstrip().startswith("#")]
    assert not hits, "ppo reads the launcher's config tree:\n" + "\n".join(hits)
