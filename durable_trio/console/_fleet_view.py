"""The workers page (live workers per group) and the queues page (depths, set-aside jobs)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import attrs

from ._html import Html, ago, attr, duration, esc, json_block, path_part, stamp, status_badge
from ._run_view import action_button

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._ops import FailedJobView, QueueView, WorkerView

__all__ = [
    "OTHER_GROUPS_SHOWN",
    "RunOwner",
    "render_engines",
    "render_queues",
    "render_workers",
    "run_of",
]

#: How many of a worker's other groups its row in one group names (then "+N more"): each row
#: stays the same size, so the page grows with workers x groups, not with groups squared.
OTHER_GROUPS_SHOWN = 3


def _count(value: int | None) -> str:
    return "—" if value is None else f"{value:,}"


def _rss(value: int | None) -> str:
    return "—" if value is None else f"{value / 2**20:,.1f} MiB"


def _cpu(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.0f} %"


def _others(worker: WorkerView, group: str) -> str:
    """The groups ``worker`` serves besides ``group``: a few names, then how many more."""
    others = [g for g in worker.groups if g != group]
    if not others:
        return "—"
    shown = ", ".join(others[:OTHER_GROUPS_SHOWN])
    more = len(others) - OTHER_GROUPS_SHOWN
    return shown + (f" +{more:,} more" if more > 0 else "")


def render_workers(
    workers: list[WorkerView], queues: list[QueueView], now: float, crash_loops: Sequence[str] = ()
) -> Html:
    """The workers page's body: one section per group, each live worker once in each group it
    serves, and its figures (which are the worker's, for all its groups together); first, a
    line per crash-looping ``--processes`` child (``crash_loops``, issue 30)."""
    looping = "".join(f'<p class="error-text">{esc(line)}</p>' for line in crash_loops)
    groups: dict[str, list[WorkerView]] = {}
    for worker in workers:
        for group in worker.groups:
            groups.setdefault(group, []).append(worker)
    depth = {q.group: q.ready for q in queues if q.group is not None}
    if not groups:
        return Html(
            "<h1>Workers</h1>" + looping + '<p class="empty">no live worker in this namespace'
            " (a worker shows here while its liveness key is fresh)</p>"
        )
    sections = []
    for group in sorted(groups):
        members = groups[group]
        limit = sum(w.limit or 0 for w in members)
        busy = sum(w.in_flight or 0 for w in members)
        head = "".join(
            (f'<th class="num">{h}</th>' if n else f"<th>{h}</th>")
            for h, n in (
                ("worker", 0),
                ("mode", 0),
                ("limit", 1),
                ("in-flight", 1),
                ("headroom", 1),
                ("RSS", 1),
                ("CPU", 1),
                ("last beat", 0),
                ("other groups", 0),
            )
        )
        rows = "".join(
            "<tr>"
            f'<td class="mono">{esc(w.instance)}</td>'
            f"<td>{esc(w.status.mode if w.status else '—')}</td>"
            f'<td class="num">{_count(w.limit)}</td>'
            f'<td class="num">{_count(w.in_flight)}</td>'
            f'<td class="num">{_count(w.headroom)}</td>'
            f'<td class="num">{_rss(w.status.rss_bytes if w.status else None)}</td>'
            f'<td class="num">{_cpu(w.status.cpu if w.status else None)}</td>'
            f"<td>{esc(ago(w.last_beat_at, now))}</td>"
            f"<td>{esc(_others(w, group))}</td>"
            "</tr>"
            for w in members
        )
        sections.append(
            f'<section class="card"><h2>group <span class="mono">{esc(group)}</span></h2>'
            f"<p>{len(members)} live worker{'s' if len(members) != 1 else ''} · "
            f"limit {limit} · in-flight {busy} · headroom {max(0, limit - busy)} · "
            f"waiting {_count(depth.get(group))}</p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></section>"
        )
    note = (
        '<p class="muted">A worker serving several groups has one limit for them all: its'
        " in-flight and headroom are the worker's, shown in each group it serves.</p>"
    )
    return Html("<h1>Workers</h1>" + looping + note + "".join(sections))


def _queue_table(queues: list[QueueView]) -> Html:
    if not queues:
        return Html('<p class="empty">no queue holds a job or has a live worker</p>')
    cols: tuple[tuple[str, int], ...] = (
        ("queue", 0),
        ("ready", 1),
        ("delayed", 1),
        ("claimed", 1),
        ("set aside", 1),
        ("live workers", 1),
        ("oldest ready", 1),
    )
    limited = any(q.limit is not None for q in queues)
    if limited:  # fleet-wide limits (issue 33): in use is "claimed", waiting is "ready"
        cols = (*cols, ("limit", 1))
    rated = any(q.rate is not None for q in queues)
    if rated:  # rate limits: this window's starts / the rate
        cols = (*cols, ("rate (window)", 1))
    head = "".join((f'<th class="num">{h}</th>' if n else f"<th>{h}</th>") for h, n in cols)
    rows = "".join(
        "<tr>"
        f'<td class="mono">{esc(q.queue)}</td>'
        f'<td class="num">{_count(q.ready)}</td>'
        f'<td class="num">{_count(q.delayed)}</td>'
        f'<td class="num">{_count(q.claimed)}</td>'
        f'<td class="num">{_count(q.failed)}</td>'
        f'<td class="num">{q.live_workers}</td>'
        f'<td class="num">{esc(duration(q.oldest_ready_age))}</td>'
        + (f'<td class="num">{esc(_limit(q.limit, q.per_key))}</td>' if limited else "")
        + (f'<td class="num">{esc(q.rate_text)}</td>' if rated else "")
        + "</tr>"
        for q in queues
    )
    return Html(
        f'<table class="queues"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'
    )


def _evidence(view: FailedJobView) -> Html:
    job = view.job
    stalls = "".join(
        f'<li>{stamp(s.at)} · worker <span class="mono">{esc(s.worker or "?")}</span>'
        f"{'' if s.counted else ' · not counted'}</li>"
        for s in job.stalls
    )
    envelope = view.envelope
    shown = envelope if envelope is not None else job.data.decode(errors="replace")
    whole = "/raw/job?" + urlencode({"queue": view.queue, "id": job.id})
    return Html(
        f'<details data-key="ev-{attr(view.queue)}-{attr(job.id)}"><summary>evidence</summary>'
        f"<p>attempts {job.attempts} · stalls {job.stalled_count}</p>"
        f"{'<ul>' + stalls + '</ul>' if stalls else ''}{json_block(shown, whole)}</details>"
    )


def run_of(envelope: Any) -> str | None:
    """The run a job's envelope names (a task's or a result's ``payload.runId``), if any."""
    payload = envelope.get("payload") if isinstance(envelope, dict) else None
    run_id = payload.get("runId") if isinstance(payload, dict) else None
    return run_id if isinstance(run_id, str) and run_id else None


def _failed_table(failed: list[FailedJobView] | None, *, allow_actions: bool) -> Html:
    if failed is None:
        return Html('<p class="empty">this broker keeps no set-aside jobs</p>')
    if not failed:
        return Html('<p class="empty">no job is set aside</p>')
    rows = []
    for view in failed:
        job = view.job
        envelope = view.envelope
        kind = envelope.get("kind") if isinstance(envelope, dict) else None
        body = {"queue": view.queue, "job_id": job.id}
        buttons = action_button(
            "requeue", "/api/jobs/requeue", body, "Requeue", enabled=allow_actions
        ) + action_button(
            "delete",
            "/api/jobs/delete",
            body,
            "Delete",
            enabled=allow_actions,
            css="danger",
            confirm=f"Delete job {job.id} for good?",
        )
        run_id = run_of(envelope)
        run = (
            f'<a class="mono" href="/runs/{attr(path_part(run_id))}">{esc(run_id)}</a>'
            if run_id is not None
            else "—"
        )
        rows.append(
            f'<tr data-job="{attr(job.id)}">'
            f'<td class="mono">{esc(view.queue)}</td><td class="mono">{esc(job.id)}</td>'
            f"<td>{esc(kind or '—')}</td><td>{run}</td><td>{stamp(job.failed_at)}</td>"
            f'<td class="error-text">{esc(job.error)}</td>'
            f"<td>{_evidence(view)}</td>"
            f'<td><div class="actions">{buttons}</div></td></tr>'
        )
    head = "".join(
        f"<th>{h}</th>"
        for h in ("queue", "job", "kind", "run", "set aside", "error", "evidence", "")
    )
    return Html(
        f'<table class="failed"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def render_queues(
    queues: list[QueueView], failed: list[FailedJobView] | None, *, allow_actions: bool
) -> Html:
    """The queues page's body: every queue's depths, then the jobs set aside."""
    return Html(
        "<h1>Queues</h1>"
        + _queue_table(queues)
        + "<h2>Set-aside jobs</h2>"
        + '<p class="muted">Failed for good (poison, damaged, out of attempts), kept with their'
        " evidence. Requeue puts one back as pending with its counters reset; delete drops it."
        "</p>" + _failed_table(failed, allow_actions=allow_actions)
    )


@attrs.frozen
class RunOwner:
    """An engine as the run store knows it: the owner of running runs, and its leases."""

    engine: str
    runs: int
    """Running runs it holds (among those read)."""
    lease_until: float
    """The latest lease it holds (store clock): an engine renews its runs' leases while it
    lives, so a lease in the past says it stopped (or lost the store)."""


def render_engines(owners: list[RunOwner], now: float, *, pending: int, truncated: bool) -> Html:
    """The engines section of the workers page: the owners of running runs (engines do not
    advertise themselves; this is what the run store knows)."""
    note = (
        '<p class="muted">Engines do not advertise themselves: these are the owners of the'
        " namespace's running runs, read from the run store, with the latest lease each holds."
        " An engine that drives no run (idle, or only reconciling) is not seen here; one whose"
        " leases have all expired has stopped, and another engine takes its runs over at its"
        " next reconcile.</p>"
    )
    waiting = (
        f"<p>{pending:,}{'+' if truncated else ''} pending run{'s' if pending != 1 else ''}"
        " (driven by no engine yet)</p>"
        if pending
        else ""
    )
    if not owners:
        listing = '<p class="empty">no running run: no engine is seen driving one</p>'
    else:
        rows = "".join(
            "<tr>"
            f'<td class="mono">{esc(o.engine)}</td>'
            f'<td class="num">{o.runs:,}{"+" if truncated else ""}</td>'
            f"<td>{stamp(o.lease_until)}</td>"
            f"<td>{status_badge('live' if o.lease_until > now else 'expired')}</td>"
            "</tr>"
            for o in owners
        )
        listing = (
            '<table class="engines"><thead><tr><th>engine (run owner)</th>'
            '<th class="num">running runs</th><th>lease until</th><th>lease</th></tr></thead>'
            f"<tbody>{rows}</tbody></table>"
        )
    return Html(f"<h2>Engines</h2>{note}{waiting}{listing}")


def _limit(limit: int | None, per_key: bool) -> str:
    if limit is None:
        return "—"
    return f"{limit} per key" if per_key else str(limit)
