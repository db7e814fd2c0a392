"""The package's structure rules (docs/architecture.md): imports go down the layers, the
transport imports nothing above it, no module imports another package's underscore names, no
file is over 1,000 lines, no class stacks two or more of the project's implementation bases.

Each rule has a KNOWN set of today's offenders, each being removed on its own branch. A test
fails on a new offender, and on a KNOWN entry that is no longer one (so the sets only shrink,
as ``KNOWN_CYCLES`` in test_import_graph.py does). The import graph is the one of
test_import_graph.py: every import counts, lazy and type-only ones included.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from pathlib import Path

from test_import_graph import PACKAGE, ROOT, import_graph, module_name

# ---------------------------------------------------------------------------------- layers

#: The layers, lowest first; a module may import its own layer and those below (see
#: docs/architecture.md). A module is in the layer of the longest prefix listed that names it;
#: a root module not listed is a foundation module (errors, the wire format, codecs, backoff,
#: telemetry hooks: things every layer uses).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("",),  # foundation: the root modules
    ("_redis", "_postgres", "redis"),  # the servers' clients (``redis``: the public face)
    ("brokers", "keys"),  # the broker and key-store contracts and implementations
    ("_transport",),  # the queue transport
    # run records and run stores (``_generations``: continue-as-new's records)
    ("_engine._records", "_engine._tags", "_engine._generations", "_engine._stores"),
    ("backends",),  # a broker, a key store and run stores, chosen by URL
    ("_engine",),  # the engine
    # the operations the CLI and the console share
    ("_ops", "_ops_attempts", "_ops_bulk", "_ops_generations", "_ops_views"),
    # entry points (``postgres``: the application's own transaction, on the stores' SQL)
    ("cli", "console", "testing", "_supervisor", "__main__", "postgres", "<package>"),
)

#: Imports that go up a layer today, as (importer, imported): none left (the transport sees
#: what it is opened over through ports of its own, ``_engine._stores.open_run_store`` takes a
#: ``RunStoreOpener`` of the stores' own).
KNOWN_UPWARD: frozenset[tuple[str, str]] = frozenset()

#: What the transport must never import (the issue's "nothing above it").
ABOVE_THE_TRANSPORT = (
    "backends", "_engine", "cli", "_ops", "_ops_attempts", "_ops_bulk", "_ops_generations",
    "_ops_views", "console",
    "testing",
)  # fmt: skip


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module`` (a dotted name under the package)."""
    if module == PACKAGE:
        return next(i for i, names in enumerate(LAYERS) if "<package>" in names)
    relative = module.removeprefix(f"{PACKAGE}.")
    best, best_length = 0, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            named = prefix and (relative == prefix or relative.startswith(f"{prefix}."))
            if named and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    return best


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if layer_of(target) > layer_of(module)
    }


def test_every_module_has_its_layer() -> None:
    assert layer_of(f"{PACKAGE}._errors") == 0
    assert layer_of(f"{PACKAGE}._redis._client") == 1
    assert layer_of(f"{PACKAGE}.keys.memory") == 2
    assert layer_of(f"{PACKAGE}._transport._tree") == 3
    assert layer_of(f"{PACKAGE}._engine._records") == 4
    assert layer_of(f"{PACKAGE}._engine._stores.sqlite") == 4
    assert layer_of(f"{PACKAGE}.backends") == 5
    assert layer_of(f"{PACKAGE}._engine._engine") == 6
    assert layer_of(f"{PACKAGE}._ops_attempts") == 7
    assert layer_of(f"{PACKAGE}.cli._main") == layer_of(PACKAGE) == len(LAYERS) - 1
    # every layer but the foundation names something that exists
    modules = set(import_graph())
    for prefixes in LAYERS[1:]:
        for prefix in prefixes:
            if prefix != "<package>":
                assert any(
                    m == f"{PACKAGE}.{prefix}" or m.startswith(f"{PACKAGE}.{prefix}.")
                    for m in modules
                ), prefix


