"""The package's shape, read from its imports: modules sit in layers, a module imports only from its
own layer or below, no set of modules imports itself round, and the commands live in one folder.

Read from the source (every import statement, those inside functions and under TYPE_CHECKING
included), so it needs no optional dependency and sees imports that only run on some paths. A node is
a module file; `from package import name` points at the module `package.name` when there is one, else
at the package's `__init__`. A folder's `__init__` is not charged for its submodules: importing
`quantizer.codec.native` runs `quantizer/codec/__init__.py`, which is how Python works, not a design
choice. The layers are docs/ARCHITECTURE.md's.
"""

from __future__ import annotations

import ast
from pathlib import Path

import quantizer

ROOT = Path(quantizer.__file__).parent

# Lowest first. A top-level module (`workdir.py`) or folder (`fit/`) belongs to one layer.
LAYERS = (
    ("foundation", {"__init__", "errors", "report", "caches", "hub", "shipped", "workdir", "exl3", "distributed"}),
    ("formats", {"checkpoint", "codec", "textdata"}),
    ("model", {"model"}),
    ("contract", {"contract"}),
    ("stages", {"calibrate", "plan", "fit", "quantize", "pack", "plots", "tune", "verify", "inventory", "ppl",
                "evaluate", "publish", "tiny"}),
    ("orchestration", {"orchestrate", "demo"}),
    ("commands", {"commands"}),
    ("entry", {"cli", "__main__"}),
)


def _module_files() -> dict[str, Path]:
    """Dotted module name -> file, a package under its own name (`quantizer.codec`)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("quantizer",) + path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The quantizer modules `name` (at `path`) imports."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            submodules = {f"{base}.{a.name}" for a in node.names} & set(modules)
            found |= submodules or {base}
            if len(submodules) < len(node.names):
                found.add(base)  # some names are the package's own
    return {n for n in found if n in modules and n != name}


def import_graph() -> dict[str, set[str]]:
    modules = _module_files()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def layer_of(module: str) -> int:
    """Index into LAYERS of the top-level module or folder `module` belongs to."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for i, (_, members) in enumerate(LAYERS):
        if top in members:
            return i
    raise AssertionError(f"{module}: its folder or file {top!r} is in no layer of LAYERS; add it")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
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


def test_the_graph_sees_modules_and_their_imports():
    graph = import_graph()
    assert "quantizer.contract.plan" in graph["quantizer.contract.rules"]
    assert "quantizer.codec.native" in graph["quantizer.codec.viterbi"]  # `from . import native`
    assert "quantizer.codec" not in graph["quantizer.codec.viterbi"]
    assert "quantizer.contract.pack_spec" in graph["quantizer.verify.checks"]  # an import inside a function counts
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_module_has_a_layer():
    for module in import_graph():
        layer_of(module)
    code = {p.relative_to(ROOT).parts[0].removesuffix(".py") for p in ROOT.rglob("*.py")}
    assert code <= set().union(*(members for _, members in LAYERS))  # and no layer names a folder that is gone
    assert set().union(*(members for _, members in LAYERS)) <= code


def test_no_module_imports_from_a_higher_layer():
    upward = sorted(f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})"
                    for a, imported in import_graph().items() for b in imported if layer_of(b) > layer_of(a))
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_commands_live_in_one_folder_and_modules_do_not_stutter():
    assert not list(ROOT.glob("*/cli.py")), "a cli.py inside a stage folder: commands belong in quantizer/commands/"
    stutter = [str(p.relative_to(ROOT)) for p in ROOT.glob("*/*.py") if p.stem == p.parent.name]
    assert not stutter, f"a folder holding a module of its own name: {stutter}"


# Where an engine's name enters and becomes its LoaderProfile (docs/ARCHITECTURE.md, "The engine is one object"):
# the command line, plan.json, a manifest, a recipe file; and the contract itself.
NAME_ENTRIES = {"contract/loader_profiles.py", "contract/plan.py", "pack/manifest.py", "plan/recipe.py",
                "commands/arguments.py"}
PROFILE_NAMES = ("EXLLAMAV3", "VLLM_EXL3", "TENSORFOLD", "EXLLAMAV3_V41")


def _calls(tree: ast.AST, name: str) -> int:
    return sum(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == name
               for n in ast.walk(tree))


def test_a_profile_is_resolved_only_where_its_name_enters():
    resolving = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if _calls(ast.parse(p.read_text()), "load_profile")}
    assert resolving <= NAME_ENTRIES, f"load_profile( outside where a name enters: {sorted(resolving - NAME_ENTRIES)}"


def test_no_code_outside_the_contract_switches_on_an_engine_name():
    from quantizer.contract.loader_profiles import loader_names

    found = []
    for path in ROOT.rglob("*.py"):
        where = str(path.relative_to(ROOT))
        if where.startswith("contract/"):
            continue
        tree = ast.parse(path.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module == "quantizer.contract.loader_profiles":
                found += [f"{where}: imports {a.name}" for a in n.names if a.name in PROFILE_NAMES]
            if isinstance(n, (ast.Compare, ast.Dict)):
                text = ast.unparse(n)
                named = [c.value for c in ast.walk(n) if isinstance(c, ast.Constant) and c.value in loader_names()]
                if named and ("loader" in text or "profile" in text):
                    found.append(f"{where}:{n.lineno}: {text[:80]}")
    assert not found, "engine knowledge switched by name outside contract/:\n" + "\n".join(found)


def test_every_command_run_is_thin():
    for path in sorted((ROOT / "commands").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name == "run":
                assert node.end_lineno - node.lineno + 1 <= 40, f"{path.name}: run() is {node.end_lineno - node.lineno + 1} lines"


def test_the_architecture_drawing_is_the_layers_the_test_keeps():
    """docs/ARCHITECTURE.md's drawing: every layer, top first, with exactly its folders and modules."""
    text = (ROOT.parent / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("```\nentry", 1)[1].split("```", 1)[0]
    drawn = [line.split(None, 1) for line in ("entry" + block).strip().splitlines()]
    assert [name for name, _ in drawn] == [name for name, _ in reversed(LAYERS)]
    for (name, members), (_, listed) in zip(reversed(LAYERS), drawn):
        assert {m.strip().rstrip("/") for m in listed.split(",")} == members, name
