"""``durable-trio``: the command line, one module per command group.

- :mod:`._main`: the parser, ``examples`` and ``health`` (:func:`main` is the entry point);
- :mod:`._engine`: ``worker``, ``engine`` and ``run``;
- :mod:`._operations`: ``runs``, ``jobs`` and ``queues``;
- :mod:`._schedules`: ``schedules``;
- :mod:`._console`: ``console``;
- :mod:`._migrate`: ``migrate`` (a PostgreSQL backend's schema);
- :mod:`._health`: what ``health`` reads and prints (once, ``--watch``, Prometheus);
- :mod:`._terminal`: stored strings made visible before they reach a terminal.

Nothing in the library imports this package: it sits on top of everything else.
"""

from __future__ import annotations

from ._main import main

__all__ = ["main"]
