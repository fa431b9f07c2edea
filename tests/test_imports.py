"""The import graph of ``pprun`` has no cycle: every part imports only the parts below it.

The graph is read from the source with ``ast`` (nothing is imported).  Every ``import`` inside
``pprun/`` counts as an edge, wherever it stands: at module level, inside a function (a
deferred import still makes one module depend on the other; deferring it only hides a cycle
from the interpreter's loader), and under ``if TYPE_CHECKING:`` (a type-only import couples the
two modules' meanings just the same).  ``from pkg import name`` is an edge to the submodule
``pkg.name`` when that module exists, else to ``pkg``.  The implicit import of a package's
``__init__`` before its submodules is not an edge: a package's ``__init__`` may re-export its
submodules.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pprun"


def module_name(path: Path, root: Path = ROOT) -> str:
    """``pprun/worker/v2/runner.py`` -> ``pprun.worker.v2.runner``; a package's ``__init__``
    is the package."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the ``pprun`` modules it imports (see the module docstring for what counts)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}

    def target(name: str) -> str | None:
        # The longest prefix that is one of our modules (``pprun.a.b.Cls`` -> ``pprun.a.b``).
        while name:
            if name in files:
                return name
            name = name.rpartition(".")[0]
        return None

    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            found: list[str] = []
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join([*anchor, base] if base else anchor)
                found = [f"{base}.{alias.name}" for alias in node.names] + [base]
                # ``from pkg import sub``: the submodule when it exists, else the package itself.
                found = [f for f in found[:-1] if f in files] or [found[-1]]
            for imported in found:
                dep = target(imported) if imported.startswith("pprun") else None
                if dep is not None and dep != name:
                    graph[name].add(dep)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), each as
    the path ``a -> b -> ... -> a``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, comp) for comp in components]


def _cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    start = min(comp)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle found in component {sorted(comp)}")


def test_graph_finds_a_cycle(tmp_path):
    """The checker itself: a two-module cycle through a function-local import is found."""
    pkg = tmp_path / "pprun"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from pprun.sub.b import B\nA = 1\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import a\n    return a.A\nB = 2\n")
    (pkg / "sub" / "c.py").write_text("import pprun.sub.a\n")
    graph = import_graph(pkg)
    assert graph["pprun.sub.b"] == {"pprun.sub.a"}
    assert graph["pprun.sub.c"] == {"pprun.sub.a"}
    assert find_cycles(graph) == [["pprun.sub.a", "pprun.sub.b", "pprun.sub.a"]]


def test_no_import_cycles():
    """No module of ``pprun`` reaches itself through imports."""
    graph = import_graph()
    assert len(graph) > 50  # the walk saw the package
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in pprun:\n" + "\n".join(" -> ".join(c) for c in cycles)
