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


# --- models never reach into the runners ------------------------------------------------------

RUNNER_PACKAGES = ("pprun.worker", "pprun.executor", "pprun.engine")
"""What a model module may not import: the runners and their model-state plug-ins
(``pprun.worker``, V1 and V2 alike) and everything that drives them."""


def imported_names(path: Path, module: str) -> list[tuple[int, str]]:
    """Every module name ``path`` imports, as (line, absolute name), wherever the import stands
    (inside functions, methods and ``if TYPE_CHECKING:`` too); relative imports resolved against
    ``module``.  Names need not exist: a typo still counts."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if path.name == "__init__.py" else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def runner_imports(models_dir: Path) -> list[str]:
    """``file:line: name`` for every import of a runner package by a module of ``models_dir``."""
    bad = []
    for path in sorted(models_dir.rglob("*.py")):
        for line, name in imported_names(path, module_name(path, models_dir.parent)):
            if any(name == p or name.startswith(p + ".") for p in RUNNER_PACKAGES):
                bad.append(f"{path.name}:{line}: {name}")
    return sorted(set(bad))


def test_runner_import_check_finds_a_deferred_import(tmp_path):
    """The checker itself: imports inside methods, relative ones and plain ones are found."""
    models = tmp_path / "pprun" / "models"
    models.mkdir(parents=True)
    (tmp_path / "pprun" / "__init__.py").write_text("")
    (models / "__init__.py").write_text("")
    (models / "ok.py").write_text("from pprun.models.base import PprunModel\nimport torch\n")
    (models / "a.py").write_text(
        "class M:\n    @property\n    def plugin(self):\n"
        "        from pprun.worker.v2.model_state import ModelState\n        return ModelState\n"
    )
    (models / "b.py").write_text("from ..worker import v2\n")
    (models / "c.py").write_text("import pprun.engine.llm\n")
    assert runner_imports(models) == [
        "a.py:4: pprun.worker.v2.model_state",
        "a.py:4: pprun.worker.v2.model_state.ModelState",
        "b.py:1: pprun.worker",
        "b.py:1: pprun.worker.v2",
        "c.py:1: pprun.engine.llm",
    ]


def test_models_never_import_a_runner():
    """No module under ``pprun/models/`` imports the runners or their plug-ins, lazily or not:
    models declare what they are, and the runners choose their plug-ins from that."""
    assert len(list((ROOT / "models").glob("*.py"))) > 5  # the walk saw the models
    bad = runner_imports(ROOT / "models")
    assert not bad, "pprun/models imports runner code:\n" + "\n".join(bad)


# --- layers: every import runs down -----------------------------------------------------------

LAYERS: list[tuple[str, ...]] = [
    ("switches", "checks", "utils"),
    ("kernels",),
    ("audio", "multimodal"),
    ("attention",),
    ("layers",),
    ("sampling",),
    ("core",),
    ("distributed",),
    ("models",),
    ("config",),
    ("worker",),
    ("executor",),
    ("engine",),
    ("pprun",),
    ("serve",),
    ("apps",),
    ("cli", "__main__"),
]
"""The packages of ``pprun`` from the bottom up (docs/architecture.md, "Layers"): a package
imports only packages of its own layer or below.  ``pprun`` is the package's ``__init__`` (the
public names ``LLM``, ``SamplingParams``, ``RequestOutput``); a top-level module is a package
of its own."""

UPWARD_ALLOWED: dict[tuple[str, str], str] = {}
"""(importer, imported) package pairs allowed to import upward, each with its reason (also in
docs/architecture.md).  At most two."""


def package_of(module: str) -> str:
    """``pprun.worker.v2.runner`` -> ``worker``; ``pprun.checks`` -> ``checks``; ``pprun`` -> ``pprun``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]], layers: list[tuple[str, ...]]) -> dict[tuple[str, str], list[str]]:
    """(importer package, imported package) -> the module imports that run from a lower layer
    to a higher one."""
    rank = {pkg: i for i, layer in enumerate(layers) for pkg in layer}
    unplaced = sorted({package_of(m) for m in graph} - set(rank))
    assert not unplaced, f"packages with no layer (add them to LAYERS): {unplaced}"
    up: dict[tuple[str, str], list[str]] = {}
    for module, deps in graph.items():
        for dep in deps:
            a, b = package_of(module), package_of(dep)
            if rank[a] < rank[b]:
                up.setdefault((a, b), []).append(f"{module} -> {dep}")
    return up


