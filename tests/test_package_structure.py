"""The package's shape: no module imports itself back through others, and no module is over 500 lines.

Every import statement counts, at module level or inside a function, absolute (`vitkit.x`) or relative
(`from . import x`, `from ..x import y`): an import moved into a function only to break a cycle still ties the
two modules together. A name a package exports lazily (lazy_loader's `submod_attrs`) counts as an import of
the module that defines it."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import vitkit

ROOT = Path(vitkit.__file__).parent
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its __init__.py)."""
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def lazy_exports(modules: dict[str, Path]) -> dict[tuple[str, str], str]:
    """(package, name) -> the module a package's `lazy_loader.attach(..., submod_attrs={...})` loads it
    from."""
    out = {}
    for package, path in modules.items():
        if path.name != "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.keyword) and node.arg == "submod_attrs":
                for sub, names in ast.literal_eval(node.value).items():
                    out.update({(package, n): f"{package}.{sub}" for n in names})
    return out


def imported_modules(name: str, path: Path, modules: dict[str, Path],
                     lazy: dict[tuple[str, str], str]) -> Iterator[tuple[str, int]]:
    """The package's modules that `name` (the module in `path`) imports, each with the line of the import."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                while target and target not in modules:  # `import vitkit.x.attr` is no module: its owner
                    target = target.rpartition(".")[0]
                if target:
                    yield target, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base not in modules:
                continue
            for alias in node.names:
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod, and a
                # name mod exports lazily the module that defines it.
                sub = f"{base}.{alias.name}"
                yield (sub if sub in modules else base), node.lineno
                if (base, alias.name) in lazy:
                    yield lazy[base, alias.name], node.lineno


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import}."""
    modules = package_modules()
    lazy = lazy_exports(modules)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for target, line in imported_modules(name, path, modules, lazy):
            if target != name:
                edges.setdefault(target, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    """A cycle's modules and the imports that tie them, with the file and line of each."""
    modules = package_modules()
    inside = set(component)
    edges = [f"{modules[a].relative_to(ROOT.parent)}:{line} imports {b}"
             for a in component for b, line in sorted(graph[a].items()) if b in inside]
    return " <-> ".join(component) + "\n    " + "\n    ".join(edges)


def test_the_import_graph_resolves_relative_imports():
    graph = import_graph()
    assert "vitkit.train.settings" in graph["vitkit.train.recipes"]  # from .settings import ...
    assert "vitkit.train.distributed" in graph["vitkit.train.loop"]  # from . import distributed
    assert "vitkit.data.views" in graph["vitkit.train.evaluate"]  # from ..data.views import ...
    assert "vitkit.transfer" in graph["vitkit.train.prepare"]  # inside a function
    assert "vitkit" in graph["vitkit.train.prepare"]  # from .. import load: the package itself,
    assert "vitkit.loading" in graph["vitkit.train.prepare"]  # and the module it loads `load` from
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(describe(c, graph) for c in found)


def test_no_module_over_500_lines():
    lengths = {name: len(path.read_text().splitlines()) for name, path in package_modules().items()}
    long = {name: n for name, n in lengths.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
