"""No import circles among the project's modules (sim/, core/, reference/, swebench_env/), read from their source.

Every import statement counts wherever it stands: at module level, under `if TYPE_CHECKING:` (a circle a type
checker resolves is still two modules that cannot be understood one without the other) and inside a function (a
lazy import that closes a circle only hides it until the function runs). `from a.b import c` is an edge to the
module `a.b.c` when there is one, else to `a.b`; a package's own `__init__` is reached only by importing it by
name. The modules are parsed, never imported, so the test needs none of the optional dependencies.

`ALLOWED` lists the imports that close a circle and are still to be removed, each with its reason (none in sim/
or core/); the test fails on any other circle, and on an entry whose import is gone or closes no circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sim", "core", "reference", "swebench_env")
# Folders holding code that is data to the project, not part of it: the offline suite's task repositories
# (agents edit and test them; their imports name their own packages).
NOT_MODULES = (Path("swebench_env/suite/libs"),)
# (importer, imported) -> why this import is still here. None in sim/ or core/.
ALLOWED: dict[tuple[str, str], str] = {}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages (namespace folders included)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if any(rel.is_relative_to(skip) for skip in NOT_MODULES):
                continue
            parts = rel.with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def imports(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """The project modules the file's import statements name, anywhere in it (`module` itself left out)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {name for name in found if name in modules and name != module}


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    modules = module_files()
    return {name: imports(path, name, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a path that comes back to its start) through each strongly connected group of modules."""
    found = []
    for group in _strongly_connected(graph):
        if len(group) > 1:
            start = min(group)
            found.append(_shortest_return(graph, start, group))
    return sorted(found)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (the graph may be deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                groups.append(group)
    return groups


def _shortest_return(graph: dict[str, set[str]], start: str, group: set[str]) -> list[str]:
    """The shortest path start -> ... -> start within `group` (breadth first)."""
    previous: dict[str, str] = {start: start}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & group):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in a strongly connected group but has no way back: {sorted(group)}")


def test_the_graph_reads_every_kind_of_import(tmp_path):
    """Module level, under TYPE_CHECKING, inside a function, relative, and `from package import module`."""
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "import pkg.b\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\n",
        "pkg/b.py": "def f():\n    from . import c\n",
        "pkg/c.py": "from pkg import a, VERSION\n",
        "pkg/d.py": "from .c import C\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = {n.removesuffix(".py").replace("/", ".").removesuffix(".__init__"): tmp_path / n for n in files}
    graph = {name: imports(path, name, modules) for name, path in modules.items()}
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.b", "pkg.c"},
        "pkg.b": {"pkg.c"},
        "pkg.c": {"pkg.a", "pkg"},  # VERSION is no module: a name in the package
        "pkg.d": {"pkg.c"},
    }
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.a"]]  # the shortest way round


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        for child in graph[todo.pop()] - seen:
            if child == goal:
                return True
            seen.add(child)
            todo.append(child)
    return start == goal


def test_no_import_circles():
    graph = import_graph()
    assert len(graph) > 100, sorted(graph)  # every package was read
    for (importer, imported), reason in ALLOWED.items():
        assert not {importer.split(".")[0], imported.split(".")[0]} & {"sim", "core"}, "sim/ and core/ have none"
        assert imported in graph.get(importer, ()), f"ALLOWED: {importer} no longer imports {imported} ({reason})"
        graph[importer] = graph[importer] - {imported}
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)
    for importer, imported in ALLOWED:  # each entry is still needed: its import alone closes a circle
        assert _reaches(graph, imported, importer), f"ALLOWED: {importer} -> {imported} closes no circle any more"
