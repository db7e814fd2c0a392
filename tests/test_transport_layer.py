"""The transport is a layer: ``durable_trio/_transport/`` imports nothing above it.

Every module of the package is parsed with :mod:`ast`; every import counts, at any level (inside
functions, under ``if TYPE_CHECKING:``). What it may import: its own modules, the broker
contract (``durable_trio.brokers``, whose ``__init__`` is the contract alone) and the root
foundation modules below. Not the backends (which import the engine's run stores), the engine,
the CLI, ops, the console, the key stores' package (the transport states what it needs of a key
store in ``_transport/_ports``) — nor another module's underscore names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import durable_trio

ROOT = Path(durable_trio.__file__).parent
TRANSPORT = ROOT / "_transport"

#: The modules below the transport that it may import (beside its own).
BELOW = {
    "durable_trio.brokers",
    "durable_trio.brokers._contract",
    "durable_trio._arguments",
    "durable_trio._attrs_shared",
    "durable_trio._backoff",
    "durable_trio._coalesce",
    "durable_trio._codec",
    "durable_trio._errors",
    "durable_trio._failures",
    "durable_trio._json_values",
    "durable_trio._logs",
    "durable_trio._naming",
    "durable_trio._outages",
    "durable_trio._periodic",
    "durable_trio._telemetry",
    "durable_trio._wire",
}


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """``(module imported, names taken from it, line)`` for every import of ``path``."""
    here = "durable_trio._transport"
    found: list[tuple[str, list[str], int]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            found.append((origin, [alias.name for alias in node.names], node.lineno))
    return found


def test_transport_imports_nothing_above_it() -> None:
    above = []
    for path in sorted(TRANSPORT.glob("*.py")):
        for origin, _, line in _imports(path):
            if not origin.startswith("durable_trio"):
                continue
            if origin.startswith("durable_trio._transport") or origin in BELOW:
                continue
            above.append(f"{path.name}:{line}: {origin}")
    assert above == []


def test_transport_reads_no_underscore_name_of_another_module() -> None:
    private = []
    for path in sorted(TRANSPORT.glob("*.py")):
        for origin, names, line in _imports(path):
            if not origin.startswith("durable_trio"):
                continue
            taken = [name for name in names if name.startswith("_") and name != "__future__"]
            if taken:
                private.append(f"{path.name}:{line}: {origin} {taken}")
    assert private == []


def test_the_rule_catches_an_upward_import(tmp_path: Path) -> None:
    """The walker sees imports under TYPE_CHECKING and inside functions (so the rule above is
    not vacuous)."""
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from ..backends._backend import Backend\n"
        "def f():\n"
        "    from .._engine import Engine\n"
        "    from ._claims import _Claim\n",
        encoding="utf-8",
    )
    origins = [(origin, names) for origin, names, _ in _imports(module)]
    assert ("durable_trio.backends._backend", ["Backend"]) in origins
    assert ("durable_trio._engine", ["Engine"]) in origins
    assert ("durable_trio._transport._claims", ["_Claim"]) in origins
