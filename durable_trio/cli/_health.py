"""``durable-trio health``: every group's depth and live workers, once or live (``--watch``),
and an optional Prometheus exporter with the same figures."""

from __future__ import annotations

import io
import json
import logging
import math
import sys
import threading
import time
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import trio

from .._codec import to_wire
from .._errors import BrokerError, ConfigError
from .._logs import get_logger, log_failure
from .._naming import QueueNames
from .._os_signals import close_on_signals
from .._terminal import visible
from .._transport._health import read_orphaned_queues, read_store_loss, read_worker_health
from .._transport._supervised import crash_loop_lines, read_supervisors
from ..backends import open_backend

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._engine._records import RunStatus
    from .._errors import StoreLost
    from .._ops import Operations, QueueView
    from .._transport._liveness import GroupHealth
    from ..backends._backend import Backend

__all__ = [
    "HealthReader",
    "health_json",
    "orphan_lines",
    "orphaned",
    "prometheus_text",
    "render_text",
    "snapshot",
    "watch",
]

_log = get_logger("durable_trio")

#: Longest a scrape may take, reading its request and the backend: within Prometheus's
#: default 10 s scrape timeout, so a slow backend yields an answer (``up 0``), not a timeout.
SCRAPE_TIMEOUT = 5.0


class HealthReader:
    """Reads every group's health from an open backend, read-only: no transport, no writes,
    nothing to close. Made once per command and read at every refresh or scrape.

    Attributes:
        reads: backend reads made (one per refresh or scrape).
        errors: reads that failed (a broker error, or no answer within the scrape timeout).
    """

    def __init__(
        self, backend: Backend, namespace: str | None, ops: Operations | None = None
    ) -> None:
        self.backend = backend
        self.namespace = namespace
        self.ops = ops
        """When given, a scrape also reads every queue's counts and the runs by status."""
        self._names = QueueNames(namespace)
        self.reads = 0
        self.errors = 0
        self.store_loss: StoreLost | None = None
        """The loss of the store's data that stands, as of the last read (shown first)."""
        self.crash_loops: list[str] = []
        """The crash-looping ``--processes`` children found by the last read (issue 30)."""

    async def read(self) -> list[GroupHealth] | None:
        """Every group with a live worker, then every orphaned queue (waiting jobs, no live
        worker) as a group with no worker (``None``: the backend has no worker-key store);
        and the store's loss alarm, in :attr:`store_loss`.

        Raises:
            BrokerError: the key store or the broker did not answer.
        """
        self.reads += 1
        try:
            self.store_loss = await read_store_loss(self.backend)
            groups = await read_worker_health(self.backend, self._names)
            if groups is None:
                return None
            keys = self.backend.keys
            if keys is not None:
                self.crash_loops = crash_loop_lines(await read_supervisors(keys, self._names))
            return groups + await read_orphaned_queues(self.backend, self._names, groups)
        except BrokerError:
            self.errors += 1
            raise


async def snapshot(backend: Backend, namespace: str | None) -> list[GroupHealth] | None:
    """Every group with a live worker, read once (see :class:`HealthReader`)."""
    return await HealthReader(backend, namespace).read()


def _fmt(value: float | None, spec: str = ",.0f", unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:{spec}}{unit}"


def _rows(groups: list[GroupHealth]) -> list[list[str]]:
    """One row per group: its depth and its live workers (named; their figures are in the
    workers table, once each, whatever the number of groups a worker serves)."""
    return [
        [
            group.group,
            str(group.depth),
            str(len(group.live_workers)),
            ", ".join(sorted(w.instance for w in group.live_workers)) or "—",
        ]
        for group in groups
    ]


def _worker_rows(groups: list[GroupHealth]) -> list[list[str]]:
    """One row per live worker instance (a worker beats once per group it serves, with the
    same status: shown once, not repeated under every group)."""
    from .._ops_views import workers_of

    rows = []
    for worker in workers_of(groups):
        status = worker.status
        rows.append(
            [
                worker.instance,
                ", ".join(worker.groups),
                f"{status.in_flight}/{status.limit} {status.mode}" if status else "—",
                _fmt(worker.headroom, "d") if status else "—",
                _fmt(status.p95_ms if status else None, ".1f", " ms"),
                _fmt(status.throughput if status else None, ".1f", "/s"),
                _fmt(
                    (status.rss_bytes or 0) / 2**20 if status and status.rss_bytes else None,
                    ".0f",
                    " MiB",
                ),
                _fmt(status.cpu if status else None, ".2f"),
            ]
        )
    return rows


