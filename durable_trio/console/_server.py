"""Serving the console from Trio: hypercorn's Trio worker, bounded graceful close."""

from __future__ import annotations

import socket
from functools import partial
from typing import TYPE_CHECKING, cast

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from .._errors import ConfigError
from .._logs import get_logger
from .._ops import open_operations
from .._os_signals import close_on_signals
from ._app import create_app
from ._security import check_exposure

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from hypercorn.typing import Framework

    from .._ops import Operations

__all__ = ["GRACEFUL_TIMEOUT", "run_console", "serve_console"]

#: Seconds requests still running get to finish once the close starts; the rest are cancelled.
GRACEFUL_TIMEOUT = 2.0


def _listening_socket(host: str, port: int) -> str:
    """Bind ``host:port`` here and hand the socket to hypercorn as ``fd://N``.

    hypercorn binds by itself otherwise, and leaves the socket of a failed bind (a port in use)
    unclosed; bound here, a failed bind closes its socket and raises the plain ``OSError``
    (``[Errno 98] Address already in use``), and hypercorn owns the socket that bound.
    """
    bare = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in bare else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bare, port))
    except BaseException:
        sock.close()
        raise
    return f"fd://{sock.detach()}"


async def serve_console(
    ops: Operations,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    allow_actions: bool = False,
    token: str | None = None,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the console over ``ops`` until ``shutdown_trigger`` returns or this is cancelled.

    Args:
        ops: an open :class:`~durable_trio.Operations` (not closed here).
        host: the address to listen on; beyond loopback a ``token`` is required.
        port: the TCP port (0: a free one, told through ``task_status``).
        allow_actions: allow the actions (retry, cancel, start, signal, schedules, jobs;
            403 otherwise).
        token: the token every request must carry (see :mod:`durable_trio.console`).
        shutdown_trigger: when it returns, the close starts: no new connection, requests
            still running get :data:`GRACEFUL_TIMEOUT` seconds.
        task_status: for ``nursery.start``: started with the console's base URL
            (``http://127.0.0.1:8080``).

    Raises:
        ConfigError: beyond loopback without a token, a malformed token, or a bad port.
        OSError: the address cannot be listened on (e.g. the port is taken).
    """
    check_exposure(host, token)
    if not 0 <= port <= 65535:
        raise ConfigError(f"port must be 0..65535, not {port}")
    config = Config()
    config.bind = [_listening_socket(host, port)]
    config.graceful_timeout = GRACEFUL_TIMEOUT
    config.accesslog = None
    config.errorlog = get_logger("durable_trio.console.server")
    app = create_app(ops, allow_actions=allow_actions, token=token)

    async def started_with(*, task_status: trio.TaskStatus[list[str]]) -> None:
        async def trigger() -> None:
            if shutdown_trigger is None:
                await trio.sleep_forever()
            else:
                await shutdown_trigger()

        # hypercorn's own ASGI types are narrower than Starlette's: the same protocol.
        await serve(
            cast("Framework", app), config, shutdown_trigger=trigger, task_status=task_status
        )

    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(started_with)
        task_status.started(binds[0])


async def run_console(
    url: str,
    *,
    namespace: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8080,
    allow_actions: bool = False,
    token: str | None = None,
    announce: Callable[[str], object] = print,
) -> None:
    """``durable-trio console``: open ``url``'s operations and serve the console until SIGINT
    or SIGTERM (the first starts the graceful close, a second ends it at once).

    Args:
        url: the backend URL (``memory://``, ``sqlite:///...``, ``redis://...``); a SQLite
            file must exist already (the console makes none); without ``allow_actions``, one
            this process cannot write is opened read-only.
        namespace: the namespace to show; ``None``: the only one the backend holds (several:
            a :class:`ConfigError` naming them), or ``"durable"`` when it holds none.
        announce: called once with the console's base URL when it listens.

    Raises:
        ConfigError: as :func:`serve_console`, checked before the backend is opened.
    """
    check_exposure(host, token)
    async with open_operations(
        url,
        existing=True,
        namespace=namespace,
        discover=True,
        read_only=False if allow_actions else "if_needed",
    ) as ops:
        async with close_on_signals() as signals:
            async with trio.open_nursery() as nursery:
                base = await nursery.start(
                    partial(
                        serve_console,
                        ops,
                        host=host,
                        port=port,
                        allow_actions=allow_actions,
                        token=token,
                        shutdown_trigger=signals.wait,
                    )
                )
                announce(base)
