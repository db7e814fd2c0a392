"""The schedules page: the namespace's stored schedules (as ``durable-trio schedules list``),
their next and last tick, and (with actions allowed) pause, resume and delete."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._html import Html, attr, esc, json_block, stamp, status_badge
from ._run_view import action_button

if TYPE_CHECKING:
    from .._engine._schedules import ScheduleInfo

__all__ = ["render_schedules"]


def _when(info: ScheduleInfo) -> str:
    s = info.schedule
    if s is None:
        return "—"
    if s.cron is not None:
        return f"cron {s.cron} ({s.timezone})"
    return f"every {s.every:g} s"


def _buttons(info: ScheduleInfo, *, allow_actions: bool) -> Html:
    body = {"name": info.name}
    buttons = []
    if info.schedule is not None:
        if info.schedule.paused:
            buttons.append(
                action_button(
                    "resume", "/api/schedules/resume", body, "Resume", enabled=allow_actions
                )
            )
        else:
            buttons.append(
                action_button("pause", "/api/schedules/pause", body, "Pause", enabled=allow_actions)
            )
    buttons.append(
        action_button(
            "delete-schedule",
            "/api/schedules/delete",
            body,
            "Delete",
            enabled=allow_actions,
            css="danger",
            confirm=f"Delete schedule {info.name}? (the runs it started stay)",
        )
    )
    return Html(f'<div class="actions">{"".join(buttons)}</div>')


def _row(info: ScheduleInfo, *, allow_actions: bool) -> str:
    s = info.schedule
    if s is None:
        state = status_badge("damaged")
    elif s.paused:
        state = status_badge("paused")
    elif info.error is not None:  # no live engine runs its workflow: every engine skips it
        state = status_badge("unknown workflow")
    else:
        state = status_badge("active")
    catch_up = f"{s.catch_up} (at most {s.max_catch_up})" if s is not None else "—"
    overlap = "—"
    if s is not None:
        overlap = s.overlap + (f" ({info.skipped} skipped)" if info.skipped else "")
        if info.buffered is not None:
            overlap += " · one buffered"
    value = (
        f'<details data-key="in-{attr(info.name)}"><summary>input</summary>'
        f"{json_block(s.input)}</details>"
        if s is not None
        else "—"
    )
    return (
        f'<tr data-schedule="{attr(info.name)}">'
        f'<td class="mono">{esc(info.name)}</td>'
        f"<td>{esc(s.workflow if s is not None else '—')}</td>"
        f'<td class="mono">{esc(_when(info))}</td>'
        f"<td>{state}</td>"
        f"<td>{stamp(info.next_tick)}</td>"
        f"<td>{stamp(info.last_tick)}</td>"
        f"<td>{esc(catch_up)}</td>"
        f'<td data-overlap="{attr(s.overlap if s is not None else "")}">{esc(overlap)}</td>'
        f"<td>{value}</td>"
        f'<td class="error-text">{esc(info.error or "")}</td>'
        f"<td>{_buttons(info, allow_actions=allow_actions)}</td>"
        "</tr>"
    )


def render_schedules(infos: list[ScheduleInfo], *, allow_actions: bool) -> Html:
    """The schedules page's body."""
    note = (
        '<p class="muted">Each tick starts a run of the workflow (run id'
        ' <span class="mono">sched:NAME:TICK</span>), fired by the engines of the namespace;'
        " a change here is seen by them within their schedule_recheck (5 s by default)."
        " Times are the engines' wall clock.</p>"
    )
    if not infos:
        return Html(
            f'<h1>Schedules</h1>{note}<p class="empty">no schedule in this namespace'
            " (add one with <code>durable-trio schedules add</code> or an app's"
            " <code>@app.schedule</code>)</p>"
        )
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "name",
            "workflow",
            "when",
            "state",
            "next tick",
            "last tick",
            "catch-up",
            "overlap",
            "input",
            "error",
            "",
        )
    )
    rows = "".join(_row(info, allow_actions=allow_actions) for info in infos)
    return Html(
        f"<h1>Schedules</h1>{note}"
        f'<table class="schedules"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'
    )
