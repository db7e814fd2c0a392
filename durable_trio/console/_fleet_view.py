"""The workers page (live workers per group) and the queues page (depths, set-aside jobs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._html import Html, ago, attr, duration, esc, json_block, stamp
from ._run_view import action_button

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._ops import FailedJobView, QueueView, WorkerView

__all__ = ["render_queues", "render_workers"]


def _count(value: int | None) -> str:
    return "—" if value is None else f"{value:,}"


def _rss(value: int | None) -> str:
    return "—" if value is None else f"{value / 2**20:,.1f} MiB"


def _cpu(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.0f} %"


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
            f"<td>{esc(', '.join(g for g in w.groups if g != group) or '—')}</td>"
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
    cols = (
        ("queue", 0),
        ("ready", 1),
        ("delayed", 1),
        ("claimed", 1),
        ("set aside", 1),
        ("live workers", 1),
        ("oldest ready", 1),
    )
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
        "</tr>"
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
    return Html(
        f"<details><summary>evidence</summary>"
        f"<p>attempts {job.attempts} · stalls {job.stalled_count}</p>"
        f"{'<ul>' + stalls + '</ul>' if stalls else ''}{json_block(shown)}</details>"
    )


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
        rows.append(
            f'<tr data-job="{attr(job.id)}">'
            f'<td class="mono">{esc(view.queue)}</td><td class="mono">{esc(job.id)}</td>'
            f"<td>{esc(kind or '—')}</td><td>{stamp(job.failed_at)}</td>"
            f'<td class="error-text">{esc(job.error)}</td>'
            f"<td>{_evidence(view)}</td>"
            f'<td><div class="actions">{buttons}</div></td></tr>'
        )
    head = "".join(
        f"<th>{h}</th>" for h in ("queue", "job", "kind", "set aside", "error", "evidence", "")
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
