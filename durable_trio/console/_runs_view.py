"""The runs page: filters (status, workflow, a tag), search by id, paging by the store's cursor,
and the bulk actions on the runs the filters match (issue 34)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._engine import RunStatus
from .._engine._tags import parse_tag
from .._errors import ConfigError
from ._html import Html, attr, esc, path_part, query, stamp, status_badge
from ._run_view import action_button, action_form

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._engine import DamagedRun, RunRecord

__all__ = ["BULK_LIMIT", "DEFAULT_LIMIT", "MAX_LIMIT", "RunFilters", "render_runs"]

DEFAULT_LIMIT = 50
MAX_LIMIT = 500
#: The most runs one bulk action of the console acts on (more: ``durable-trio runs cancel|retry``
#: by filter, which reports each run as it goes).
BULK_LIMIT = 1000


class RunFilters:
    """The runs page's query: checked, with a clear error for a bad value."""

    def __init__(self, params: dict[str, str]) -> None:
        status = params.get("status", "").strip()
        if status and status not in {s.value for s in RunStatus}:
            choices = ", ".join(s.value for s in RunStatus)
            raise ValueError(f"unknown status {status!r}: one of {choices}")
        self.status: str | None = status or None
        self.workflow: str | None = params.get("workflow", "").strip() or None
        self.tag: str | None = params.get("tag", "").strip() or None
        self.tags: dict[str, str] | None = None
        if self.tag is not None:  # issue 34: one KEY=VALUE
            try:
                self.tags = dict([parse_tag(self.tag, "tag")])
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        self.search: str | None = params.get("q", "").strip() or None
        self.cursor: str | None = params.get("cursor") or None
        raw_limit = params.get("limit", "").strip()
        try:
            limit = int(raw_limit) if raw_limit else DEFAULT_LIMIT
        except ValueError:
            raise ValueError(f"limit must be a whole number, not {raw_limit!r}") from None
        if not 1 <= limit <= MAX_LIMIT:
            raise ValueError(f"limit must be 1..{MAX_LIMIT}, not {limit}")
        self.limit = limit

    def link(self, **changes: str | None) -> str:
        """The runs page's address with these filters, ``changes`` applied."""
        params: dict[str, str | None] = {
            "status": self.status,
            "workflow": self.workflow,
            "tag": self.tag,
            "limit": str(self.limit) if self.limit != DEFAULT_LIMIT else None,
        }
        params.update(changes)
        return "/runs" + query(params)


def _form(filters: RunFilters) -> Html:
    options = "".join(
        f'<option value="{s.value}"{" selected" if filters.status == s.value else ""}>'
        f"{s.value}</option>"
        for s in RunStatus
    )
    return Html(
        '<form class="filters" method="get" action="/runs">'
        '<label>status<select name="status"><option value="">any</option>'
        f"{options}</select></label>"
        '<label>workflow<input name="workflow" placeholder="any" '
        f'value="{attr(filters.workflow)}"></label>'
        '<label>tag<input name="tag" placeholder="key=value" '
        f'value="{attr(filters.tag)}"></label>'
        '<button type="submit">Filter</button>'
        "</form>"
        '<form class="filters" method="get" action="/runs">'
        '<label>run id<input name="q" placeholder="find a run by id" '
        f'value="{attr(filters.search)}"></label>'
        '<button type="submit">Find</button></form>'
    )


def _row(run: RunRecord) -> str:
    error = ""
    if isinstance(run.error, dict):
        error = str(run.error.get("message") or run.error.get("type") or "")
    elif run.error is not None:
        error = str(run.error)
    why = "cancel-text" if run.status is RunStatus.CANCELLED else "error-text"  # asked for
    return (
        "<tr>"
        f'<td class="mono"><a href="/runs/{attr(path_part(run.run_id))}">{esc(run.run_id)}</a></td>'
        f"<td>{esc(run.workflow)}</td>"
        f"<td>{status_badge(run.status)}</td>"
        f"<td>{stamp(run.created_at)}</td>"
        f"<td>{stamp(run.updated_at)}</td>"
        f'<td class="{why}">{esc(error[:200])}</td>'
        "</tr>"
    )


