"""Lazy names (PEP 562): a module's names imported from the modules that define them on their
first use, so a process that never touches one never imports its module.

A module with such names sets ``__getattr__ = lazy_getattr(globals(), {name: module})`` under
``if not TYPE_CHECKING:`` (with a module ``__getattr__`` in sight, mypy would accept any name,
a typo included, as an attribute of the module) and imports the same names under
``if TYPE_CHECKING:`` for type checkers. The package's root (``durable_trio/__init__.py``)
keeps its own copy: ``import durable_trio`` loads no module of the package, this one included
(``tests/test_lazy_exports.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

__all__ = ["lazy_getattr"]


def lazy_getattr(namespace: dict[str, Any], modules: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of the module whose globals are ``namespace``: each name of
    ``modules`` (name -> its module, relative to the module's package: ``"._cluster"``)
    imported on its first look-up and kept in ``namespace`` (the next look-up is a plain
    global); any other name raises ``AttributeError``."""
    module_name = namespace["__name__"]
    package = namespace["__package__"]

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    return __getattr__
