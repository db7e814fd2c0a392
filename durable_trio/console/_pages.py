"""What each page and action of the console does with :class:`~durable_trio.Operations`."""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING, Any, Final, TypeVar

import orjson
import trio

from .._engine import RunNotFound
from .._engine._advert import known_workflows
from .._engine._debounce import Debounce
from .._engine._schedules import Schedules
from .._engine._tags import parse_tag
from .._errors import ConfigError, DurableTrioError, PayloadError
from .._transport._health import read_store_loss
from .._transport._supervised import crash_loop_lines
from ._fleet_view import RunOwner, render_engines, render_queues, render_workers
from ._html import Html, esc, page, path_part
from ._run_view import render_run
from ._runs_view import BULK_LIMIT, RunFilters, render_runs
from ._schedules_view import render_schedules

if TYPE_CHECKING:
    from collections.abc import Callable

    from starlette.requests import Request

    from .._ops import FailedJobView, Operations

__all__ = ["OWNERS_READ", "RENDER_THREADS", "BadRequest", "Conflict", "Pages", "Reply"]

_T = TypeVar("_T")

#: Pages rendered at once, each in a worker thread: building a page (escaping, JSON of the
#: values shown) never holds the event loop, so a heavy page does not stall other requests,
#: and a burst of heavy pages takes at most this many threads.
RENDER_THREADS = 2

#: Running runs the workers page reads at most to list the engines that own them.
OWNERS_READ = 2000

#: The values of a run the raw endpoint serves alone (``/raw/run?id=...&value=...``).
_RUN_VALUES = ("input", "output", "error")


class BadRequest(DurableTrioError, ValueError):
    """A request the console cannot act on (a bad filter, a bad action body): a 400."""


class Conflict(DurableTrioError):
    """An action the state of things refuses (a run id taken): a 409."""


#: What an action answers: a message, or a message and the address of what it made.
Reply = str | tuple[str, str]


def start_options(body: dict[str, str]) -> tuple[str | None, Debounce | None, dict[str, str]]:
    """The start form's ``dedup_key``, ``debounce_key`` (with ``debounce_delay`` and
    ``debounce_max_wait``, seconds) and ``tags`` (``KEY=VALUE``, space or comma separated).

    Raises:
        BadRequest: a bad delay or tag, a debounce key without a delay.
    """
    dedup_key = body.get("dedup_key", "").strip() or None
    debounce: Debounce | None = None
    key = body.get("debounce_key", "").strip()
    try:
        if key:
            delay = float(body.get("debounce_delay", "").strip() or "nan")
            wait = body.get("debounce_max_wait", "").strip()
            debounce = Debounce(key=key, delay=delay, max_wait=float(wait) if wait else None)
        tags = dict(
            parse_tag(part, "tags") for part in body.get("tags", "").replace(",", " ").split()
        )
    except (ConfigError, ValueError) as exc:
        raise BadRequest(str(exc)) from None
    return dedup_key, debounce, tags


