"""The model package's imports, read from its source with `ast`: no cycle among turbo_moe.model's modules (function-level
imports included, so none can hide one), and no private op module (`turbo_moe.ops._*`) imported by the model."""

import ast
from pathlib import Path

import turbo_moe.model

PACKAGE = "turbo_moe.model"
ROOT = Path(turbo_moe.model.__file__).parent


def _module_name(path: Path) -> str:
    return PACKAGE if path.name == "__init__.py" else f"{PACKAGE}.{path.stem}"


def import_graph() -> dict[str, set[str]]:
    """turbo_moe.model module -> the turbo_moe.model modules it imports, anywhere in its file. A name taken from
    the package (`from turbo_moe.model import get_config`) depends on the package's __init__, `turbo_moe.model`."""
    modules = {_module_name(p): p for p in ROOT.glob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == PACKAGE:
                deps.update(f"{PACKAGE}.{a.name}" if f"{PACKAGE}.{a.name}" in modules else PACKAGE for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
                deps.add(node.module)
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_model_import_graph_has_no_cycle():
    graph = import_graph()
    assert {"turbo_moe.model.paths", "turbo_moe.model.config", PACKAGE} <= set(graph)
    assert "turbo_moe.model.config" in graph["turbo_moe.model.paths"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_model_imports_no_private_op_module():
    private = {}
    for path in ROOT.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) and node.module else [])
            private.setdefault(path.name, []).extend(n for n in names if n.startswith("turbo_moe.ops._"))
    assert {name: found for name, found in private.items() if found} == {}
