"""The console's ASGI app: :func:`create_app` over an :class:`~durable_trio.Operations`.

Pages are rendered on the server (``_pages``), in worker threads; the only script
(``static/console.js``) refreshes the page shown by polling its own address while the page says
it is live, and posts the actions. Actions are ``POST`` with a JSON body to ``/api/...`` and
answer JSON ``{"ok": ..., "message": ...}``. ``/raw/run`` and ``/raw/job`` answer the whole of a
value a page cuts, as JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from starlette.applications import Starlette
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .._engine import RunNotFound
from .._errors import BrokerUnavailable, DurableTrioError
from .._logs import get_logger
from . import _pages
from ._pages import BadRequest, Reply
from ._security import ACTION_HEADER, ACTION_HEADER_VALUE, TokenGuard, same_origin

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from starlette.requests import Request
    from starlette.types import ASGIApp

    from .._ops import Operations

__all__ = ["STATIC", "create_app"]

logger = get_logger("durable_trio.console")

#: The console's static files, shipped in the package.
STATIC = Path(__file__).resolve().parent / "static"

#: Headers on every page: no caching of live data, no framing, no sniffing, only our own
#: scripts and styles.
_PAGE_HEADERS = {
    "cache-control": "no-store",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self';"
        " connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
}


def _html(markup: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(markup, status_code=status, headers=_PAGE_HEADERS)


def _reply(ok: bool, message: str, status: int, location: str | None = None) -> JSONResponse:
    content = {"ok": ok, "message": message, **({"location": location} if location else {})}
    return JSONResponse(content, status_code=status, headers=_PAGE_HEADERS)


def create_app(
    ops: Operations, *, allow_actions: bool = False, token: str | None = None
) -> ASGIApp:
    """The console as an ASGI app, reading and acting through ``ops``.

    Args:
        ops: an open :class:`~durable_trio.Operations` (``dt.open_operations(url)``); the app
            does not close it.
        allow_actions: whether the actions are allowed (retry, cancel, start a run, send a
            signal, cancel or retry every run the filters match, pause, resume or delete a
            schedule, requeue or delete a set-aside job);
            without it every action answers 403 (the console is read-only).
        token: when given, every request must carry it (``Authorization: Bearer``, or the cookie
            set by opening a page once as ``?token=``); see :mod:`durable_trio.console`.

    Returns:
        an ASGI app (serve it with :func:`~durable_trio.console.serve_console`, or any ASGI
        server that runs on Trio).
    """
    view = _pages.Pages(ops, allow_actions=allow_actions)

    def page(
        render: Callable[[Request], Awaitable[str]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                return _html(await render(request))
            except RunNotFound as exc:
                return _html(view.error_page("Not found", str(exc)), 404)
            except (BadRequest, ValueError) as exc:
                return _html(view.error_page("Bad request", str(exc)), 400)
            except DurableTrioError as exc:
                logger.warning("console page %s failed: %r", request.url.path, exc)
                return _html(view.error_page("The backend did not answer", str(exc)), 503)

        return endpoint

    def raw(
        read: Callable[[Request], Awaitable[bytes]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                content = await read(request)
            except BadRequest as exc:
                return _reply(False, str(exc), 400)
            except RunNotFound as exc:
                return _reply(False, str(exc), 404)
            except DurableTrioError as exc:
                logger.warning("console raw value %s failed: %r", request.url.path, exc)
                return _reply(False, str(exc), 503)
            return Response(content, media_type="application/json", headers=_PAGE_HEADERS)

        return endpoint

    def action(
        name: str, run: Callable[[dict[str, str]], Awaitable[Reply]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            if not allow_actions:
                return _reply(False, "actions are off: start the console with --allow-actions", 403)
            if request.headers.get(ACTION_HEADER) != ACTION_HEADER_VALUE:
                return _reply(False, f"an action needs the {ACTION_HEADER} header", 403)
            origin = request.headers.get("origin")
            if origin is not None and not same_origin(origin, request.headers.get("host", "")):
                return _reply(False, "an action from another origin is refused", 403)
            try:
                body = _body(await request.body())
                reply = await run(body)
            except BadRequest as exc:
                return _reply(False, str(exc), 400)
            except RunNotFound as exc:
                return _reply(False, str(exc), 404)
            except BrokerUnavailable as exc:
                # The backend down or not answering: nothing was refused, try again later (as
                # the pages' 503; a 409 said "conflict", which a script does not retry).
                logger.warning("console action %s failed: %r", name, exc)
                return _reply(False, str(exc), 503)
            except (DurableTrioError, ValueError) as exc:
                return _reply(False, str(exc), 409)
            message, location = (reply, None) if isinstance(reply, str) else reply
            # a start's input may be megabytes: the log line keeps the first 200 of each field
            brief = {key: value[:200] for key, value in body.items()}
            logger.info("console action %s %s: %r", name, brief, message)
            return _reply(True, message, 200, location)

        return endpoint

    async def home(request: Request) -> Response:
        return RedirectResponse("/runs", status_code=303)

    routes = [
        Route("/", home),
        Route("/runs", page(view.runs_page)),
        Route("/runs/{run_id:path}", page(view.run_page)),
        Route("/schedules", page(view.schedules_page)),
        Route("/workers", page(view.workers_page)),
        Route("/queues", page(view.queues_page)),
        Route("/raw/run", raw(view.raw_run)),
        Route("/raw/job", raw(view.raw_job)),
        Route("/api/runs/retry", action("retry", view.retry), methods=["POST"]),
        Route("/api/runs/cancel", action("cancel", view.cancel), methods=["POST"]),
        Route("/api/runs/start", action("start", view.start), methods=["POST"]),
        Route("/api/runs/signal", action("signal", view.signal), methods=["POST"]),
        Route("/api/runs/bulk", action("bulk", view.bulk), methods=["POST"]),
        Route("/api/schedules/pause", action("pause", view.pause_schedule), methods=["POST"]),
        Route("/api/schedules/resume", action("resume", view.resume_schedule), methods=["POST"]),
        Route("/api/schedules/delete", action("delete", view.delete_schedule), methods=["POST"]),
        Route("/api/jobs/requeue", action("requeue", view.requeue), methods=["POST"]),
        Route("/api/jobs/delete", action("delete", view.delete), methods=["POST"]),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
    async def not_found(request: Request, exc: Exception) -> Response:
        # A mistyped address gets the console's own page (or, under /api, its JSON reply),
        # not Starlette's bare "Not Found".
        path = request.url.path
        if path.startswith("/api/"):
            return _reply(False, f"no such action: {path}", 404)
        message = f"the console has no page at {path} (its pages: runs, schedules, workers, queues)"
        return _html(view.error_page("Not found", message), 404)

    app = Starlette(routes=routes, exception_handlers={404: not_found})
    return TokenGuard(app, token=token)


def _body(raw: bytes) -> dict[str, str]:
    """An action's JSON body: an object of string fields."""
    try:
        data: Any = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in data.items()
    ):
        raise BadRequest("the body must be a JSON object of strings")
    return data
