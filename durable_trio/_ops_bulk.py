"""Bulk operations by filter (issue 34, item 3): cancel or retry every run a filter matches,
from Python (``ops.cancel_runs`` / ``ops.retry_runs``), ``durable-trio runs cancel|retry
--status --workflow --tag --since --until`` and the console's runs page.

How a bulk goes (docs/operations.md, "Bulk operations"):

1. **Count.** The runs the filter matches are read page by page through the store's cursor
   (by creation order: a run created meanwhile, or one that changes status, never shifts the
   pages that follow), their ids kept: that set, counted, is what the bulk acts on. A run
   created after the count is left alone.
2. **Confirm.** ``confirm(count)`` (the CLI's question, the console's expected count) may
   stop it there; a dry run stops there too and reports what it would do.
3. **Act.** Each run of the set, once, newest first: a cancel as :meth:`Operations.cancel_run`
   without waiting (the engine driving it delivers ``RunCancelled``; a run nobody drives is
   settled at once), a retry as :meth:`Operations.retry_run`. A run that changed meanwhile is
   skipped with what it is now ("already ended", "not failed"), never an error that stops the
   rest.

Interrupted half-way (the CLI killed), the same command finishes it: the runs already cancelled
answer "already ended" (or no longer match ``--status running``), the runs already retried
no longer match ``--status failed``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import attrs

from ._engine._errors import RunNotFound, RunNotRetryable
from ._engine._records import RunStatus
from ._engine._tags import check_tags
from ._errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

#: The :class:`~durable_trio.Operations` a bulk runs on (named loosely: ``_ops`` imports this
#: module, never the other way round).
Operations = Any

__all__ = ["BULK_PAGE", "BulkOutcome", "BulkResult", "RunFilter", "run_bulk"]

#: Runs read per page while counting.
BULK_PAGE: Final = 500


@attrs.frozen
class RunFilter:
    """Which runs a bulk operation acts on: those matching every filter given (at least one:
    a bulk over every run of the namespace is refused).

    Attributes:
        status: only runs of this status (a :class:`RunStatus` or its name).
        workflow: only runs of this workflow.
        tags: only runs carrying every one of these tags.
        since: only runs created at or after this time (store clock).
        until: only runs created before this time.
        tenant: only the runs a tenant pod started.
    """

    status: RunStatus | str | None = None
    workflow: str | None = None
    tags: Mapping[str, str] | None = None
    since: float | None = None
    until: float | None = None
    tenant: str | None = None

    def check(self) -> None:
        """Raises ConfigError: no filter at all, or bad tags."""
        check_tags(self.tags, "bulk: tags")
        given = (self.status, self.workflow, self.tags or None, self.since, self.until)
        if all(value is None for value in given) and self.tenant is None:
            raise ConfigError(
                "a bulk operation needs a filter (status, workflow, tags, since or until):"
                " it never acts on every run of the namespace"
            )

    def to_json(self) -> dict[str, Any]:
        """The filter as the CLI's ``--json`` prints it (only what was given)."""
        status = self.status.value if isinstance(self.status, RunStatus) else self.status
        values = {
            "status": status,
            "workflow": self.workflow,
            "tags": dict(self.tags) if self.tags else None,
            "since": self.since,
            "until": self.until,
            "tenant": self.tenant,
        }
        return {key: value for key, value in values.items() if value is not None}


@attrs.frozen
class BulkOutcome:
    """What a bulk operation did (or, in a dry run, would do) to one run."""

    run_id: str
    workflow: str
    status: str
    """The run's status when it was counted."""
    done: bool
    """Whether this run was changed (a dry run: whether it would be)."""
    note: str
    """``cancelled``, ``cancel sent``, ``reopened``, ``would cancel``, ``would retry``,
    ``already ended``, ``already ended or being cancelled``, ``not failed (completed)``,
    ``gone``."""

    def to_json(self) -> dict[str, Any]:
        return {
            "runId": self.run_id,
            "workflow": self.workflow,
            "status": self.status,
            "done": self.done,
            "note": self.note,
        }


