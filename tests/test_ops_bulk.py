"""Bulk operations by filter (issue 34, item 3) on every run store, in exact virtual time:
counted first, confirmed, each run handled once, runs created meanwhile left alone, and an
interrupted bulk finished by running it again."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from _every_store import open_store
from durable_trio._ops import BulkOutcome, Operations, RunFilter


class Interrupted(Exception):
    """The operator's Ctrl-C, half-way."""


async def _statuses(ops: Operations) -> dict[str, str]:
    page = await ops.list_runs(limit=100)
    return {run.run_id: run.status.value for run in page.runs}


async def test_bulk_cancel_counts_confirms_and_resumes(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    ns = f"bulk-{uuid.uuid4().hex[:6]}"
    async with open_store(every_store, ns) as (backend, store):
        ops = Operations(backend, store, ns)
        start = trio.current_time()
        for n in range(5):  # c1 runs at start + 0 .. start + 4, pending (nobody drives them)
            await ops.start_run("order", n, run_id=f"c1-{n}", tags={"customer": "c1"})
            await ops.start_run("order", n, run_id=f"c2-{n}", tags={"customer": "c2"})
            await trio.sleep(1)
        assert trio.current_time() - start == 5
        c1 = RunFilter(tags={"customer": "c1"})

        dry = await ops.cancel_runs(c1, dry_run=True)
        assert (dry.matched, dry.done, dry.dry_run) == (5, 5, True)
        assert [o.run_id for o in dry.outcomes] == [f"c1-{n}" for n in (4, 3, 2, 1, 0)]
        assert {o.note for o in dry.outcomes} == {"would cancel"}
        counts: list[int] = []

        def say_no(count: int) -> bool:
            counts.append(count)
            return False

        refused = await ops.cancel_runs(c1, confirm=say_no)
        assert (counts, refused.confirmed, refused.outcomes) == ([5], False, [])
        assert set((await _statuses(ops)).values()) == {"pending"}

        # Interrupted after two runs; a run started meanwhile is not in the counted set.
        handled: list[str] = []

        async def late(n: int) -> bool:
            await ops.start_run("order", 9, run_id="c1-late", tags={"customer": "c1"})
            return True

        def stop_after_two(outcome: BulkOutcome) -> None:
            handled.append(outcome.run_id)
            if len(handled) == 2:
                raise Interrupted

        with pytest.raises(Interrupted):
            await ops.cancel_runs(c1, confirm=late, on_each=stop_after_two)
        assert handled == ["c1-4", "c1-3"]
        statuses = await _statuses(ops)
        assert [statuses[f"c1-{n}"] for n in range(5)] == ["pending"] * 3 + ["cancelled"] * 2
        assert statuses["c1-late"] == "pending"

        # The same command again finishes it: the late run now counts, the two done are skipped.
        again = await ops.cancel_runs(c1)
        assert again.matched == 6
        notes = {o.run_id: o.note for o in again.outcomes}
        assert notes["c1-4"] == notes["c1-3"] == "already ended or being cancelled"
        assert {notes[f"c1-{n}"] for n in range(3)} == {"cancelled"}
        assert (again.done, again.skipped) == (4, 2)
        statuses = await _statuses(ops)
        assert {s for r, s in statuses.items() if r.startswith("c1-")} == {"cancelled"}
        assert {s for r, s in statuses.items() if r.startswith("c2-")} == {"pending"}

        # by creation time (exact, store clock) and status
        window = RunFilter(status="pending", since=start + 1, until=start + 3)
        timed = await ops.cancel_runs(window)
        assert [o.run_id for o in timed.outcomes] == ["c2-2", "c2-1"]
        assert (await ops.cancel_runs(window)).matched == 0

        with pytest.raises(dt.ConfigError, match="needs a filter"):
            await ops.cancel_runs(RunFilter())


async def test_bulk_retry_by_status_and_workflow_resumes(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    ns = f"bulk-{uuid.uuid4().hex[:6]}"
    async with open_store(every_store, ns) as (backend, store):
        ops = Operations(backend, store, ns)
        for n in range(4):
            await ops.start_run("order", n, run_id=f"o{n}")
            await ops.start_run("refund", n, run_id=f"r{n}")
            await trio.sleep(1)
        for run_id in ("o0", "o1", "o3", "r1"):
            await store.finish_run(run_id, dt.RunStatus.FAILED, error={"type": "Boom"})
        await store.finish_run("o2", dt.RunStatus.COMPLETED, output=2)
        failed_orders = RunFilter(status="failed", workflow="order")

        dry = await ops.retry_runs(failed_orders, dry_run=True)
        assert [(o.run_id, o.note) for o in dry.outcomes] == [
            ("o3", "would retry"), ("o1", "would retry"), ("o0", "would retry")
        ]  # fmt: skip

        def stop_at_first(outcome: BulkOutcome) -> None:
            raise Interrupted

        with pytest.raises(Interrupted):
            await ops.retry_runs(failed_orders, on_each=stop_at_first)
        assert (await _statuses(ops))["o3"] == "pending"
        # retried runs no longer match status=failed: the same command does the rest, once
        rest = await ops.retry_runs(failed_orders)
        assert [(o.run_id, o.note) for o in rest.outcomes] == [
            ("o1", "reopened"), ("o0", "reopened")
        ]  # fmt: skip
        assert (await ops.retry_runs(failed_orders)).matched == 0
        # without a status: what is not failed is skipped, said why
        every_order = await ops.retry_runs(RunFilter(workflow="order"))
        notes: dict[str, Any] = {o.run_id: o.note for o in every_order.outcomes}
        assert notes == {
            "o3": "not failed (pending)", "o2": "not failed (completed)",
            "o1": "not failed (pending)", "o0": "not failed (pending)",
        }  # fmt: skip
        assert (await _statuses(ops))["r1"] == "failed"
