"""The import structure of ``torchtitan_omni``: no cycles, and no import of a higher layer.

Imports are read from the source (``ast``), nothing is imported: every ``import`` statement a
module executes (at its top level or inside a function; ``if TYPE_CHECKING:`` blocks, which
never run, are left out) is an edge to the ``torchtitan_omni`` module it names, or to the
package when it names something the package's ``__init__`` defines. Importing a module also
runs the ``__init__`` of each package above it: for the cycle check, those are edges too
(except the importer's own packages, which are already being imported).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import torchtitan_omni

ROOT = Path(torchtitan_omni.__file__).parent

#: lowest first; a module may import its own top-level package or module and lower layers.
#: ``models`` is the zoo (``models/`` at the repository root, installed as
#: ``torchtitan_omni.models``).
LAYERS = [
    ["errors", "platform", "compat"],
    ["protocols"],
    ["modules"],
    ["foundations"],
    ["encoders"],
    ["decoders"],
    ["omni_model", "lora", "flops", "job_model"],
    ["data"],
    ["distributed"],
    ["checkpoint"],
    ["components", "eval", "encoder_ranks"],
    ["hf_flavor", "model_args"],
    ["spec"],
    ["models"],
    ["config"],
    ["train", "generate"],
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    """Module name -> source file, the zoo included (reached through a symbolic link)."""
    out = {}
    for folder, dirs, files in os.walk(ROOT, followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if not name.endswith(".py"):
                continue
            path = Path(folder, name)
            parts = ["torchtitan_omni", *path.relative_to(ROOT).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _target(name: str) -> str | None:
    """The module of ``name`` (or its nearest package) if it is ours."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """``torchtitan_omni`` modules that ``module`` imports when it runs."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(filter(None, (_target(a.name) for a in node.names)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base.split(".")[0] == "torchtitan_omni":
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in MODULES else _target(base))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    found.discard(module)
    return found


def _packages(module: str) -> set[str]:
    """The packages whose ``__init__`` runs before ``module`` (``torchtitan_omni.a.b`` ->
    ``torchtitan_omni.a``; the root is left out: it only selects the device)."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts))} & set(MODULES)


def with_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` plus an edge to every package ``__init__`` an import runs."""
    out = {}
    for module, targets in graph.items():
        own = _packages(module) | {module}
        extra = {p for t in targets for p in _packages(t) if p not in own}
        out[module] = targets | extra
    return out


GRAPH = {m: imports_of(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def _unit(module: str) -> str:
    """The layer unit of a module: its top-level package or module under torchtitan_omni."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_the_walk_sees_the_package_and_the_zoo():
    assert "torchtitan_omni.models.janus.args" in MODULES
    assert "torchtitan_omni.config.manager" in GRAPH["torchtitan_omni.train"]


def test_cycle_detection_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph = with_package_inits(GRAPH)
    cycles = _cycles(graph)
    lines = []
    for component in cycles:
        lines.append(" <-> ".join(component))
        lines += [f"    {m} imports {sorted(graph[m] & set(component))}" for m in component]
    assert not cycles, "import cycles:\n" + "\n".join(lines)


def test_every_module_has_a_layer():
    units = {_unit(m) for m in MODULES if m != "torchtitan_omni"}
    assert units <= set(RANK), f"modules without a layer in LAYERS: {sorted(units - set(RANK))}"


def test_no_module_imports_a_higher_layer():
    upward = []
    for module, targets in sorted(GRAPH.items()):
        if module == "torchtitan_omni":
            continue
        for target in sorted(targets):
            if target == "torchtitan_omni":
                continue  # the package root only selects the device
            if RANK[_unit(target)] > RANK[_unit(module)]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports of a higher layer (see LAYERS):\n" + "\n".join(upward)