HEADERS = ["group", "depth", "workers", "instances"]

WORKER_HEADERS = [
    "instance",
    "groups",
    "in-flight/limit",
    "headroom",
    "p95",
    "throughput",
    "RSS",
    "CPU",
]


def _plain(headers: list[str], rows: list[list[str]]) -> str:
    # group names and worker ids are stored strings: shown, never interpreted by the terminal
    every = [[visible(cell) for cell in row] for row in (headers, *rows)]
    widths = [max(len(row[i]) for row in every) for i in range(len(headers))]
    return "".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n"
        for row in every
    )


FLOW_HEADERS = ["queue", "limit", "in use", "waiting", "rate (window)"]


def flow_rows(queues: Sequence[QueueView]) -> list[list[str]]:
    """One row per queue with a fleet-wide limit or a rate (issue 33): its limit, the slots
    in use (its claims), the jobs waiting (ready) and its rate's current window."""
    from ._operations import limit_text

    return [
        [q.queue, limit_text(q.limit, q.per_key), str(q.claimed if q.claimed is not None else "—"),
         str(q.ready), q.rate_text]
        for q in queues
        if q.limit is not None or q.rate is not None
    ]  # fmt: skip


def _flow_text(queues: Sequence[QueueView]) -> str:
    rows = flow_rows(queues)
    return "\nflow control\n" + _plain(FLOW_HEADERS, rows) if rows else ""


def render_text(
    groups: list[GroupHealth] | None,
    namespace: str | None,
    loss: StoreLost | None = None,
    crash_loops: Sequence[str] = (),
    queues: Sequence[QueueView] = (),
) -> str:
    """A plain table (what ``health`` prints without ``--watch`` or without rich), after the
    store's loss alarm if one stands, then a line per crash-looping ``--processes`` child
    (``crash_loops``: :attr:`HealthReader.crash_loops`), then the flow-control table of the
    ``queues`` with a limit or a rate (:func:`flow_rows`)."""
    alarm = f"{loss}\n\n" if loss is not None else ""
    if groups is None:
        return (
            alarm
            + "no worker-key store on this backend: worker health is not available\n"
            + _flow_text(queues)
        )
    looping = "".join(visible(line) + "\n" for line in crash_loops)
    if not groups:
        return (
            alarm
            + f"no live workers in namespace {namespace or 'durable'!r}\n"
            + looping
            + _flow_text(queues)
        )
    out = io.StringIO()
    out.write(alarm)
    out.write(_plain(HEADERS, _rows(groups)))
    workers = _worker_rows(groups)
    if workers:
        out.write("\n")
        out.write(_plain(WORKER_HEADERS, workers))
    for line in orphan_lines(groups, namespace):
        out.write(line + "\n")
    out.write(looping)
    out.write(_flow_text(queues))
    return out.getvalue()


def health_json(
    groups: list[GroupHealth] | None,
    namespace: str | None,
    loss: StoreLost | None = None,
    crash_loops: Sequence[str] = (),
    queues: Sequence[QueueView] = (),
) -> dict[str, Any]:
    """What ``durable-trio health --json`` prints: camelCase keys, as every ``--json`` output
    (``groups`` is ``null`` on a backend without a worker-key store; ``storeLost`` the loss
    alarm's message while one stands; ``crashLoops`` a line per crash-looping child;
    ``flowControl`` each queue with a limit or a rate, as ``queues --json`` shows it)."""
    names = QueueNames(namespace)
    return {
        "namespace": names.prefix,
        "storeLost": None if loss is None else str(loss),
        "groups": None if groups is None else [
            {
                "group": g.group,
                "queue": names.tasks(g.group),
                "depth": g.depth,
                "headroom": g.headroom,
                "liveWorkers": [
                    {
                        "instance": w.instance,
                        "lastBeatAt": w.last_beat_at,
                        "status": None if w.status is None else to_wire(w.status),
                    }
                    for w in g.live_workers
                ],
            }
            for g in groups
        ],
        "orphanedQueues": [names.tasks(g.group) for g in orphaned(groups)],
        "crashLoops": list(crash_loops),
        "flowControl": [
            q.to_json() for q in queues if q.limit is not None or q.rate is not None
        ],
    }  # fmt: skip