def test_imports_go_down_the_layers_but_the_known_ones() -> None:
    found = upward_imports(import_graph())
    assert sorted(found - KNOWN_UPWARD) == [], "an import goes up a layer"
    assert sorted(KNOWN_UPWARD - found) == [], "a known upward import is gone: remove it"


def test_the_transport_imports_nothing_above_it_but_the_known_ones() -> None:
    graph = import_graph()
    above = tuple(f"{PACKAGE}.{name}" for name in ABOVE_THE_TRANSPORT)
    found = {
        (module, target)
        for module, targets in graph.items()
        if module.startswith(f"{PACKAGE}._transport")
        for target in targets
        if target in above or target.startswith(tuple(f"{name}." for name in above))
    }
    known = {edge for edge in KNOWN_UPWARD if edge[0].startswith(f"{PACKAGE}._transport")}
    assert sorted(found - known) == [], "the transport imports a module above it"
    assert sorted(known - found) == [], "a known upward import is gone: remove it"


def test_the_root_modules_import_no_engine() -> None:
    """The foundation (``_telemetry``, ``_otel``, ...) sees run records through protocols of
    its own, never ``_engine``."""
    graph = import_graph()
    for module, targets in graph.items():
        if layer_of(module) == 0:
            assert not [t for t in targets if t.startswith(f"{PACKAGE}._engine")], module


# ------------------------------------------------------------------- underscore names

#: ``(importer, "origin.name")`` pairs where a module takes another package's private name.
KNOWN_PRIVATE_IMPORTS: frozenset[tuple[str, str]] = frozenset()


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def private_imports(paths: dict[str, Path]) -> set[tuple[str, str]]:
    """Every ``from x import _name`` (and ``x._name`` through an imported module ``x``) where
    ``_name`` is not a module and ``x`` is in another package than the importer."""
    modules = set(paths)
    found: set[tuple[str, str]] = set()
    for module, path in paths.items():
        here = _package_of(module, path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported_modules: dict[str, str] = {}  # local name -> module
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in modules:
                        imported_modules[alias.asname] = alias.name
                continue
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            if origin not in modules:
                continue
            for alias in node.names:
                full = f"{origin}.{alias.name}"
                if full in modules:
                    imported_modules[alias.asname or alias.name] = full
                elif _private(alias.name) and _package_of(origin, paths[origin]) != here:
                    found.add((module, full))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in imported_modules
                and _private(node.attr)
            ):
                origin = imported_modules[node.value.id]
                if _package_of(origin, paths[origin]) != here:
                    found.add((module, f"{origin}.{node.attr}"))
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package_paths() -> dict[str, Path]:
    return {module_name(path): path for path in ROOT.rglob("*.py")}


