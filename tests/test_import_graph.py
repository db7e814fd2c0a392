"""The package's import graph has no cycles (beyond the known ones, each to be removed).

Every module under ``durable_trio/`` is parsed with :mod:`ast`; every import counts, at
any level: inside functions (a lazy import is still a dependency) and under
``if TYPE_CHECKING:`` (a type-only cycle is still two modules that each need the other).
A package's ``__init__`` is a node of its own, named after the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import durable_trio

ROOT = Path(durable_trio.__file__).parent
PACKAGE = "durable_trio"

#: Cycles still allowed. Each entry is the set of modules of one strongly connected
#: component; the test fails on any other cycle, and on an entry here that is gone (so the
#: list only shrinks). Empty: the package has none.
KNOWN_CYCLES: list[frozenset[str]] = []


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package modules ``path`` (module ``name``) imports, anywhere in it."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            # ``from pkg import name``: the submodule pkg.name if there is one, else pkg.
            targets = [
                f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            # ``import a.b.c`` depends on the deepest of a.b.c, a.b, a that is a module here.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in ROOT.rglob("*.py")}
    modules = set(paths)
    return {name: imports_of(path, name, modules) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def test_the_graph_sees_lazy_type_only_and_relative_imports() -> None:
    graph = import_graph()
    # a relative import of a package's __init__, at module level
    assert f"{PACKAGE}.backends" in graph[PACKAGE]
    # a lazy import inside a function (hiredis is optional)
    assert f"{PACKAGE}.backends.redis" in graph[f"{PACKAGE}.backends"]
    # an import under `if TYPE_CHECKING:`, three levels up
    assert f"{PACKAGE}.brokers.sqlite" in graph[f"{PACKAGE}._engine._stores.sqlite"]


def test_a_cycle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]


def test_no_import_cycles_but_the_known_ones() -> None:
    found = cycles(import_graph())
    new = [sorted(cycle) for cycle in found if cycle not in KNOWN_CYCLES]
    gone = [sorted(cycle) for cycle in KNOWN_CYCLES if cycle not in found]
    assert new == [], "new import cycle(s)"
    assert gone == [], "a known cycle is gone: remove it from KNOWN_CYCLES"


def test_the_backends_are_in_no_cycle() -> None:
    for cycle in cycles(import_graph()):
        assert not any(
            module.startswith((f"{PACKAGE}.backends", f"{PACKAGE}._engine._stores"))
            for module in cycle
        ), sorted(cycle)


#: The engine's pieces that must not depend on the facade: they get what they need through
#: `_services.DriverServices` (or `EngineServices`), never from `Engine` itself.
ENGINE_PIECES = ("_control", "_remote_run", "_results", "_runtime", "_services", "_timers")


def test_the_engine_pieces_do_not_import_the_engine_facade() -> None:
    graph = import_graph()
    facade = f"{PACKAGE}._engine._engine"
    for piece in ENGINE_PIECES:
        assert facade not in graph[f"{PACKAGE}._engine.{piece}"], piece


def test_no_module_reaches_into_the_engine_private_members() -> None:
    """No ``engine._x`` / ``self.engine._x`` outside the module that defines ``Engine``."""
    found = []
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "_engine" / "_engine.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
                continue
            if node.attr.startswith("__"):
                continue
            owner = node.value
            named = (isinstance(owner, ast.Name) and owner.id == "engine") or (
                isinstance(owner, ast.Attribute) and owner.attr in ("engine", "_engine")
            )
            if named:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_only_the_otel_module_imports_opentelemetry_and_importing_the_package_loads_none() -> None:
    """The ``otel`` extra is optional: only ``durable_trio._otel`` (loaded by
    ``dt.instrument()``) imports OpenTelemetry, and ``import durable_trio`` loads none of it."""
    import subprocess
    import sys

    importers = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            if any(name.split(".")[0] == "opentelemetry" for name in names):
                importers.add(module_name(path))
    assert importers == {"durable_trio._otel"}
    probe = (
        "import sys, durable_trio, durable_trio.testing\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert loaded.stdout.strip() == "[]"