def orphaned(groups: list[GroupHealth] | None) -> list[GroupHealth]:
    """The groups with waiting jobs and no live worker (orphaned queues)."""
    return [g for g in groups or [] if g.depth and not g.live_workers]


def orphan_lines(groups: list[GroupHealth] | None, namespace: str | None) -> list[str]:
    """One line per orphaned queue, naming it (``{prefix}:tasks:{token}``)."""
    names = QueueNames(namespace)
    return [
        f"orphaned: queue {names.tasks(g.group)!r} has {g.depth} waiting job(s) and no live "
        "worker (a misspelt step name, or no worker serving it is running)"
        for g in orphaned(groups)
    ]


def _rich_table(
    groups: list[GroupHealth] | None,
    namespace: str | None,
    loss: StoreLost | None = None,
    crash_loops: Sequence[str] = (),
    queues: Sequence[QueueView] = (),
) -> Any:
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    if loss is not None:
        return Group(
            Text(str(loss), style="bold red"),
            _rich_table(groups, namespace, crash_loops=crash_loops, queues=queues),
        )
    rows = flow_rows(queues)
    if rows:  # the flow-control table (limits, rates) under the worker tables
        flow = Table(title="flow control", expand=False)
        for header in FLOW_HEADERS:
            flow.add_column(header, justify="left" if header == "queue" else "right")
        for row in rows:
            flow.add_row(*(escape(visible(cell)) for cell in row))
        return Group(_rich_table(groups, namespace, crash_loops=crash_loops), flow)

    def shown(text: str) -> str:  # a stored string: no control character, no rich markup
        return escape(visible(text))

    table = Table(title=f"durable_trio — namespace {namespace or 'durable'}", expand=False)
    for header in HEADERS:
        table.add_column(header, justify="right" if header in ("depth", "workers") else "left")
    workers = Table(title="live workers", expand=False)
    for header in WORKER_HEADERS:
        workers.add_column(header, justify="right" if header == "headroom" else "left")
    if groups is None:
        table.caption = "no worker-key store on this backend"
    elif not groups:
        table.caption = "no live workers"
    else:
        for row in _rows(groups):
            table.add_row(*map(shown, row))
        for row in _worker_rows(groups):
            workers.add_row(*map(shown, row))
        lines = orphan_lines(groups, namespace) + list(crash_loops)
        if lines:
            table.caption = "\n".join(map(shown, lines))
        return Group(table, workers)
    return table


