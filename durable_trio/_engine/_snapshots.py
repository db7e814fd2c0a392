"""The values only an operator's call builds, by name, each imported on its first use (PEP 562):
:class:`EngineStatistics` and :class:`WorkerStatistics` (``statistics()``), and
:class:`DuplicateResult` (a duplicate recorded, ``Engine.duplicates``).

The engine and the worker name them through this module (``snapshots.EngineStatistics``) rather
than importing them, so that their annotations still resolve at run time
(``typing.get_type_hints``, ``tests/test_engine.py``) while a process that never asks for one
never builds their classes (attrs building them was ~10 M instructions of an app's imports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_getattr

if TYPE_CHECKING:
    from ._duplicate_result import DuplicateResult
    from ._statistics import EngineStatistics, WorkerStatistics

__all__ = ["DuplicateResult", "EngineStatistics", "WorkerStatistics"]

#: Each name -> its module.
_MODULES: dict[str, str] = {
    "DuplicateResult": "._duplicate_result",
    "EngineStatistics": "._statistics",
    "WorkerStatistics": "._statistics",
}


# Hidden from type checkers, as the package's own lazy exports.
if not TYPE_CHECKING:
    __getattr__ = lazy_getattr(globals(), _MODULES)