#: The fields of a start (its form's, and the API's).
_START_FIELDS: Final = frozenset(
    (
        "workflow", "input", "run_id", "dedup_key", "debounce_key", "debounce_delay",
        "debounce_max_wait", "tags",
    )
)  # fmt: skip


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
        self._limiter: trio.CapacityLimiter | None = None

    async def _off_loop(self, build: Callable[[], _T]) -> _T:
        """``build()`` in a worker thread (at most :data:`RENDER_THREADS` at once)."""
        if self._limiter is None:  # made inside the server's trio.run, on first use
            self._limiter = trio.CapacityLimiter(RENDER_THREADS)
        return await trio.to_thread.run_sync(build, limiter=self._limiter)

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

    async def _alarm(self, body: Html) -> Html:
        """``body`` after the store's loss alarm, if one stands (it stays until acknowledged)."""
        loss = await read_store_loss(self._ops.backend)
        if loss is None:
            return body
        return Html(f'<p class="error-text" role="alert"><strong>{esc(loss)}</strong></p>{body}')

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
            return await self._off_loop(
                lambda: self._page(
                    "Runs",
                    "runs",
                    render_runs(
                        filters, found, None, searched=True, allow_actions=self._allow_actions
                    ),
                )
            )
        try:
            listing = await self._ops.list_runs(
                status=filters.status,
                workflow=filters.workflow,
                limit=filters.limit,
                cursor=filters.cursor,
                tags=filters.tags,
            )
        except ConfigError as exc:  # a bad cursor, most likely
            raise ValueError(str(exc)) from None
        matching = await self._count_matching(filters)
        alarm = await self._alarm(Html(""))
        return await self._off_loop(
            lambda: self._page(
                "Runs",
                "runs",
                Html(
                    alarm
                    + render_runs(
                        filters,
                        listing.runs,
                        listing.next_cursor,
                        damaged=listing.damaged,
                        allow_actions=self._allow_actions,
                        matching=matching,
                    )
                ),
            )
        )

    async def run_page(self, request: Request) -> str:
        """``/runs/{run_id}``: the run and its history. Refreshed while the run has not ended
        (an ended run's page does not change until an action, which refreshes it)."""
        run_id = request.path_params["run_id"]
        details = await self._ops.show_run(run_id)
        live = not details.run.status.terminal
        return await self._off_loop(
            lambda: self._page(
                f"Run {run_id}",
                "runs",
                render_run(details, allow_actions=self._allow_actions),
                live=live,
            )
        )

    async def workers_page(self, request: Request) -> str:
        """``/workers``: the live workers of every group, then the engines the run store knows
        (the owners of running runs)."""
        workers = await self._ops.workers()
        queues = await self._ops.queues()
        now = time.time()
        alarm = await self._alarm(Html(""))
        owners, pending, truncated = await self._run_owners()
        looping = crash_loop_lines(await self._ops.supervisors())
        store_now = self._ops.store.now()
        return await self._off_loop(
            lambda: self._page(
                "Workers",
                "workers",
                Html(
                    alarm
                    + render_workers(workers, queues, now, looping)
                    + render_engines(owners, store_now, pending=pending, truncated=truncated)
                ),
            )
        )

    async def _run_owners(self) -> tuple[list[RunOwner], int, bool]:
        """The owners of running runs, with the latest lease each holds; how many runs are
        pending; and whether there were more runs than :data:`OWNERS_READ` to read."""
        held: dict[str, tuple[int, float]] = {}
        cursor: str | None = None
        read = 0
        truncated = False
        while True:
            page = await self._ops.list_runs(status="running", limit=500, cursor=cursor)
            for run in page.runs:
                if run.owner is not None:
                    count, lease = held.get(run.owner, (0, 0.0))
                    held[run.owner] = (count + 1, max(lease, run.lease_until or 0.0))
            read += len(page.runs)
            cursor = page.next_cursor
            if cursor is None:
                break
            if read >= OWNERS_READ:
                truncated = True
                break
        pending_page = await self._ops.list_runs(status="pending", limit=500)
        owners = [RunOwner(engine, n, lease) for engine, (n, lease) in sorted(held.items())]
        pending = len(pending_page.runs)
        return owners, pending, truncated or pending_page.next_cursor is not None

    async def schedules_page(self, request: Request) -> str:
        """``/schedules``: the namespace's schedules, next and last tick."""
        # Marked as the CLI's list marks them: a workflow no live engine runs is skipped.
        known = known_workflows(await self._ops.engines())
        infos = await Schedules(self._ops.store, time.time, known=known).list()
        return await self._off_loop(
            lambda: self._page(
                "Schedules",
                "schedules",
                render_schedules(infos, allow_actions=self._allow_actions),
            )
        )

    def _schedules(self) -> Schedules:
        # The wall clock, as the CLI's: schedule times are the engines' wall clock.
        return Schedules(self._ops.store, time.time)

    async def queues_page(self, request: Request) -> str:
        """``/queues``: every queue's depths and the set-aside jobs."""
        queues = await self._ops.queues()
        failed: list[FailedJobView] | None
        try:
            failed = await self._ops.failed_jobs()
        except ConfigError:  # the broker keeps no failed jobs
            failed = None
        alarm = await self._alarm(Html(""))
        return await self._off_loop(
            lambda: self._page(
                "Queues",
                "queues",
                Html(alarm + render_queues(queues, failed, allow_actions=self._allow_actions)),
            )
        )

    # -- raw values (JSON) ------------------------------------------------------------------

    async def raw_run(self, request: Request) -> bytes:
        """``/raw/run?id=RUN``: the run and its history as JSON (as ``runs show --json``);
        with ``&value=input|output|error``, that value alone. What a page that cuts a long
        value links to.

        Raises:
            BadRequest: no ``id``, or another ``value``.
            RunNotFound: no such run.
        """
        run_id = request.query_params.get("id", "")
        value = request.query_params.get("value")
        step_id = request.query_params.get("step")
        if not run_id:
            raise BadRequest("say which run: /raw/run?id=RUN")
        if value is not None and value not in _RUN_VALUES:
            raise BadRequest(f"value is one of {', '.join(_RUN_VALUES)}, not {value!r}")
        if step_id is not None and value is None:
            raise BadRequest("say which value of the step: &value=input|output|error")
        details = await self._ops.show_run(run_id)
        if value is None:
            return await self._off_loop(lambda: _json(details.to_json()))
        if step_id is not None:
            for step in details.steps:
                if step.step_id == step_id:
                    return await self._off_loop(partial(_json, getattr(step, value)))
            raise RunNotFound(f"run {run_id!r} has no step {step_id!r}")
        return await self._off_loop(partial(_json, getattr(details.run, value)))

    async def raw_job(self, request: Request) -> bytes:
        """``/raw/job?queue=QUEUE&id=JOB``: a set-aside job and its evidence as JSON (as
        ``jobs failed --json`` prints it).

        Raises:
            BadRequest: no ``queue`` or no ``id``.
            RunNotFound: no such set-aside job (among the queue's 1,000 newest).
        """
        queue = request.query_params.get("queue", "")
        job_id = request.query_params.get("id", "")
        if not (queue and job_id):
            raise BadRequest("say which job: /raw/job?queue=QUEUE&id=JOB")
        for view in await self._ops.failed_jobs(queue, limit=1000):
            if view.job.id == job_id:
                return await self._off_loop(partial(_json, view.to_json()))
        raise RunNotFound(f"no set-aside job {job_id!r} on {queue!r}")

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

    async def start(self, body: dict[str, str]) -> Reply:
        """Start a run: stored pending (as ``durable-trio run --detach``), an engine of the
        namespace takes it over at once (the store rings the engines that reconcile). A field
        it does not take is refused, not dropped: its optional fields are where a mistyped
        name (``runId`` for ``run_id``) would otherwise start a run other than the one meant."""
        unknown = sorted(set(body) - _START_FIELDS)
        if unknown:
            raise BadRequest(
                f"unknown field{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(repr(name) for name in unknown)}: a start takes "
                f"{', '.join(sorted(_START_FIELDS))}; nothing started"
            )
        workflow = _field(body, "workflow")
        value = _json_field(body, "input")
        # As `schedules add`: a workflow no live engine runs (a typo) is refused while some
        # engine is live to ask; with none live it is stored, for the engine to come.
        known = known_workflows(await self._ops.engines())
        if known is not None and workflow not in known:
            raise BadRequest(
                f"no live engine of namespace {self._ops.names.prefix!r} runs workflow "
                f"{workflow!r} (they run: {', '.join(sorted(known)) or 'none'}): nothing started"
            )
        run_id = body.get("run_id", "").strip() or None
        if run_id is not None and await self._ops.store.get_run(run_id) is not None:
            raise Conflict(
                f"run {run_id} exists already: a start is idempotent by run id, nothing started"
            )
        dedup_key, debounce, tags = start_options(body)
        try:
            started = await self._ops.start_run(
                workflow, value, run_id=run_id, tags=tags, dedup_key=dedup_key, debounce=debounce
            )
        except (PayloadError, ConfigError, TypeError) as exc:
            raise BadRequest(str(exc)) from None
        if debounce is not None:
            return (  # (no page yet: the id names no run before it is due)
                f"start of {workflow!r} folded into run {started} (debounce key "
                f"{debounce.key!r}): a reconciling engine creates it when it is due"
            )
        return (
            f"run {started} of {workflow!r} stored (pending): an engine of this namespace"
            " whose app registers the workflow takes it over at once"
            " (with no engine running, it waits; a dedup key's unfinished run is returned)",
            f"/runs/{path_part(started)}",
        )

    async def signal(self, body: dict[str, str]) -> str:
        """Send a signal to a run (stored at once; the engine driving the run finds it)."""
        run_id, name = _field(body, "run_id"), _field(body, "name")
        payload = _json_field(body, "payload")
        try:
            seq = await self._ops.signal_run(run_id, name, payload)
        except PayloadError as exc:
            raise BadRequest(str(exc)) from None
        return f"signal {name!r} #{seq} sent to run {run_id}"

    async def pause_schedule(self, body: dict[str, str]) -> str:
        """Pause a schedule (its ticks meanwhile never start)."""
        return await self._schedule_change(body, "pause", "paused")

    async def resume_schedule(self, body: dict[str, str]) -> str:
        """Resume a paused schedule from its next tick."""
        return await self._schedule_change(body, "resume", "resumed")

    async def delete_schedule(self, body: dict[str, str]) -> str:
        """Delete a schedule (the runs it started stay)."""
        return await self._schedule_change(body, "delete", "deleted")

    async def _schedule_change(self, body: dict[str, str], verb: str, done: str) -> str:
        name = _field(body, "name")
        if not await getattr(self._schedules(), verb)(name):
            raise RunNotFound(f"no schedule {name!r}")
        return f"schedule {name} {done}: the engines see it within their schedule_recheck"

    async def bulk(self, body: dict[str, str]) -> str:
        """Cancel or retry every run the runs page's filters match (issue 34): only when
        they still match as many runs as the page showed (``expected``), at most
        :data:`BULK_LIMIT`; each run once (see ``durable_trio/_ops_bulk.py``)."""
        from .._ops_bulk import RunFilter

        action = _field(body, "action")
        if action not in ("cancel", "retry"):
            raise BadRequest(f"action is cancel or retry, not {action!r}")
        try:
            filters = RunFilters({k: body.get(k, "") for k in ("status", "workflow", "tag")})
            expected = int(_field(body, "expected"))
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        run_filter = RunFilter(status=filters.status, workflow=filters.workflow, tags=filters.tags)
        try:
            run_filter.check()
        except ConfigError as exc:
            raise BadRequest(str(exc)) from None
        counted: list[int] = []

        def same_count(count: int) -> bool:
            counted.append(count)
            return count == expected and count <= BULK_LIMIT

        if action == "cancel":
            result = await self._ops.cancel_runs(
                run_filter, reason="cancelled from the console (bulk)", confirm=same_count
            )
        else:
            result = await self._ops.retry_runs(run_filter, confirm=same_count)
        if not result.confirmed:
            raise Conflict(
                f"{counted[0]} runs match now, not the {expected} shown: nothing done"
                " (reload the page to see them)"
            )
        verb = "cancelled" if action == "cancel" else "retried"
        return (
            f"{result.done} of {result.matched} runs {verb}"
            f" ({result.skipped} skipped: already ended or not failed)"
        )

    async def _count_matching(self, filters: RunFilters) -> int | None:
        """How many runs the page's filters match, for the bulk actions (``None``: no filter;
        past :data:`BULK_LIMIT`, ``BULK_LIMIT + 1``: the count stops there)."""
        if not (filters.status or filters.workflow or filters.tags):
            return None
        count, cursor = 0, None
        while count <= BULK_LIMIT:
            page = await self._ops.list_runs(
                status=filters.status, workflow=filters.workflow, tags=filters.tags,
                limit=500, cursor=cursor,
            )  # fmt: skip
            count += len(page.runs)
            if (cursor := page.next_cursor) is None:
                break
        return min(count, BULK_LIMIT + 1)

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


def _json_field(body: dict[str, str], name: str) -> Any:
    """A field holding JSON text, parsed (missing or blank: ``null``).

    Raises:
        BadRequest: it is not JSON.
    """
    text = body.get(name, "").strip()
    if not text:
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the {name} is not JSON: {exc}") from None


def _json(value: Any) -> bytes:
    return orjson.dumps(value, default=str)