async def watch(
    backend: Backend,
    namespace: str | None,
    *,
    interval: float = 2.0,
    iterations: int | None = None,
    console: Any = None,
) -> None:
    """Refresh the table every ``interval`` seconds (``iterations`` times, or until cancelled).

    A refresh the backend fails (down, not answering) shows its error in one line above the
    last table read, and the next refresh tries again: the view outlives an outage (it exited
    with the first failed refresh, when it was most needed)."""
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    from .._ops import open_operations

    console = console or Console()
    reader = HealthReader(backend, namespace)
    count = 0
    async with open_operations(backend, namespace=namespace) as ops:
        table: Any = _rich_table([], namespace)
        with Live(table, console=console, auto_refresh=False) as live:
            while iterations is None or count < iterations:
                try:
                    groups = await reader.read()
                    queues = await ops.queues()  # (the flow-control table)
                except BrokerError as exc:
                    line = Text(_refresh_failed(exc, interval), style="bold red")
                    live.update(Group(line, table), refresh=True)
                else:
                    table = _rich_table(
                        groups, namespace, reader.store_loss, reader.crash_loops, queues
                    )
                    live.update(table, refresh=True)
                count += 1
                if iterations is None or count < iterations:
                    await trio.sleep(interval)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(
    groups: list[GroupHealth] | None,
    *,
    up: bool = True,
    errors: int = 0,
    namespace: str | None = None,
    queues: list[QueueView] | None = None,
    runs: dict[RunStatus, int] | None = None,
    loss: StoreLost | None = None,
) -> str:
    """The same figures in the Prometheus text exposition format.

    Args:
        groups: what the backend answered.
        up: whether it answered (``False``: the figures are absent, ``durable_trio_up`` is 0).
        errors: reads that failed so far (``durable_trio_health_read_errors_total``).
        namespace: the namespace read (names the orphaned queues).
        queues: every queue's counts (:meth:`Operations.queues`), if read.
        runs: the runs by status (:meth:`RunStore.count_runs`), if read.
        loss: the store's loss alarm, if one stands (``durable_trio_store_lost`` 1).
    """
    lines = [
        "# HELP durable_trio_up Whether this scrape could read the backend (1) or not (0).",
        "# TYPE durable_trio_up gauge",
        f"durable_trio_up {int(up)}",
        "# HELP durable_trio_health_read_errors_total Backend reads of this exporter that failed.",
        "# TYPE durable_trio_health_read_errors_total counter",
        f"durable_trio_health_read_errors_total {errors}",
        "# HELP durable_trio_group_depth Jobs waiting on the group's task queue.",
        "# TYPE durable_trio_group_depth gauge",
        "# HELP durable_trio_group_live_workers Workers with a live liveness key.",
        "# TYPE durable_trio_group_live_workers gauge",
        "# HELP durable_trio_worker_limit Concurrency limit of a worker.",
        "# TYPE durable_trio_worker_limit gauge",
        "# HELP durable_trio_worker_in_flight Steps running on a worker.",
        "# TYPE durable_trio_worker_in_flight gauge",
        "# HELP durable_trio_worker_p95_ms Step latency p95 of a worker.",
        "# TYPE durable_trio_worker_p95_ms gauge",
        "# HELP durable_trio_worker_throughput Steps per second of a worker.",
        "# TYPE durable_trio_worker_throughput gauge",
        "# HELP durable_trio_worker_rss_bytes Resident memory of a worker.",
        "# TYPE durable_trio_worker_rss_bytes gauge",
        "# HELP durable_trio_worker_serves The groups a worker serves (1 per instance, group).",
        "# TYPE durable_trio_worker_serves gauge",
        "# HELP durable_trio_queue_orphaned A task queue with waiting jobs and no live worker.",
        "# TYPE durable_trio_queue_orphaned gauge",
        "# HELP durable_trio_queue_jobs Jobs of a queue by state (ready, delayed, claimed, "
        "failed: set aside).",
        "# TYPE durable_trio_queue_jobs gauge",
        "# HELP durable_trio_queue_rate_window_starts Starts in a rate-limited queue's current "
        "window (its rate: durable_trio_queue_rate per durable_trio_queue_rate_per_seconds).",
        "# TYPE durable_trio_queue_rate_window_starts gauge",
        "# HELP durable_trio_queue_rate_window_keys For a per-key rate: the keys with a start "
        "in their current window (durable_trio_queue_rate_window_starts is the busiest key's).",
        "# TYPE durable_trio_queue_rate_window_keys gauge",
        "# HELP durable_trio_runs Runs in the run store by status.",
        "# TYPE durable_trio_runs gauge",
        "# HELP durable_trio_store_lost Whether the store was emptied or replaced under running "
        "processes (1, until acknowledged) or not (0).",
        "# TYPE durable_trio_store_lost gauge",
    ]
    if up:
        lines.append(f"durable_trio_store_lost {int(loss is not None)}")
    from .._engine._records import RunStatus as _Status
    from .._ops_views import workers_of

    for view in queues or []:
        q = _label(view.queue)
        counts = {
            "ready": view.ready,
            "delayed": view.delayed,
            "claimed": view.claimed,
            "failed": view.failed,
        }
        for state, value in counts.items():
            if value is not None:
                lines.append(f'durable_trio_queue_jobs{{queue="{q}",state="{state}"}} {value}')
        if view.limit is not None:  # a fleet-wide limit (issue 33); in use: claimed
            lines.append(f'durable_trio_queue_limit{{queue="{q}"}} {view.limit}')
        if view.rate is not None and view.rate_per is not None:  # a rate limit, its window
            lines.append(f'durable_trio_queue_rate{{queue="{q}"}} {view.rate}')
            lines.append(f'durable_trio_queue_rate_per_seconds{{queue="{q}"}} {view.rate_per:g}')
            lines.append(f'durable_trio_queue_rate_window_starts{{queue="{q}"}} {view.window}')
            if view.rate_per_key:
                lines.append(
                    f'durable_trio_queue_rate_window_keys{{queue="{q}"}} {view.window_keys}'
                )
    if runs is not None:
        for run_status in _Status:
            count = runs.get(run_status, 0)
            lines.append(f'durable_trio_runs{{status="{run_status.value}"}} {count}')
    names = QueueNames(namespace)
    for group in orphaned(groups):
        queue = names.tasks(group.group).replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'durable_trio_queue_orphaned{{queue="{queue}"}} 1')
    for group in groups or []:
        g = _label(group.group)
        lines.append(f'durable_trio_group_depth{{group="{g}"}} {group.depth}')
        lines.append(f'durable_trio_group_live_workers{{group="{g}"}} {len(group.live_workers)}')
    # Each worker once (it beats once per group it serves, with the same status): summing a
    # figure over the workers never counts one twice.
    for worker in workers_of(groups or []):
        instance = _label(worker.instance)
        for served in worker.groups:
            lines.append(
                f'durable_trio_worker_serves{{instance="{instance}",group="{_label(served)}"}} 1'
            )
        status = worker.status
        if status is None:
            continue
        figures: dict[str, float | None] = {
            "limit": status.limit,
            "in_flight": status.in_flight,
            "p95_ms": status.p95_ms,
            "throughput": status.throughput,
            "rss_bytes": status.rss_bytes,
        }
        for name, figure in figures.items():
            if figure is not None:
                lines.append(f'durable_trio_worker_{name}{{instance="{instance}"}} {figure}')
    return "\n".join(lines) + "\n"