def render_runs(
    filters: RunFilters,
    runs: list[RunRecord],
    next_cursor: str | None,
    *,
    damaged: Sequence[DamagedRun] = (),
    searched: bool = False,
    allow_actions: bool = False,
    matching: int | None = None,
) -> Html:
    """The runs page's body.

    Args:
        runs: this page's runs (newest first), or the one found by id.
        next_cursor: the store's cursor of the next page (``None``: the last page).
        damaged: this page's rows that cannot be read (named in a table of their own).
        searched: ``runs`` is the result of a search by id (no paging).
        allow_actions: show the form that starts a run.
        matching: how many runs the filters match (``None``: no filter; more than
            :data:`BULK_LIMIT`: ``BULK_LIMIT + 1``): the bulk actions' count.
    """
    heading = "Runs"
    if searched:
        heading = f"Run id {filters.search!r}"
    elif filters.status or filters.workflow or filters.tag:
        shown = ", ".join(
            f"{key} {value}"
            for key, value in (
                ("status", filters.status), ("workflow", filters.workflow), ("tag", filters.tag)
            )
            if value
        )  # fmt: skip
        heading = f"Runs ({shown})"
    if runs:
        head = "".join(
            f"<th>{h}</th>" for h in ("run id", "workflow", "status", "created", "updated", "error")
        )
        listing = (
            f'<table class="runs"><thead><tr>{head}</tr></thead><tbody>'
            + "".join(_row(run) for run in runs)
            + "</tbody></table>"
        )
    elif searched:
        listing = f'<p class="empty">no run with id {esc(repr(filters.search))}</p>'
    elif not damaged:
        listing = '<p class="empty">no run matches</p>'
    else:
        listing = ""
    if damaged:
        listing += (
            f"<h2>Damaged run rows ({len(damaged)})</h2>"
            '<p class="empty">their stored rows cannot be read; repair or delete them in the '
            "store</p>"
            '<table class="runs"><thead><tr><th>run id</th><th>damaged</th></tr></thead><tbody>'
            + "".join(
                f'<tr><td class="mono">{esc(d.run_id)}</td><td>{esc(d.reason[:300])}</td></tr>'
                for d in damaged
            )
            + "</tbody></table>"
        )
    pager = []
    if filters.cursor and not searched:
        pager.append(f'<a href="{attr(filters.link())}">« newest</a>')
    if next_cursor and not searched:
        pager.append(f'<a rel="next" href="{attr(filters.link(cursor=next_cursor))}">older »</a>')
    return Html(
        f"<h1>{esc(heading)}</h1>{_start_form(runs, allow_actions)}{_form(filters)}"
        f"{_bulk_card(filters, matching, allow_actions)}{listing}"
        f'<div class="pager">{"".join(pager)}</div>'
    )


def _start_form(runs: list[RunRecord], allow_actions: bool) -> Html:
    """Start a run: a workflow (the names of the runs shown are offered), its JSON input and
    an optional run id, tags, dedup key or debounce (docs/concurrency.md, "Debounce and dedup
    keys"); stored pending, as ``durable-trio run --detach`` stores it."""
    known = sorted({run.workflow for run in runs})
    options = "".join(f'<option value="{attr(name)}">' for name in known)
    fields = (
        '<label>workflow<input name="workflow" required list="workflows"'
        ' placeholder="order" autocomplete="off"></label>'
        f'<datalist id="workflows">{options}</datalist>'
        '<label>run id (optional)<input name="run_id" placeholder="a random one"'
        ' autocomplete="off"></label>'
        '<label class="wide">input (JSON)'
        '<textarea name="input" rows="2" spellcheck="false">null</textarea></label>'
        '<label>tags (optional)<input name="tags" placeholder="KEY=VALUE ..."'
        ' autocomplete="off"></label>'
        '<label>dedup key (optional)<input name="dedup_key" placeholder="one unfinished run"'
        ' autocomplete="off"></label>'
        '<label>debounce key (optional)<input name="debounce_key" autocomplete="off"></label>'
        '<label>debounce delay (s)<input name="debounce_delay" inputmode="decimal"'
        ' autocomplete="off"></label>'
        '<label>debounce max wait (s)<input name="debounce_max_wait" inputmode="decimal"'
        ' autocomplete="off"></label>'
    )
    form = action_form("start", "/api/runs/start", fields, "Start run", allow_actions=allow_actions)
    return Html(
        '<details class="card form-card" data-key="start"><summary>Start a run</summary>'
        f"{form}</details>"
    )


def _bulk_card(filters: RunFilters, matching: int | None, allow_actions: bool) -> Html:
    """Cancel or retry every run the filters match (issue 34): the count is shown first, the
    buttons ask again, and the action carries the count it was shown (``expected``): a set
    that changed meanwhile is refused, never acted on unseen."""
    if matching is None:
        return Html("")
    if matching > BULK_LIMIT:
        note = (
            f"more than {BULK_LIMIT} runs match: act on them with"
            " <code>durable-trio runs cancel|retry</code> and these filters"
        )
        return Html(f'<div class="card bulk"><p class="muted">{note}</p></div>')
    shown = ", ".join(
        f"{key} {value}"
        for key, value in (("status", filters.status), ("workflow", filters.workflow),
                           ("tag", filters.tag))
        if value
    )  # fmt: skip
    runs = "run matches" if matching == 1 else "runs match"
    body = {
        "status": filters.status or "",
        "workflow": filters.workflow or "",
        "tag": filters.tag or "",
        "expected": str(matching),
    }
    buttons = "".join(
        action_button(
            action,
            "/api/runs/bulk",
            body | {"action": action},
            f"{label} {matching}",
            enabled=allow_actions and matching > 0,
            css=css,
            confirm=f"{label} the {matching} runs matching {shown}?",
        )
        for action, label, css in (("cancel", "Cancel", "danger"), ("retry", "Retry", ""))
    )
    return Html(
        f'<div class="card bulk"><p><strong>{matching}</strong> {runs} ({esc(shown)}):'
        f' act on every one</p><div class="actions">{buttons}</div></div>'
    )