def test_layer_check_finds_an_upward_import():
    """The checker itself: an import from a lower layer to a higher one is reported; one down,
    or within a layer, is not."""
    graph = {
        "pprun.models.llama": {"pprun.layers.norm", "pprun.worker.v2.model_state"},
        "pprun.worker.v2.model_state": {"pprun.models.base"},
        "pprun.models.base": set(),
        "pprun.layers.norm": {"pprun.attention.backend"},
        "pprun.attention.backend": {"pprun.kernels.partials"},
        "pprun.kernels.partials": set(),
    }
    layers = [("kernels",), ("attention", "layers"), ("models",), ("worker",)]
    assert upward_imports(graph, layers) == {("models", "worker"): ["pprun.models.llama -> pprun.worker.v2.model_state"]}
    layers = [("kernels",), ("attention",), ("layers",), ("models",), ("worker",)]
    assert upward_imports(graph, layers) == {("models", "worker"): ["pprun.models.llama -> pprun.worker.v2.model_state"]}
    graph["pprun.kernels.partials"] = {"pprun.layers.norm"}
    assert upward_imports(graph, layers)[("kernels", "layers")] == ["pprun.kernels.partials -> pprun.layers.norm"]


def test_imports_run_down_the_layers():
    """Every import inside ``pprun`` runs from a package to one of its own layer or below,
    except the few named in ``UPWARD_ALLOWED`` (each of which must still be needed)."""
    assert len(UPWARD_ALLOWED) <= 2
    up = upward_imports(import_graph(), LAYERS)
    unexpected = {pair: edges for pair, edges in up.items() if pair not in UPWARD_ALLOWED}
    assert not unexpected, "imports up the layers:\n" + "\n".join(
        e for edges in unexpected.values() for e in sorted(edges)
    )
    stale = sorted(set(UPWARD_ALLOWED) - set(up))
    assert not stale, f"allowed upward imports no longer made (remove them here and in the docs): {stale}"


# --- packages: no two import each other -------------------------------------------------------


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package (as :func:`package_of` names it) -> the other packages its modules import."""
    packages: dict[str, set[str]] = {}
    for module, deps in graph.items():
        importer = package_of(module)
        packages.setdefault(importer, set()).update(package_of(d) for d in deps if package_of(d) != importer)
    return packages


def test_package_check_finds_a_cycle_no_module_cycle_shows():
    """The checker itself: two packages whose modules import each other's (``layers`` a backend,
    ``attention`` the split partials) form a cycle, though no module reaches itself."""
    graph = {
        "pprun.layers.attend": {"pprun.attention.backend"},
        "pprun.attention.backend": {"pprun.layers.partials"},
        "pprun.layers.partials": set(),
        "pprun.models.llama": {"pprun.layers.attend"},
    }
    assert not find_cycles(graph)
    assert find_cycles(package_graph(graph)) == [["attention", "layers", "attention"]]
    graph["pprun.attention.backend"] = {"pprun.kernels.partials"}
    graph["pprun.kernels.partials"] = graph.pop("pprun.layers.partials")
    assert not find_cycles(package_graph(graph))


def test_no_package_import_cycles():
    """No package of ``pprun`` reaches itself through its modules' imports, not even two packages
    of one layer (``LAYERS`` lets those import each other; this does not)."""
    cycles = find_cycles(package_graph(import_graph()))
    assert not cycles, "import cycles between pprun's packages:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_attention_never_imports_layers():
    """``pprun.attention`` sits below ``pprun.layers``: a layer calls an attention backend, never
    the other way; the Triton helpers and split partials both use are in ``pprun.kernels``."""
    bad = sorted(
        f"{module} -> {dep}"
        for module, deps in import_graph().items()
        if package_of(module) == "attention"
        for dep in deps
        if package_of(dep) == "layers"
    )
    assert not bad, "pprun/attention imports pprun/layers:\n" + "\n".join(bad)
