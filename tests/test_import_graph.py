"""The package layering: quantizer's sub-packages import each other without a cycle, and no
command module (`<package>/cli.py`) imports another package's command module.

Read from the source (every import statement, including those inside functions), so it needs no
optional dependency and sees imports that only run on some paths. A top-level module
(`quantizer/workdir.py`) counts as a package of its own. Command modules are the layer above every
package: `plan/cli.py` asks fit for the largest plan that fits while `fit/cli.py` makes plans, so a
command module is its own node (`plan.cli`); nothing but the `quantizer` command (quantizer/cli.py,
left out) may import one, which keeps them out of every cycle.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import quantizer

ROOT = Path(quantizer.__file__).parent
ENTRY = "cli"  # quantizer/cli.py


def _node(module: str) -> str | None:
    """The package (`plan`), command module (`plan.cli`) or top-level module (`workdir`) that
    `quantizer.X[.Y...]` (a module or a name in one) belongs to."""
    parts = module.split(".")
    if parts[0] != "quantizer" or len(parts) < 2 or parts[1] == "__init__":
        return None
    if (ROOT / parts[1]).is_dir():
        return f"{parts[1]}.{ENTRY}" if len(parts) > 2 and parts[2] == ENTRY else parts[1]
    return parts[1] if (ROOT / f"{parts[1]}.py").exists() else None


def _imports(path: Path) -> set[str]:
    """Every quantizer module or name `path` imports, absolute or relative, as a dotted name."""
    package = ".".join(("quantizer",) + path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {name for name in found if name.split(".")[0] == "quantizer"}


def _modules() -> dict[str, set[str]]:
    return {".".join(("quantizer",) + p.relative_to(ROOT).with_suffix("").parts): _imports(p)
            for p in ROOT.rglob("*.py")}


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, imported in _modules().items():
        src = _node(module)
        if src is None or src == ENTRY:
            continue
        graph[src] |= {dst for dst in map(_node, imported) if dst not in (None, src)}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def _edges_on(graph: dict[str, set[str]], cycle: list[str]) -> str:
    """Which modules make each edge of `cycle`, so a failure says what to move."""
    modules = _modules()
    lines = []
    for a, b in zip(cycle, cycle[1:]):
        why = sorted({f"{m} -> {i}" for m, imported in modules.items() if _node(m) == a
                      for i in imported if _node(i) == b})
        lines.append(f"{a} -> {b}: " + "; ".join(why[:3]))
    return "\n".join(lines)


def test_the_graph_sees_every_package_and_its_imports():
    graph = _package_graph()
    assert {"exl3", "codec", "plan", "fit", "pack", "verify", "model", "checkpoint", "fit.cli"} <= set(graph)
    assert "exl3" in graph["codec"] and "plan" in graph["pack"] and "fit" in graph["plan.cli"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_packages_import_each_other_without_a_cycle():
    graph = _package_graph()
    cycle = _cycle(graph)
    assert cycle is None, "import cycle between packages:\n" + _edges_on(graph, cycle)


def test_the_exl3_vocabulary_imports_no_stage():
    assert _package_graph()["exl3"] <= {"errors"}


def test_only_the_quantizer_command_imports_a_command_module():
    found = sorted(f"{module} -> {name}" for module, imported in _modules().items()
                   if module != f"quantizer.{ENTRY}"
                   for name in imported
                   if (_node(name) or "").endswith(f".{ENTRY}") and _node(name) != _node(module))
    assert not found, "modules importing another package's command module:\n" + "\n".join(found)