@attrs.frozen
class BulkResult:
    """A bulk operation's outcome: how many runs matched and what became of each."""

    action: str
    """``cancel`` or ``retry``."""
    matched: int
    """Runs the filter matched when counted."""
    outcomes: list[BulkOutcome]
    """One per run handled, in the order handled (empty when not confirmed)."""
    dry_run: bool = False
    confirmed: bool = True

    @property
    def done(self) -> int:
        """Runs changed (a dry run: that would be)."""
        return sum(1 for outcome in self.outcomes if outcome.done)

    @property
    def skipped(self) -> int:
        """Runs left as they were (already ended, no longer failed, gone)."""
        return sum(1 for outcome in self.outcomes if not outcome.done)

    def to_json(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "matched": self.matched,
            "done": self.done,
            "skipped": self.skipped,
            "dryRun": self.dry_run,
            "confirmed": self.confirmed,
            "runs": [outcome.to_json() for outcome in self.outcomes],
        }


async def matching_runs(ops: Operations, run_filter: RunFilter) -> list[tuple[str, str, str]]:
    """``(run id, workflow, status)`` of every run ``run_filter`` matches, newest first, read
    page by page by the store's cursor (a damaged row cannot be acted on: left out)."""
    run_filter.check()
    found: list[tuple[str, str, str]] = []
    cursor: str | None = None
    while True:
        page = await ops.list_runs(
            status=run_filter.status,
            workflow=run_filter.workflow,
            tenant=run_filter.tenant,
            since=run_filter.since,
            until=run_filter.until,
            tags=run_filter.tags,
            limit=BULK_PAGE,
            cursor=cursor,
        )
        found += [(run.run_id, run.workflow, run.status.value) for run in page.runs]
        cursor = page.next_cursor
        if cursor is None:
            return found


async def run_bulk(
    ops: Operations,
    action: str,
    run_filter: RunFilter,
    *,
    reason: str = "cancelled by an operator (bulk)",
    dry_run: bool = False,
    confirm: Callable[[int], bool | Awaitable[bool]] | None = None,
    on_each: Callable[[BulkOutcome], Any] | None = None,
) -> BulkResult:
    """Cancel or retry (``action``) every run ``run_filter`` matches (see the module docs).

    Args:
        confirm: told the count before anything is done; a false answer stops the bulk
            (``confirmed`` false, no outcome).
        on_each: told each outcome as it happens (the CLI prints it).

    Raises:
        ConfigError: no filter, a bad one, or an unknown action.
    """
    if action not in ("cancel", "retry"):
        raise ConfigError(f"a bulk action is cancel or retry, not {action!r}")
    matched = await matching_runs(ops, run_filter)
    if confirm is not None:
        answer = confirm(len(matched))
        if inspect.isawaitable(answer):
            answer = await answer
        if not answer:
            return BulkResult(action, len(matched), [], dry_run, confirmed=False)
    outcomes: list[BulkOutcome] = []
    for run_id, workflow, status in matched:
        if dry_run:
            done, note = _would(action, status)
        elif action == "cancel":
            done, note = await _cancel(ops, run_id, reason)
        else:
            done, note = await _retry(ops, run_id)
        outcome = BulkOutcome(run_id, workflow, status, done, note)
        outcomes.append(outcome)
        if on_each is not None:
            on_each(outcome)
    return BulkResult(action, len(matched), outcomes, dry_run)


def _would(action: str, status: str) -> tuple[bool, str]:
    ended = RunStatus(status).terminal
    if action == "cancel":
        return (False, "already ended") if ended else (True, "would cancel")
    if status in (RunStatus.FAILED.value, RunStatus.BLOCKED.value):
        return True, "would retry"
    return False, f"not failed ({status})"


async def _cancel(ops: Operations, run_id: str, reason: str) -> tuple[bool, str]:
    try:
        if not await ops.cancel_run(run_id, reason=reason, wait=False):
            return False, "already ended or being cancelled"
    except RunNotFound:
        return False, "gone"
    run = await ops.store.get_run(run_id)
    if run is not None and not run.status.terminal:
        return True, "cancel sent"  # the engine driving it settles it
    return True, "cancelled"


async def _retry(ops: Operations, run_id: str) -> tuple[bool, str]:
    try:
        await ops.retry_run(run_id)
    except RunNotFound:
        return False, "gone"
    except RunNotRetryable as exc:
        return False, f"not failed ({exc.status})"
    return True, "reopened"
