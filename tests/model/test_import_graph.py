"""The package's imports, read from its source with `ast`: no import cycle among turbo_moe's modules (function-level
imports included, so none can hide one), and no private op module (`turbo_moe.ops._*`) imported by the model."""

import ast
from pathlib import Path

import turbo_moe

ROOT = Path(turbo_moe.__file__).parent
SKIPPED: tuple[str, ...] = ()  # modules left out of the graph (neither checked nor followed): none


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = (root.name,) + path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, importer: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package's modules that `node` (an import statement in module `importer`) loads by name."""
    def existing(name: str) -> str | None:  # `import a.b.C` where C is a class: the module a.b
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    if isinstance(node, ast.Import):
        found = {existing(alias.name) for alias in node.names}
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the importer's package, one level up per extra dot
            package = importer if is_package else importer.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        # `from pkg import sub` loads the submodule; `from pkg import name` runs pkg's __init__.
        found = {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else existing(base) for a in node.names}
    else:
        return set()
    return {name for name in found if name}


def import_graph(root: Path = ROOT, skipped: tuple[str, ...] = SKIPPED) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its file. Importing a.b.c also runs the __init__ of
    the packages a and a.b above it, so those are edges too, except the importer's own packages (always loaded
    before it: the cycle package -> submodule -> package is how every package works)."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    modules = set(paths)
    inside = lambda name, prefix: name == prefix or name.startswith(prefix + ".")
    graph = {}
    for name, path in paths.items():
        if any(inside(name, s) for s in skipped):
            continue
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(node, name, path.name == "__init__.py", modules):
                parts = target.split(".")
                deps.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                            if p in modules and not inside(name, p))
        graph[name] = {d for d in deps if not any(inside(d, s) for s in skipped)}
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


def test_import_graph_sees_function_level_relative_and_package_imports(tmp_path):
    """A cycle hidden in a function, through a relative import or through another package's __init__ is found."""
    pkg = tmp_path / "pkg"
    for folder in (pkg, pkg / "a", pkg / "b"):
        folder.mkdir()
        (folder / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from pkg.a.one import f\n")
    (pkg / "a" / "one.py").write_text("def f():\n    from ..b import two\n")
    (pkg / "b" / "two.py").write_text("import pkg.a.other\n")
    (pkg / "a" / "other.py").write_text("")
    graph = import_graph(pkg, skipped=())
    assert graph["pkg.a.one"] == {"pkg.b", "pkg.b.two"} and graph["pkg.b.two"] == {"pkg.a", "pkg.a.other"}
    assert find_cycle(graph) == ["pkg.a", "pkg.a.one", "pkg.b.two", "pkg.a"]
    assert find_cycle(import_graph(pkg, skipped=("pkg.b",))) is None


def test_package_import_graph_has_no_cycle():
    graph = import_graph()
    assert {"turbo_moe.model.paths", "turbo_moe.ops.permute", "turbo_moe.train.step", "turbo_moe.cli"} <= set(graph)
    assert "turbo_moe.model.config" in graph["turbo_moe.model.paths"]
    assert {"turbo_moe.experiments.notebooks.train", "turbo_moe.experiments.store.migrate"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_model_imports_no_private_op_module():
    private = {}
    for path in (ROOT / "model").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) and node.module else [])
            private.setdefault(path.name, []).extend(n for n in names if n.startswith("turbo_moe.ops._"))
    assert {name: found for name, found in private.items() if found} == {}
