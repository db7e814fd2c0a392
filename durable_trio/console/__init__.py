"""The web console (``durable-trio console``): runs, one run's history, workers and queues,
served from Trio (hypercorn's Trio worker, a Starlette app) over
:class:`~durable_trio.Operations`. Needs the ``console`` extra (``durable_trio[console]``).

Read-only by default; see ``docs/console.md`` for the pages and the security model.
"""

from __future__ import annotations

from ._app import create_app
from ._security import check_exposure
from ._server import GRACEFUL_TIMEOUT, run_console, serve_console

__all__ = ["GRACEFUL_TIMEOUT", "check_exposure", "create_app", "run_console", "serve_console"]
