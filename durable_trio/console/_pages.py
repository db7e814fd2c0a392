"""What each page and action of the console does with :class:`~durable_trio.Operations`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .._engine import RunNotFound
from .._errors import ConfigError, DurableTrioError
from .._supervisor import crash_loop_lines
from ._fleet_view import render_queues, render_workers
from ._html import Html, esc, page
from ._run_view import render_run
from ._runs_view import RunFilters, render_runs

if TYPE_CHECKING:
    from starlette.requests import Request

    from .._ops import FailedJobView, Operations

__all__ = ["BadRequest", "Pages"]


class BadRequest(DurableTrioError, ValueError):
    """A request the console cannot act on (a bad filter, a bad action body): a 400."""


def _field(body: dict[str, str], name: str) -> str:
    value = body.get(name, "")
    if not value:
        raise BadRequest(f"the body needs a non-empty {name!r}")
    return value


class Pages:
    """The console's pages (HTML) and actions (a message), over one ``Operations``."""

    def __init__(self, ops: Operations, *, allow_actions: bool) -> None:
        self._ops = ops
        self._allow_actions = allow_actions

    @property
    def namespace(self) -> str:
        """The namespace shown in the header."""
        return self._ops.namespace or "durable"

    def _page(self, title: str, section: str, body: Html, *, live: bool = True) -> str:
        return page(
            title=title,
            section=section,
            body=body,
            namespace=self.namespace,
            allow_actions=self._allow_actions,
            live=live,
        )

    def error_page(self, title: str, message: str) -> str:
        """A page that says what went wrong (not refreshed)."""
        body = Html(
            f'<h1>{esc(title)}</h1><p class="error-text">{esc(message)}</p>'
            '<p><a href="/runs">« runs</a></p>'
        )
        return self._page(title, "", body, live=False)

    # -- pages ------------------------------------------------------------------------------

    async def runs_page(self, request: Request) -> str:
        """``/runs``: newest first, filtered, paged by cursor; ``?q=ID`` finds one run."""
        filters = RunFilters(dict(request.query_params))
        if filters.search:
            try:
                found = [(await self._ops.show_run(filters.search)).run]
            except RunNotFound:
                found = []
            return self._page("Runs", "runs", render_runs(filters, found, None, searched=True))
        try:
            listing = await self._ops.list_runs(
                status=filters.status,
                workflow=filters.workflow,
                limit=filters.limit,
                cursor=filters.cursor,
            )
        except ConfigError as exc:  # a bad cursor, most likely
            raise ValueError(str(exc)) from None
        body = render_runs(filters, listing.runs, listing.next_cursor)
        return self._page("Runs", "runs", body)

    async def run_page(self, request: Request) -> str:
        """``/runs/{run_id}``: the run and its history."""
        run_id = request.path_params["run_id"]
        details = await self._ops.show_run(run_id)
        body = render_run(details, allow_actions=self._allow_actions)
        return self._page(f"Run {run_id}", "runs", body)

    async def workers_page(self, request: Request) -> str:
        """``/workers``: the live workers of every group."""
        workers = await self._ops.workers()
        queues = await self._ops.queues()
        looping = crash_loop_lines(await self._ops.supervisors())
        body = render_workers(workers, queues, time.time(), looping)
        return self._page("Workers", "workers", body)

    async def queues_page(self, request: Request) -> str:
        """``/queues``: every queue's depths and the set-aside jobs."""
        queues = await self._ops.queues()
        failed: list[FailedJobView] | None
        try:
            failed = await self._ops.failed_jobs()
        except ConfigError:  # the broker keeps no failed jobs
            failed = None
        body = render_queues(queues, failed, allow_actions=self._allow_actions)
        return self._page("Queues", "queues", body)

    # -- actions ----------------------------------------------------------------------------

    async def retry(self, body: dict[str, str]) -> str:
        """Retry a failed run (a live engine resumes it from its failed step)."""
        run_id = _field(body, "run_id")
        await self._ops.retry_run(run_id)
        return f"run {run_id} reopened: a live engine resumes it from its failed step"

    async def cancel(self, body: dict[str, str]) -> str:
        """Cancel a run that has not ended. A run an engine drives gets the cancel mark and
        the request returns at once (no wait of up to ``cancel_grace`` in a browser): that
        engine raises ``RunCancelled`` inside the workflow, which compensates and ends."""
        run_id = _field(body, "run_id")
        if await self._ops.cancel_run(run_id, reason="cancelled from the console", wait=False):
            run = await self._ops.store.get_run(run_id)
            if run is not None and not run.status.terminal:
                return (
                    f"run {run_id}: cancel sent to the engine driving it (RunCancelled is "
                    "raised inside the workflow, which may compensate, then it ends cancelled)"
                )
            return f"run {run_id} cancelled"
        return f"run {run_id} had already ended or is being cancelled: nothing to do"

    async def requeue(self, body: dict[str, str]) -> str:
        """Put a set-aside job back on its queue."""
        queue, job_id = _field(body, "queue"), _field(body, "job_id")
        if await self._ops.requeue_job(queue, job_id):
            return f"job {job_id} requeued on {queue}"
        raise RunNotFound(f"no set-aside job {job_id!r} on {queue!r}")

    async def delete(self, body: dict[str, str]) -> str:
        """Drop a set-aside job for good."""
        queue, job_id = _field(body, "queue"), _field(body, "job_id")
        if await self._ops.delete_job(queue, job_id):
            return f"job {job_id} deleted from {queue}"
        raise RunNotFound(f"no set-aside job {job_id!r} on {queue!r}")
