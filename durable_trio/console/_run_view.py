"""One run's page: its record, its history timeline (steps, attempts, timers) and its actions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import orjson

from .._engine import RunStatus, StepState
from ._html import Html, attr, duration, esc, json_block, query, stamp, status_badge

if TYPE_CHECKING:
    from .._ops import AttemptView, RunDetails, StepView

__all__ = ["error_text", "raw_run_link", "render_run"]


def raw_run_link(run_id: str, value: str | None = None, *, step: str | None = None) -> str:
    """The address of a run's whole record and history as JSON, or of one of its values
    (``input``, ``output``, ``error``), or of one of a step's (``step``: its id): what a page
    that cuts a long value links to."""
    params = {
        "id": run_id,
        **({"step": step} if step else {}),
        **({"value": value} if value else {}),
    }
    return "/raw/run?" + urlencode(params)


#: Characters of step values (inputs, outputs, errors) one run page shows in all: past it a
#: step's values are only linked (each is cut at ``VALUE_LIMIT`` anyway), so a run of a
#: thousand steps with large values still makes a page of bounded size.
STEP_VALUES_BUDGET = 1024 * 1024


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


def _bar(step: StepView, start: float, span: float, run_end: float) -> Html:
    left = max(0.0, (step.created_at - start) / span) * 100
    if step.interrupted:  # it stopped when its run ended
        end = run_end
    elif step.status is StepState.PENDING:
        end = start + span
    else:
        end = step.updated_at
    width = max(0.0, (end - step.created_at) / span) * 100
    css = step.shown_status
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


class _Budget:
    """What is left of :data:`STEP_VALUES_BUDGET` on one page."""

    def __init__(self) -> None:
        self.left = STEP_VALUES_BUDGET


_INTERRUPTED = (
    "the run ended while this step was pending: it will never settle (a result that still"
    " comes is dropped); the store keeps it as the run left it"
)


def _step_values(run_id: str, step: StepView, budget: _Budget) -> Html:
    """The step's input, output and error, folded (``<details>``), each cut at
    ``VALUE_LIMIT`` with a link to the whole."""
    values: list[tuple[str, Any]] = [("input", step.input)]
    if step.status is StepState.COMPLETED:
        values.append(("output", step.output))
    if step.error is not None:
        values.append(("error", step.error))
    parts = []
    for name, value in values:
        link = raw_run_link(run_id, name, step=step.step_id)
        if budget.left <= 0:
            shown = Html(
                f'<p class="clipped">not shown: this page already shows its share of step'
                f' values · <a href="{attr(link)}">the {name} (JSON)</a></p>'
            )
        else:
            shown = json_block(value, link)
            budget.left -= len(shown)
        parts.append(f'<div class="value"><h3>{name}</h3>{shown}</div>')
    summary = " · ".join(name for name, _ in values)
    return Html(
        '<tr class="io"><td></td><td colspan="8">'
        f'<details data-key="io-{attr(step.step_id)}"><summary>{summary}</summary>'
        f'<div class="values">{"".join(parts)}</div>'
        "</details></td></tr>"
    )


def _status(step: StepView) -> Html:
    badge = status_badge(step.shown_status)
    if step.interrupted:
        return Html(f'<span title="{attr(_INTERRUPTED)}">{badge}</span>')
    return badge


def _cancel_row(mark: StepView, names: dict[str, str]) -> str:
    """The cancel mark: an event of the run (a cancel was asked for), not a step that ran."""
    data = mark.output if isinstance(mark.output, dict) else {}
    reason = data.get("reason", mark.output)
    said = reason if isinstance(reason, str) else _compact(reason)
    cut = [str(s) for s in data.get("interrupted") or []]
    steps = ", ".join(f"{s} ({names[s]})" if s in names else s for s in cut)
    where = f" · interrupting step {esc(steps)}" if cut else ""
    return (
        '<tr class="event cancel-event">'
        f'<td class="mono">{esc(mark.step_id)}</td>'
        '<td colspan="8"><span class="badge badge-cancel_requested">cancel requested</span> '
        f"{stamp(mark.created_at)} · reason: <q>{esc(said)}</q>{where}"
        ' <span class="muted">(RunCancelled was raised inside the workflow, which may then run'
        " its compensation steps)</span></td></tr>"
    )


def _step_rows(
    step: StepView, start: float, span: float, run_end: float, run_id: str, budget: _Budget
) -> str:
    ended = step.status is not StepState.PENDING
    first = (
        f'<tr class="step{" interrupted" if step.interrupted else ""}">'
        f'<td class="mono">{esc(step.step_id)}</td>'
        f'<td><b>{esc(step.name)}</b> <span class="muted">{esc(step.kind.value)}</span></td>'
        f"<td>{_status(step)}</td>"
        f"<td>{stamp(step.created_at)}</td>"
        f"<td>{stamp(step.updated_at if ended else None)}</td>"
        f'<td class="num">{esc(duration(step.duration))}</td>'
        f"<td>{len(step.attempts)} attempt{'s' if len(step.attempts) != 1 else ''}</td>"
        f"<td>{_bar(step, start, span, run_end)}</td>"
        f'<td class="error-text">{esc(error_text(step.error))}</td>'
        "</tr>"
    )
    notes = "".join(
        '<tr class="attempt note"><td></td>'
        f'<td colspan="8" class="error-text">{esc(note)}</td></tr>'
        for note in step.notes
    )
    attempts = "".join(_attempt_row(a) for a in step.attempts)
    return first + attempts + notes + _step_values(run_id, step, budget)


def _in_time_order(steps: tuple[StepView, ...]) -> list[StepView]:
    """The steps in id order, each cancel mark placed among them by time: after the steps
    it interrupted, before the compensation it started."""
    ordered = [s for s in steps if not s.cancel_mark]
    for mark in (s for s in steps if s.cancel_mark):
        at = next((i for i, s in enumerate(ordered) if s.created_at > mark.created_at), None)
        ordered.insert(len(ordered) if at is None else at, mark)
    return ordered


def _timeline(details: RunDetails) -> Html:
    if not details.steps:
        return Html('<p class="empty">no step yet</p>')
    start, span = _span(details)
    run = details.run
    run_end = run.updated_at if run.status.terminal else start + span
    names = {s.step_id: s.name for s in details.steps}
    budget = _Budget()
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
    rows = "".join(
        _cancel_row(step, names)
        if step.cancel_mark
        else _step_rows(step, start, span, run_end, run.run_id, budget)
        for step in _in_time_order(details.steps)
    )
    return Html(
        f'<table class="timeline"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'
    )


def _timers(details: RunDetails) -> Html:
    if not details.timers:
        return Html("")
    rows = "".join(
        f'<tr><td class="mono">{esc(t.step_id)}</td><td>{stamp(t.created_at)}</td>'
        f"<td>{stamp(t.wake_at)}</td><td>{status_badge(t.state)}</td></tr>"
        for t in details.timers
    )
    return Html(
        "<h2>Durable timers</h2><table><thead><tr><th>step</th><th>set</th><th>wakes</th>"
        f"<th>state</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def action_form(action: str, url: str, fields: str, label: str, *, allow_actions: bool) -> Html:
    """A form the script posts as JSON (its fields, all strings) to ``url``, as the action
    buttons do; read-only, a line saying how to allow it instead."""
    if not allow_actions:
        return Html(
            f'<p class="muted">{esc(label)}: the console is read-only'
            " (start it with --allow-actions)</p>"
        )
    return Html(
        f'<form class="action-form" data-action="{attr(action)}" data-url="{attr(url)}">'
        f'{fields}<button type="submit" class="primary">{esc(label)}</button></form>'
    )


def _signal_form(run_id: str, allow_actions: bool) -> Html:
    fields = (
        f'<input type="hidden" name="run_id" value="{attr(run_id)}">'
        '<label>signal name<input name="name" required placeholder="approve"></label>'
        '<label class="wide">payload (JSON)'
        '<textarea name="payload" rows="2" spellcheck="false">null</textarea></label>'
    )
    form = action_form(
        "signal", "/api/runs/signal", fields, "Send signal", allow_actions=allow_actions
    )
    return Html(
        '<details class="card form-card" data-key="signal"><summary>Send a signal</summary>'
        f"{form}</details>"
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
    if run.tags:  # issue 34: each a link to the runs of that tag
        facts.append(("tags", Html(" ".join(
            f'<a class="mono" href="{attr("/runs" + query({"tag": f"{k}={v}"}))}">'
            f"{esc(k)}={esc(v)}</a>"
            for k, v in run.tags.items()
        ))))  # fmt: skip
    dl = "".join(f"<dt>{name}</dt><dd>{value}</dd>" for name, value in facts)
    cancelled = run.status is RunStatus.CANCELLED
    error = (
        f"<h2>{'Why it was cancelled' if cancelled else 'Error'}</h2>"
        f'<p class="{"cancel-text" if cancelled else "error-text"}">'
        f"{esc(error_text(run.error))}</p>"
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
        f"{_signal_form(run.run_id, allow_actions) if not run.status.terminal else ''}"
        f"{error}<h2>History</h2>{_timeline(details)}{_timers(details)}"
        f"<h2>Input</h2>{json_block(run.input, raw_run_link(run.run_id, 'input'))}{output}"
    )
