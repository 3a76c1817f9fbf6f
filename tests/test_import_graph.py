"""No import circles among the package's own modules, counting imports inside functions; none among
its packages either; and the pipeline imports nothing from the app.

The graph is read from the source with `ast` (nothing is imported): every `import hidream_ui...` and
`from hidream_ui... import ...` (and relative import) anywhere in a module, at module level or
inside a function, is an edge. `from pkg import name` is an edge to `pkg.name` when that is a module,
else to `pkg`. A package's `__init__` counts as a module of its own; importing `a.b.c` runs
`a/__init__` and `a/b/__init__` too, but those are free by design (nothing runs on import), so only
the named module is an edge. `if TYPE_CHECKING:` blocks are skipped: they never run.

The package graph collapses every module to its top-level part under hidream_ui (`engine`, `model`,
`pipeline`, ...; a top-level module such as `config` or `edits` is a node of its own): layers point
down only, so that graph has no circle either, even where no module-level circle closes it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "hidream_ui"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def module_names(root: Path = ROOT) -> dict[str, Path]:
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every import node that can run (skips `if TYPE_CHECKING:` bodies)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def edges_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    targets: set[str] = set()
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            bases = [alias.name for alias in node.names]
            names: list[str] = []
        else:
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            bases = [base]
            names = [alias.name for alias in node.names]
        for base in bases:
            if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
                continue
            for item in names or [None]:
                if item is not None and f"{base}.{item}" in modules:
                    targets.add(f"{base}.{item}")  # `from pkg import module`
                    continue
                parts = base.split(".")  # `import a.b` or `from a.b import name`: a.b (or its nearest module)
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                if parts:
                    targets.add(".".join(parts))
    targets.discard(name)
    return targets


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: edges_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one cycle
    through it (found by a search inside the component), so the message shows a path to cut."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:  # recursion depth is bounded by the module count (~100)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return [_one_cycle(graph, set(c)) for c in sorted(components)]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    # breadth-first from start back to start, inside the component: the shortest loop through it
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return sorted(component)  # unreachable for a strongly connected component


def describe(found: list[list[str]], graph: dict[str, set[str]]) -> str:
    lines = []
    for loop in found:
        lines.append(" -> ".join(loop))
    return "\n".join(lines)


def test_the_package_has_no_import_circle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import circles among hidream_ui's modules:\n" + describe(found, graph)


def test_the_graph_sees_imports_inside_functions(tmp_path):
    """The checker itself: a circle closed by an import inside a function is one, a TYPE_CHECKING
    import is not, relative imports resolve."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from hidream_ui.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import thing\n")
    (pkg / "c.py").write_text("def g():\n    import hidream_ui.a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hidream_ui import a\n")
    (pkg / "e.py").write_text("from hidream_ui.d import x\n")
    graph = import_graph(pkg)
    assert graph["hidream_ui.sub.b"] == {"hidream_ui.c"}
    assert graph["hidream_ui.d"] == set()
    assert cycles(graph) == [["hidream_ui.a", "hidream_ui.sub.b", "hidream_ui.c", "hidream_ui.a"]]
    (pkg / "c.py").write_text("def g():\n    pass\n")
    assert cycles(import_graph(pkg)) == []


def package_of(module: str) -> str:
    """`hidream_ui.engine.pool` -> `engine`; `hidream_ui.config` -> `config`; the package itself -> `hidream_ui`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]]) -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    """The graph between packages, and for each package edge the module edges that make it (for messages)."""
    packages: dict[str, set[str]] = {}
    why: dict[tuple[str, str], list[str]] = {}
    for source, targets in graph.items():
        a = package_of(source)
        packages.setdefault(a, set())
        for target in sorted(targets):
            b = package_of(target)
            if a != b:
                packages[a].add(b)
                why.setdefault((a, b), []).append(f"{source} -> {target}")
    return packages, why


def describe_packages(found: list[list[str]], why: dict[tuple[str, str], list[str]]) -> str:
    lines = []
    for loop in found:
        lines.append(" -> ".join(loop))
        for a, b in zip(loop, loop[1:]):
            lines.append(f"    {a} -> {b}: " + "; ".join(why[(a, b)][:4]))
    return "\n".join(lines)


def test_the_packages_have_no_import_circle():
    packages, why = package_graph(import_graph())
    found = cycles(packages)
    assert not found, "import circles among hidream_ui's packages (layers must point down):\n" + describe_packages(
        found, why
    )


# What the pipeline may import from hidream_ui: itself, and the device layer below it. It takes plain
# arguments, as a diffusers pipeline does: the edit schema, the config, the engine, results, the UI, the
# server, the CLI, benchmarks and the lab sit above it.
PIPELINE_MAY_IMPORT = ("pipeline", "device")


def app_imports_of_pipeline(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        if package_of(source) == "pipeline"
        for target in targets
        if package_of(target) not in PIPELINE_MAY_IMPORT
    )


def test_the_pipeline_imports_nothing_from_the_app():
    found = app_imports_of_pipeline(import_graph())
    assert not found, "the pipeline imports the app (pass plain arguments instead):\n" + "\n".join(found)


def test_the_package_graph_sees_circles_no_module_closes(tmp_path):
    """The checker itself: engine.a -> results and results -> engine.b is a package circle (no module
    circle); a pipeline module importing the edit schema is found, one importing the device layer is not."""
    pkg = tmp_path / PACKAGE
    for sub in ("engine", "pipeline", "device"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "a.py").write_text("from hidream_ui import results\n")
    (pkg / "engine" / "b.py").write_text("X = 1\n")
    (pkg / "results.py").write_text("def f():\n    from hidream_ui.engine.b import X\n")
    (pkg / "edits.py").write_text("Y = 2\n")
    (pkg / "device" / "d.py").write_text("Z = 3\n")
    (pkg / "pipeline" / "p.py").write_text("from hidream_ui.device.d import Z\nfrom hidream_ui.edits import Y\n")
    graph = import_graph(pkg)
    assert cycles(graph) == []
    packages, why = package_graph(graph)
    assert cycles(packages) == [["engine", "results", "engine"]]
    assert why[("results", "engine")] == ["hidream_ui.results -> hidream_ui.engine.b"]
    assert app_imports_of_pipeline(graph) == ["hidream_ui.pipeline.p -> hidream_ui.edits"]
    (pkg / "results.py").write_text("X = 1\n")
    (pkg / "pipeline" / "p.py").write_text("from hidream_ui.device.d import Z\n")
    graph = import_graph(pkg)
    assert cycles(package_graph(graph)[0]) == [] and app_imports_of_pipeline(graph) == []