def test_a_private_import_across_packages_is_found(tmp_path: Path) -> None:
    (tmp_path / "p" / "a").mkdir(parents=True)
    (tmp_path / "p" / "b").mkdir()
    files = {
        "p/__init__.py": "",
        "p/a/__init__.py": "",
        "p/a/_x.py": "_Hidden = 1\nShown = 2\n",
        "p/a/_y.py": "from ._x import _Hidden\n",  # same package: allowed
        "p/b/__init__.py": "",
        "p/b/_z.py": (
            "from ..a._x import _Hidden, Shown\nfrom ..a import _x\nfrom ..a import _x as m\n"
            "print(_x._Hidden, m._Hidden, m.__name__)\n"
        ),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    paths = {
        ".".join(Path(name).with_suffix("").parts).removesuffix(".__init__"): tmp_path / name
        for name in files
    }
    assert private_imports(paths) == {("p.b._z", "p.a._x._Hidden")}


def test_no_module_imports_another_packages_underscore_names() -> None:
    found = private_imports(_package_paths())
    assert sorted(found - KNOWN_PRIVATE_IMPORTS) == [], "a private name crosses packages"
    assert sorted(KNOWN_PRIVATE_IMPORTS - found) == [], "a known one is gone: remove it"


# ------------------------------------------------------------------------------ file size

MAX_FILE_LINES = 1000

#: Files over the limit today, each being split into a package of parts on its own branch.
KNOWN_LONG_FILES: frozenset[str] = frozenset()


def long_files() -> set[str]:
    return {
        path.relative_to(ROOT).as_posix()
        for path in ROOT.rglob("*.py")
        if len(path.read_text(encoding="utf-8").splitlines()) > MAX_FILE_LINES
    }


def test_no_file_is_over_the_limit_but_the_known_ones() -> None:
    found = long_files()
    assert sorted(found - KNOWN_LONG_FILES) == [], f"over {MAX_FILE_LINES} lines: split it"
    assert sorted(KNOWN_LONG_FILES - found) == [], "under the limit now: remove it"


# ------------------------------------------------------------------------- class bases

#: Classes built on two or more implementation bases of the project (the Redis broker's
#: stacked bases; the s-redis branch makes the doorbell and the repair parts it owns).
KNOWN_STACKED: frozenset[str] = frozenset()


def _implementation_base(base: type) -> bool:
    """A base of the project that carries code: not a protocol, not an exception."""
    return (
        base.__module__.startswith(f"{PACKAGE}.")
        and not getattr(base, "_is_protocol", False)
        and not issubclass(base, BaseException)
    )


def stacked_classes() -> set[str]:
    found: set[str] = set()
    seen: set[type] = set()
    for name in sorted(import_graph()):
        if name.endswith("__main__"):  # runs the CLI
            continue
        module = importlib.import_module(name)
        classes = [c for c in vars(module).values() if inspect.isclass(c)]
        while classes:
            cls = classes.pop()
            if cls.__module__ != name or cls in seen:
                continue
            seen.add(cls)
            classes.extend(c for c in vars(cls).values() if inspect.isclass(c))
            if sum(_implementation_base(base) for base in cls.__bases__) >= 2:
                found.add(f"{name.removeprefix(f'{PACKAGE}.')}.{cls.__qualname__}")
    return found


def test_the_bases_test_tells_implementation_from_protocols_and_errors() -> None:
    from durable_trio import _errors
    from durable_trio.brokers import QueueBroker
    from durable_trio.brokers.memory import MemoryBroker

    assert _implementation_base(MemoryBroker)
    assert not _implementation_base(QueueBroker)
    assert not _implementation_base(_errors.BrokerUnavailable)
    assert not _implementation_base(dict)
    assert sys.modules[MemoryBroker.__module__] is not None


def test_no_class_stacks_implementation_bases_but_the_known_ones() -> None:
    found = stacked_classes()
    assert sorted(found - KNOWN_STACKED) == [], "a class stacks implementation bases"
    assert sorted(KNOWN_STACKED - found) == [], "no longer stacked: remove it"


# ----------------------------------------------------------------------------- backoffs

#: Files whose retry loops still compute their own exponential backoff (``2 ** failures``)
#: instead of taking it from ``durable_trio._backoff.Backoff``; each is converted on the
#: branch of its area.
KNOWN_OWN_BACKOFF: frozenset[str] = frozenset()


def own_backoffs() -> set[str]:
    """The files (but ``_backoff.py``) holding a power of two to a computed exponent."""
    found = set()
    for path in ROOT.rglob("*.py"):
        name = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.BinOp)
                and isinstance(node.op, ast.Pow)
                and isinstance(node.left, ast.Constant)
                and node.left.value in (2, 2.0)
                and not isinstance(node.right, ast.Constant)
                and name != "_backoff.py"
            ):
                found.add(name)
    return found


def test_every_retry_loop_takes_its_delays_from_the_backoff_helper() -> None:
    found = own_backoffs()
    assert sorted(found - KNOWN_OWN_BACKOFF) == [], "use durable_trio._backoff.Backoff"
    assert sorted(KNOWN_OWN_BACKOFF - found) == [], "converted now: remove it"