async def _scrape(reader: HealthReader) -> bytes:
    """The metrics text of one scrape; a backend that fails or does not answer in time gives
    ``durable_trio_up 0`` (reported on the log), never an error that would end the exporter."""
    groups = None
    queues: list[QueueView] | None = None
    runs: dict[RunStatus, int] | None = None
    with trio.move_on_after(SCRAPE_TIMEOUT) as bound:
        try:
            groups = await reader.read()
            if reader.ops is not None:
                queues = await reader.ops.queues()
                runs = await reader.ops.store.count_runs()
        except BrokerError as exc:
            # (a BrokerUnavailable in one line: every scrape meets it while the backend is down)
            log_failure(_log, logging.ERROR, exc, "health: a scrape could not read the backend")
            return prometheus_text(
                None, up=False, errors=reader.errors, namespace=reader.namespace
            ).encode()
    if bound.cancelled_caught:
        reader.errors += 1
        _log.error("health: a scrape got no answer from the backend in %s s", SCRAPE_TIMEOUT)
        return prometheus_text(None, up=False, errors=reader.errors).encode()
    return prometheus_text(
        groups,
        errors=reader.errors,
        namespace=reader.namespace,
        queues=queues,
        runs=runs,
        loss=reader.store_loss,
    ).encode()


async def respond(stream: trio.abc.Stream, reader: HealthReader) -> None:
    """Answer one HTTP/1.0 request on ``stream``: ``GET /metrics`` or 404; then close it."""
    try:
        request = b""
        with trio.move_on_after(SCRAPE_TIMEOUT):
            while b"\r\n\r\n" not in request and len(request) < 8192:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    break
                request += chunk
        path = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b"/"
        if path.split(b"?")[0] == b"/metrics":
            try:
                body = await _scrape(reader)
            except Exception as exc:
                # A defect met by one scrape answers that scrape with a 500, logged with its
                # traceback; the exporter goes on serving the next ones.
                _log.error("health: a scrape failed: %s", exc, exc_info=exc)
                body = b"internal error\n"
                head = b"HTTP/1.0 500 Internal Server Error\r\nContent-Type: text/plain\r\n"
            else:
                head = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
        else:
            body, head = (
                b"not found\n",
                b"HTTP/1.0 404 Not Found\r\nContent-Type: text/plain\r\n",
            )
        with trio.move_on_after(SCRAPE_TIMEOUT):
            await stream.send_all(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the scraper went away
    finally:
        await stream.aclose()


async def serve_prometheus(
    reader: HealthReader,
    port: int,
    host: str = "127.0.0.1",
    *,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``GET /metrics`` on ``host:port`` until cancelled (a minimal HTTP/1.0 responder),
    every scrape read through ``reader``; ``task_status`` gets the listeners (port 0: any)."""

    async def handle(stream: trio.SocketStream) -> None:
        await respond(stream, reader)

    await trio.serve_tcp(handle, port, host=host, task_status=task_status)


async def _serve_and_watch(
    reader: HealthReader, port: int, watch_mode: bool, interval: float, iterations: int | None
) -> None:
    async with trio.open_nursery() as nursery:
        try:
            listeners = await nursery.start(serve_prometheus, reader, port)
        except OSError as exc:  # the port is taken, or not ours to listen on
            raise ConfigError(f"cannot listen on 127.0.0.1:{port}: {exc}") from exc
        # Said once it listens, with the port it got (0: any free one)
        bound = listeners[0].socket.getsockname()[1]
        print(f"serving Prometheus metrics on http://127.0.0.1:{bound}/metrics", flush=True)
        if watch_mode:
            await watch(reader.backend, reader.namespace, interval=interval, iterations=iterations)
            nursery.cancel_scope.cancel()


async def run_health(
    url: str,
    namespace: str | None,
    *,
    watch_mode: bool,
    interval: float,
    iterations: int | None,
    prometheus: int | None,
    as_json: bool = False,
) -> None:
    """What the command does (see :func:`durable_trio.cli._main.main`)."""
    async with open_backend(url, existing=True, read_only="if_needed") as backend:
        if namespace is None:
            from .._ops import discover_namespace

            namespace = await discover_namespace(backend)
        reader = HealthReader(backend, namespace)  # one for the whole command
        if prometheus is None and not watch_mode:
            from .._ops import open_operations

            groups = await reader.read()
            async with open_operations(backend, namespace=namespace) as ops:
                queues = await ops.queues()  # the flow-control table (limits, rates)
            loss, loops = reader.store_loss, reader.crash_loops
            if as_json:
                print(json.dumps(health_json(groups, namespace, loss, loops, queues), indent=2))
            else:
                print(render_text(groups, namespace, loss, loops, queues), end="")
            return
        # The long-running modes stop on SIGINT or SIGTERM without a traceback (exit 0), as a
        # worker does; signals reach only the main thread (a test may call from another).
        async with AsyncExitStack() as stack:
            if threading.current_thread() is threading.main_thread():
                signals = await stack.enter_async_context(close_on_signals(announce=_say))
                stack.enter_context(signals.body())
            await _serve_or_watch(reader, prometheus, watch_mode, interval, iterations)


def _refresh_failed(exc: BrokerError, interval: float) -> str:
    """The line a watch shows for a refresh the backend failed."""
    at = time.strftime("%H:%M:%S")
    return visible(f"{at} refresh failed: {exc} (trying again every {interval:g} s)")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def _serve_or_watch(
    reader: HealthReader,
    prometheus: int | None,
    watch_mode: bool,
    interval: float,
    iterations: int | None,
) -> None:
    backend, namespace = reader.backend, reader.namespace
    if prometheus is not None:
        from .._ops import open_operations

        async with open_operations(backend, namespace=namespace) as ops:
            reader.ops = ops
            await _serve_and_watch(reader, prometheus, watch_mode, interval, iterations)
        return
    try:
        await watch(backend, namespace, interval=interval, iterations=iterations)
    except ImportError:
        from .._ops import open_operations

        count = 0
        async with open_operations(backend, namespace=namespace) as ops:
            while iterations is None or count < iterations:  # no rich: reprint the table
                try:
                    groups = await reader.read()
                    queues = await ops.queues()
                except BrokerError as exc:  # (as the rich view: said, and tried again)
                    print(_refresh_failed(exc, interval), file=sys.stderr, flush=True)
                else:
                    loss, loops = reader.store_loss, reader.crash_loops
                    print(render_text(groups, namespace, loss, loops, queues), flush=True)
                count += 1
                if iterations is None or count < iterations:
                    await trio.sleep(interval)
