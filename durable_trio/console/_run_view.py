"""One run's page: its record, its history timeline (steps, attempts, timers) and its actions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import orjson

from .._engine import RunStatus, StepState
from ._html import Html, attr, duration, esc, json_block, stamp, status_badge

if TYPE_CHECKING:
    from .._ops import AttemptView, RunDetails, StepView

__all__ = ["error_text", "raw_run_link", "render_run"]


def raw_run_link(run_id: str, value: str | None = None) -> str:
    """The address of a run's whole record and history as JSON, or of one of its values
    (``input``, ``output``, ``error``): what a page that cuts a long value links to."""
    params = {"id": run_id, **({"value": value} if value else {})}
    return "/raw/run?" + urlencode(params)


def error_text(error: Any) -> str:
    """A stored error (``{"type", "message", ...}``) as one line."""
    if error is None:
        return ""
    if isinstance(error, dict):
        kind = str(error.get("type") or "")
        message = str(error.get("message") or "")
        return f"{kind}: {message}" if kind and message else kind or message or str(error)
    return str(error)


def action_button(
    action: str,
    url: str,
    body: dict[str, str],
    label: str,
    *,
    enabled: bool,
    css: str = "",
    confirm: str | None = None,
) -> Html:
    """A button the script turns into a ``POST`` of ``body`` to ``url``."""
    title = "" if enabled else ' title="read-only: start the console with --allow-actions"'
    question = f' data-confirm="{attr(confirm)}"' if confirm else ""
    return Html(
        f'<button type="button" class="{attr(css)}" data-action="{attr(action)}"'
        f' data-url="{attr(url)}" data-body="{attr(orjson.dumps(body).decode())}"'
        f"{question}{title}{'' if enabled else ' disabled'}>{esc(label)}</button>"
    )


def _span(details: RunDetails) -> tuple[float, float]:
    run = details.run
    start = run.created_at
    ends = [run.updated_at, *(s.updated_at for s in details.steps)]
    return start, max(max(ends) - start, 1e-9)


def _bar(step: StepView, start: float, span: float) -> Html:
    left = max(0.0, (step.created_at - start) / span) * 100
    end = step.updated_at if step.status is not StepState.PENDING else start + span
    width = max(0.0, (end - step.created_at) / span) * 100
    css = step.status.value
    # SVG attributes, not a style attribute: the page's CSP allows no inline style.
    return Html(
        '<svg class="bar" viewBox="0 0 100 10" preserveAspectRatio="none" aria-hidden="true">'
        f'<rect class="{css}" x="{left:.2f}" y="0" width="{max(width, 0.5):.2f}" height="10"/>'
        "</svg>"
    )


def _beat(beat: Any) -> str:
    if not isinstance(beat, dict):
        return "—"
    details = beat.get("details")
    at = beat.get("at")
    shown = f"at {stamp(at) if isinstance(at, int | float) else '?'}"
    return shown + (f" · {esc(_compact(details))}" if details is not None else "")


def _compact(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return repr(value)


def _attempt_row(attempt: AttemptView) -> str:
    return (
        '<tr class="attempt">'
        f"<td></td><td>attempt {attempt.attempt}</td>"
        f"<td>{status_badge(attempt.status)}</td>"
        f"<td>{stamp(attempt.started_at)}</td><td>{stamp(attempt.ended_at)}</td>"
        f'<td class="num">{esc(duration(attempt.duration))}</td>'
        f'<td class="mono">{esc(attempt.worker or "—")}</td>'
        f"<td>{_beat(attempt.heartbeat)}</td>"
        f'<td class="error-text">{esc(error_text(attempt.error))}</td>'
        "</tr>"
    )


def _step_rows(step: StepView, start: float, span: float) -> str:
    first = (
        '<tr class="step">'
        f'<td class="mono">{esc(step.step_id)}</td>'
        f'<td><b>{esc(step.name)}</b> <span class="muted">{esc(step.kind.value)}</span></td>'
        f"<td>{status_badge(step.status)}</td>"
        f"<td>{stamp(step.created_at)}</td>"
        f"<td>{stamp(step.updated_at if step.status is not StepState.PENDING else None)}</td>"
        f'<td class="num">{esc(duration(step.duration))}</td>'
        f"<td>{len(step.attempts)} attempt{'s' if len(step.attempts) != 1 else ''}</td>"
        f"<td>{_bar(step, start, span)}</td>"
        f'<td class="error-text">{esc(error_text(step.error))}</td>'
        "</tr>"
    )
    notes = "".join(
        '<tr class="attempt note"><td></td>'
        f'<td colspan="8" class="error-text">{esc(note)}</td></tr>'
        for note in step.notes
    )
    return first + "".join(_attempt_row(a) for a in step.attempts) + notes


def _timeline(details: RunDetails) -> Html:
    if not details.steps:
        return Html('<p class="empty">no step yet</p>')
    start, span = _span(details)
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "step",
            "name",
            "status",
            "started",
            "ended",
            "duration",
            "attempts / worker",
            "timeline / last beat",
            "error",
        )
    )
    rows = "".join(_step_rows(step, start, span) for step in details.steps)
    return Html(
        f'<table class="timeline"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'
    )


def _timers(details: RunDetails) -> Html:
    if not details.timers:
        return Html("")
    rows = "".join(
        f'<tr><td class="mono">{esc(t.step_id)}</td><td>{stamp(t.created_at)}</td>'
        f"<td>{stamp(t.wake_at)}</td><td>{'fired' if t.fired else 'waiting'}</td></tr>"
        for t in details.timers
    )
    return Html(
        "<h2>Durable timers</h2><table><thead><tr><th>step</th><th>set</th><th>wakes</th>"
        f"<th>state</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def render_run(details: RunDetails, *, allow_actions: bool) -> Html:
    """The run page's body."""
    run = details.run
    body = {"run_id": run.run_id}
    buttons = []
    if run.status in (RunStatus.FAILED, RunStatus.BLOCKED):
        buttons.append(
            action_button(
                "retry",
                "/api/runs/retry",
                body,
                "Retry from the failed step",
                enabled=allow_actions,
                css="primary",
            )
        )
    if not run.status.terminal:
        buttons.append(
            action_button(
                "cancel",
                "/api/runs/cancel",
                body,
                "Cancel",
                enabled=allow_actions,
                css="danger",
                confirm=f"Cancel run {run.run_id}?",
            )
        )
    took = duration(run.updated_at - run.created_at) if run.status.terminal else "—"
    facts = [
        ("workflow", esc(run.workflow)),
        ("status", status_badge(run.status)),
        ("created", stamp(run.created_at)),
        ("updated", stamp(run.updated_at)),
        ("took", esc(took)),
        ("owner", esc(run.owner or "—")),
        ("lease until", stamp(run.lease_until)),
        ("timeout", esc(duration(run.timeout) if run.timeout is not None else "none")),
    ]
    dl = "".join(f"<dt>{name}</dt><dd>{value}</dd>" for name, value in facts)
    error = (
        f'<h2>Error</h2><p class="error-text">{esc(error_text(run.error))}</p>'
        f"{json_block(run.error, raw_run_link(run.run_id, 'error'))}"
        if run.error is not None
        else ""
    )
    output = (
        f"<h2>Output</h2>{json_block(run.output, raw_run_link(run.run_id, 'output'))}"
        if run.status is RunStatus.COMPLETED
        else ""
    )
    return Html(
        f'<p><a href="/runs">« runs</a> · <a href="{attr(raw_run_link(run.run_id))}">'
        "this run as JSON</a></p>"
        f'<h1>Run <span class="mono">{esc(run.run_id)}</span> {status_badge(run.status)}</h1>'
        f'<div class="actions">{"".join(buttons)}</div>'
        f'<div class="card"><dl class="facts">{dl}</dl></div>'
        f"{error}<h2>History</h2>{_timeline(details)}{_timers(details)}"
        f"<h2>Input</h2>{json_block(run.input, raw_run_link(run.run_id, 'input'))}{output}"
    )
