"""Damaged rows in a SQLite file never wedge, crash or lose a queue (issue #13, finding 2).

Each test writes the damage with raw SQL on a connection of its own, beside good jobs, then runs
a real transport on the file (``sqlite:///`` + its path) and checks: the transport keeps serving,
every good job is served once, every bad row is set aside once (failed with its raw value and the
reason, or quarantined when even its id is unreadable), ``DamagedJob`` was reported, and no row
was lost (rows are counted across ready, claimed, failed and the quarantine). The broker's clock is
the wall clock: real, short waits, each bounded by ``fail_after``.
"""

from __future__ import annotations

import collections
import itertools
import math
import sqlite3
import tracemalloc
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import durable_trio as dt
from durable_trio.brokers import FailedJob, Lease, QuarantinedEntry, SupportsQuarantine
from durable_trio.brokers.sqlite import SqliteBroker

if TYPE_CHECKING:
    from pathlib import Path

NS = "dmg"
STEP = "work"
TASKS = f"{NS}:tasks:{STEP}"
RESULTS = f"{NS}:results"
PENDING = ("ready", "delayed", "active")


def url(path: Path) -> str:
    return "sqlite:///" + str(path)


def task(n: int | str) -> dt.RemoteTask:
    return dt.RemoteTask(run_id=f"run-{n}", step_id=f"s{n}", attempt=1, name=STEP)


def sql(path: Path, statement: str, params: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
    """One statement on a connection of its own, TEXT read as bytes (damage may not be UTF-8)."""
    db = sqlite3.connect(path, isolation_level=None)
    db.text_factory = bytes
    try:
        return db.execute(statement, params).fetchall()
    finally:
        db.close()


async def fill(path: Path, tasks: range, results: range = range(0)) -> None:
    """Dispatch good tasks (steps ``s{n}``) and publish good results (steps ``r{n}``)."""
    async with dt.open_backend(url(path)) as backend:
        async with dt.open_queue_transport(backend, namespace=NS) as transport:
            assert transport.names.task_queue(STEP) == TASKS
            assert transport.names.results == RESULTS
            for n in tasks:
                await transport.dispatch(task(n))
            for n in results:
                await transport.publish_result(
                    dt.StepResult(f"run-r{n}", f"r{n}", 1, dt.StepStatus.COMPLETED, output=n)
                )


def pk_of(path: Path, queue: str, step: str) -> int:
    """The row of the job whose envelope names ``step``."""
    ((pk,),) = sql(
        path,
        "SELECT pk FROM dt_jobs WHERE queue = ? AND instr(data, ?) > 0",
        (queue, f'"stepId":"{step}"'.encode()),
    )
    return int(pk)


def damage(path: Path, pk: int, column: str, value: object, *, cast_text: bool = False) -> None:
    """Overwrite one stored field of row ``pk`` (``cast_text``: store bytes as TEXT as is)."""
    placeholder = "CAST(? AS TEXT)" if cast_text else "?"
    sql(path, f"UPDATE dt_jobs SET {column} = {placeholder} WHERE pk = ?", (value, pk))


def total_rows(path: Path) -> int:
    """Every job row (any state) plus every quarantine entry: nothing may vanish."""
    ((jobs,),) = sql(path, "SELECT count(*) FROM dt_jobs")
    ((quarantined,),) = sql(path, "SELECT count(*) FROM dt_quarantine")
    return int(jobs) + int(quarantined)


def left_on(path: Path, queue: str) -> dict[str, int]:
    """What is left of ``queue``: its rows by state, and its quarantine entries."""
    left = {
        state.decode(): int(count)
        for state, count in sql(
            path, "SELECT state, count(*) FROM dt_jobs WHERE queue = ? GROUP BY state", (queue,)
        )
    }
    ((quarantined,),) = sql(path, "SELECT count(*) FROM dt_quarantine WHERE queue = ?", (queue,))
    if quarantined:
        left["quarantine"] = int(quarantined)
    return left


@attrs.define
class Served:
    """What one run of a transport on the file did."""

    tasks: collections.Counter[str] = attrs.Factory(collections.Counter)
    """Step ids the step handler ran, with how often."""
    results: collections.Counter[str] = attrs.Factory(collections.Counter)
    """Step ids of the results the engine-side consumer got, with how often."""
    errors: list[BaseException] = attrs.Factory(list)
    failed: dict[str, list[FailedJob]] = attrs.Factory(dict)
    quarantined: dict[str, list[QuarantinedEntry]] = attrs.Factory(dict)

    @property
    def damaged(self) -> list[dt.DamagedJob]:
        return [e for e in self.errors if isinstance(e, dt.DamagedJob)]

    def assert_only_damage_reported(self) -> None:
        # A pop, a sweep or a finalize that raised on stored data would show here. (Bytes that
        # are readable but no envelope are the transport's bad input: failed, reported.)
        others = [
            e
            for e in self.errors
            if not isinstance(e, dt.DamagedJob)
            and not (isinstance(e, dt.JobError) and "bad input" in str(e))
        ]
        assert not others, others


async def pending(path: Path, queues: tuple[str, ...]) -> int:
    marks = ",".join("?" * len(queues))
    ((count,),) = await trio.to_thread.run_sync(
        sql,
        path,
        f"SELECT count(*) FROM dt_jobs WHERE queue IN ({marks}) AND state IN (?, ?, ?)",
        (*queues, *PENDING),
    )
    return int(count)


async def serve(
    path: Path,
    *,
    results: bool = False,
    sweep: bool = False,
    before: Any = None,
) -> Served:
    """Run a worker (and, with ``results``, an engine-side result consumer) on the file until
    nothing is ready, delayed or claimed any more on its queues; then read the failed set and
    the quarantine of each queue through the broker."""
    served = Served()
    options: dict[str, Any] = {"namespace": NS, "on_error": served.errors.append}
    if sweep:
        options.update(stalled_threshold=0.3, stalled_check_interval=0.1)
    queues = (TASKS, RESULTS) if results else (TASKS,)
    async with dt.open_backend(url(path)) as backend:
        broker = backend.broker
        assert isinstance(broker, SqliteBroker)
        assert isinstance(broker, SupportsQuarantine)
        if before is not None:
            await before(broker)
        async with dt.open_queue_transport(backend, **options) as transport:

            async def work(t: dt.RemoteTask) -> str:
                served.tasks[t.step_id] += 1
                return t.step_id

            async def got(result: dt.StepResult) -> None:
                served.results[result.step_id] += 1

            transport.handle(STEP, work)
            if results:
                transport.on_result(got)
            with trio.fail_after(10):
                # Polled: the file is read on a connection of its own, nothing to wait on.
                while await pending(path, queues):  # noqa: ASYNC110
                    await trio.sleep(0.02)
        for queue in (TASKS, RESULTS):
            served.failed[queue] = await broker.failed_jobs(queue)
            served.quarantined[queue] = await broker.quarantined(queue)
    return served


def failed_by_id(served: Served, queue: str = TASKS) -> dict[str, FailedJob]:
    jobs = served.failed[queue]
    by_id = {job.id: job for job in jobs}
    assert len(by_id) == len(jobs), "a row was failed twice"
    return by_id


def job_id(path: Path, pk: int) -> str:
    ((raw,),) = sql(path, "SELECT id FROM dt_jobs WHERE pk = ?", (pk,))
    assert isinstance(raw, bytes)
    return raw.decode()


# ------------------------------------------------------------------------------ finding by finding


@pytest.mark.parametrize(
    "stored",
    ["12:00 today", b"\x00\xff", math.inf, -math.inf, None],
    ids=["text", "blob", "inf", "minus-inf", "null"],
)
async def test_a_push_time_that_is_not_a_number_makes_the_age_unknown(
    tmp_path: Path, stored: object
) -> None:
    """``pushed_at`` damaged (TEXT, BLOB, infinite, NULL) on a ready row: the queue's oldest
    age is ``None`` (unknown: that job may be the oldest), its counts are right, nothing
    raises; the job is served as any other, and once it is gone the age is known again."""
    path = tmp_path / "d.db"
    await fill(path, range(3))
    damage(path, pk_of(path, TASKS, "s1"), "pushed_at", stored)
    async with await SqliteBroker.open(path) as broker:
        stats = await broker.queue_stats(TASKS)
        assert (stats.ready, stats.delayed, stats.claimed, stats.failed) == (3, 0, 0, 0)
        assert stats.oldest_ready_age is None
    served = await serve(path)
    assert served.tasks == {"s0": 1, "s1": 1, "s2": 1}
    served.assert_only_damage_reported()
    await fill(path, range(3, 4))
    async with await SqliteBroker.open(path) as broker:
        age = (await broker.queue_stats(TASKS)).oldest_ready_age
        assert age is not None
        assert 0 <= age < 1


async def test_text_data_is_served_and_other_storage_classes_are_set_aside(tmp_path: Path) -> None:
    """Finding 1: ``bytes(data)`` raised on TEXT, the pop rolled back, every restart crashed."""
    path = tmp_path / "d.db"
    await fill(path, range(4))
    as_text, as_int, as_real = (pk_of(path, TASKS, f"s{n}") for n in range(3))
    sql(path, "UPDATE dt_jobs SET data = CAST(data AS TEXT) WHERE pk = ?", (as_text,))
    damage(path, as_int, "data", 5)
    damage(path, as_real, "data", 1.5)
    ids = {pk: job_id(path, pk) for pk in (as_int, as_real)}
    with pytest.raises(sqlite3.IntegrityError):  # NULL cannot reach a pop: the schema refuses it
        damage(path, as_int, "data", None)
    served = await serve(path)

    # TEXT (what a producer in another language writes) is served as its UTF-8.
    assert served.tasks == {"s0": 1, "s3": 1}
    failed = failed_by_id(served)
    assert failed[ids[as_int]].data == b"5"
    assert failed[ids[as_int]].error.startswith("damaged: data: INTEGER 5")
    assert failed[ids[as_real]].data == b"1.5"
    assert failed[ids[as_real]].error.startswith("damaged: data: REAL 1.5")
    # The raw value stays as stored, in the failed row.
    stored = sql(path, "SELECT typeof(data) FROM dt_jobs WHERE state = 'failed' ORDER BY pk")
    assert stored == [(b"integer",), (b"real",)]
    assert len(served.damaged) == 2
    served.assert_only_damage_reported()
    assert left_on(path, TASKS) == {"failed": 2}  # 4 rows: 2 served, 2 set aside


async def test_an_integer_data_is_never_converted_to_bytes(tmp_path: Path) -> None:
    """Finding 2: ``bytes(300_000_000)`` allocated 300 MB; ``bytes(10**13)`` raised MemoryError."""
    path = tmp_path / "d.db"
    await fill(path, range(3))
    big, huge = pk_of(path, TASKS, "s0"), pk_of(path, TASKS, "s1")
    damage(path, big, "data", 300_000_000)
    damage(path, huge, "data", 10**13)
    ids = {big: job_id(path, big), huge: job_id(path, huge)}

    tracemalloc.start()
    try:
        served = await serve(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert peak < 50_000_000
    assert served.tasks == {"s2": 1}
    failed = failed_by_id(served)
    assert failed[ids[big]].data == b"300000000"
    assert failed[ids[huge]].data == b"10000000000000"
    assert len(served.damaged) == 2
    served.assert_only_damage_reported()


JUNK_STALLS: list[tuple[str | bytes, bool]] = [
    ("{not json", False),
    ('[{"at": "x", "worker": "w"}]', False),
    ('[{"at": 1e999, "worker": "w"}]', False),  # inf
    ('[{"at": NaN, "worker": "w"}]', False),
    ("[" * 100_000, False),  # nesting deeper than the decoder's recursion limit
    ("1" * 5_000, False),  # an int of more digits than Python converts
    ('{"at": 1}', False),
    (b"[]", False),  # a BLOB, not TEXT
    ("[\xff]", False),
    (b"\xff[]", True),  # TEXT that is not UTF-8
]


async def test_junk_in_the_stall_history_is_set_aside_with_its_raw_text(tmp_path: Path) -> None:
    """Finding 3: junk in ``stalls`` raised JSONDecodeError out of the pop."""
    path = tmp_path / "d.db"
    await fill(path, range(len(JUNK_STALLS) + 2))
    ids = []
    for n, (value, cast_text) in enumerate(JUNK_STALLS):
        pk = pk_of(path, TASKS, f"s{n}")
        damage(path, pk, "stalls", value, cast_text=cast_text)
        ids.append(job_id(path, pk))

    served = await serve(path)

    good = {f"s{n}" for n in range(len(JUNK_STALLS), len(JUNK_STALLS) + 2)}
    assert served.tasks == dict.fromkeys(good, 1)
    failed = failed_by_id(served)
    assert set(failed) == set(ids)
    for job in failed.values():
        assert job.error.startswith("damaged: stalls: ")
        assert job.stalls == ()
    # The raw stall history stays in the failed rows, as written.
    kept = sql(path, "SELECT stalls FROM dt_jobs WHERE state = 'failed' ORDER BY pk")
    expected = [v if isinstance(v, bytes) else v.encode() for v, _ in JUNK_STALLS]
    assert [row[0] for row in kept] == expected
    assert len(served.damaged) == len(JUNK_STALLS)
    served.assert_only_damage_reported()


async def test_any_other_damaged_field_is_set_aside_or_quarantined(tmp_path: Path) -> None:
    """Finding 4: every other field of the wrong type or out of range; an unreadable id."""
    path = tmp_path / "d.db"
    damaged: list[tuple[str, object, bool, str]] = [
        # (column, value, cast to TEXT, what the reason names)
        ("priority", "high", False, "priority: TEXT 'high'"),
        ("priority", 2.5, False, "priority: REAL 2.5"),
        ("attempts", -1, False, "attempts: INTEGER -1"),
        ("attempts", 2**60, False, "attempts: INTEGER"),
        ("attempts", b"\x01", False, "attempts: BLOB"),
        ("stalled_count", 1.5, False, "stalled_count: REAL 1.5"),
        ("stalled_count", 2**63 - 1, False, "stalled_count: INTEGER"),
        # ``error`` set on a job that is not failed
        ("error", "left over", False, "error: TEXT 'left over', set on a job that is not failed"),
        ("error", 7, False, "error: TEXT '7', set on a job"),
        ("id", b"blob-id", False, "id: stored as BLOB"),
    ]
    unreadable_ids: list[tuple[bytes, bool]] = [(b"\xff\xfe", False), (b"\xffA", True)]
    count = len(damaged) + len(unreadable_ids) + 1 + 3
    await fill(path, range(count))
    expected_reason: dict[str, str] = {}
    for n, (column, value, cast_text, reason) in enumerate(damaged):
        pk = pk_of(path, TASKS, f"s{n}")
        damage(path, pk, column, value, cast_text=cast_text)
        expected_reason[job_id(path, pk)] = reason
    for n, (value, cast_text) in enumerate(unreadable_ids, start=len(damaged)):
        damage(path, pk_of(path, TASKS, f"s{n}"), "id", value, cast_text=cast_text)
    # A delayed job whose due time is not a number would never come due.
    late = len(damaged) + len(unreadable_ids)
    pk = pk_of(path, TASKS, f"s{late}")
    sql(path, "UPDATE dt_jobs SET state = 'delayed', due_at = 'soon' WHERE pk = ?", (pk,))
    expected_reason[job_id(path, pk)] = "due_at: not a number: 'soon'"

    served = await serve(path)

    assert served.tasks == {f"s{n}": 1 for n in range(late + 1, count)}
    failed = failed_by_id(served)
    assert set(failed) == set(expected_reason)
    for job_id_, reason in expected_reason.items():
        assert failed[job_id_].error.startswith(f"damaged: {reason}"), failed[job_id_].error
    # An unreadable id: moved whole to the quarantine (no lease could name it), reported once.
    entries = served.quarantined[TASKS]
    assert len(entries) == 2
    assert {entry.reason for entry in entries} == {
        "id: BLOB b'\\xff\\xfe', not UTF-8 TEXT",
        "id: TEXT b'\\xffA', not UTF-8 TEXT",
    }
    # Every stored field as an SQL literal, then the data as stored.
    raws = sorted(entry.raw for entry in entries)
    assert raws[0].startswith(b"id='\xffA' priority=0 attempts=0 stalled_count=0 stalls='[]'")
    assert raws[1].startswith(b"id=X'FFFE' priority=0 attempts=0 stalled_count=0 stalls='[]'")
    assert all(b" data={" in raw and b'"stepId":"s' in raw for raw in raws)
    assert all(entry.queue == TASKS and entry.at > 0 for entry in entries)
    assert len(served.damaged) == len(expected_reason) + 2
    served.assert_only_damage_reported()
    assert left_on(path, TASKS) == {"failed": len(expected_reason), "quarantine": 2}
    assert len(expected_reason) + 2 + len(served.tasks) == count


async def test_failed_jobs_lists_damaged_failed_rows(tmp_path: Path) -> None:
    """Finding 5: ``failed_jobs()`` crashed on a failed row it could not read."""
    path = tmp_path / "d.db"
    async with dt.open_backend(url(path)):
        pass
    rows: list[tuple[object, ...]] = [
        # id, data, error, failed_at, attempts, stalled_count, stalls
        ("a", 300_000_000, "boom", 1.0, 0, 0, "[]"),
        ("b", b"{}", None, "yesterday", -2, 0.5, "{junk"),
        (b"\xff", "text data", "boom", 2.0, 0, 0, '[{"at": 1, "worker": "w"}]'),
        ("d", b"x", "damaged: data: INTEGER 3, not BLOB or TEXT", 3.0, 0, 0, "[]"),
    ]
    for seq, row in enumerate(rows, start=1):
        sql(
            path,
            "INSERT INTO dt_jobs (queue, id, data, error, failed_at, attempts, stalled_count,"
            " stalls, priority, seq, state) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, ?, 'failed')",
            (TASKS, *row, seq),
        )
    async with dt.open_backend(url(path)) as backend:
        broker = backend.broker
        assert isinstance(broker, SqliteBroker)
        listed = await broker.failed_jobs(TASKS)
    by_id = {job.id: job for job in listed}
    assert [job.id for job in listed] == ["d", "\ufffd", "b", "a"]  # newest first
    assert by_id["a"].data == b"300000000"
    assert by_id["a"].error == "boom [unreadable: data: INTEGER 300000000, not BLOB or TEXT]"
    assert by_id["b"].failed_at == 0.0
    assert (by_id["b"].attempts, by_id["b"].stalled_count, by_id["b"].stalls) == (0, 0, ())
    assert by_id["b"].error.startswith("[unreadable: error: NULL, not TEXT; failed_at: TEXT")
    assert "stalls: TEXT '{junk'" in by_id["b"].error
    assert by_id["\ufffd"].data == b"text data"
    assert by_id["\ufffd"].stalls == (dt.brokers.Stall(at=1.0, worker="w"),)
    assert by_id["d"].error == "damaged: data: INTEGER 3, not BLOB or TEXT"  # nothing to add


async def test_the_sweep_and_renewals_read_claims_through_the_same_checks(tmp_path: Path) -> None:
    """Finding 6: the reclaim sweep (and a renewal) on damaged claims of dead workers."""
    path = tmp_path / "d.db"
    await fill(path, range(7))
    claims = [pk_of(path, TASKS, f"s{n}") for n in range(6)]
    for pk in claims:  # claimed long ago by a worker that is gone
        sql(
            path,
            "UPDATE dt_jobs SET state = 'active', token = ?, claimed_at = 1.0, worker = 'gone'"
            " WHERE pk = ?",
            (f"dead-{pk}", pk),
        )
    junk_stalls, text_claimed_at, bad_worker, bad_id, never_old, _good = claims
    damage(path, junk_stalls, "stalls", "[oops")
    damage(path, text_claimed_at, "claimed_at", "a while ago")  # never looked old enough
    damage(path, bad_worker, "worker", b"\x00")
    damage(path, bad_id, "id", b"\xff")
    damage(path, never_old, "claimed_at", math.inf)
    ids = {pk: job_id(path, pk) for pk in (junk_stalls, text_claimed_at, bad_worker, never_old)}
    renew_id = ids[junk_stalls]

    async def renew(broker: SqliteBroker) -> None:
        # A renewal reads no stored field: it refreshes a damaged claim like any other.
        outcome = await broker.renew_jobs(TASKS, [Lease(renew_id, f"dead-{junk_stalls}")])
        assert outcome.renewed == 1

    served = await serve(path, sweep=True, results=True, before=renew)

    # The good stalled claim came back and was served; s6 was never claimed.
    assert served.tasks == {"s5": 1, "s6": 1}
    failed = failed_by_id(served)
    assert failed[ids[junk_stalls]].error.startswith("damaged: stalls: TEXT '[oops'")
    assert failed[ids[text_claimed_at]].error.startswith("damaged: claimed_at: TEXT")
    assert failed[ids[bad_worker]].error.startswith("damaged: worker: BLOB")
    assert failed[ids[never_old]].error.startswith("damaged: claimed_at: REAL inf")
    assert len(failed) == 4
    (entry,) = served.quarantined[TASKS]
    assert entry.raw.startswith(b"id=X'FF'")
    # The damaged step tasks whose envelope still names their step got a retryable answer, so
    # their runs go on; and every result reached the engine side once.
    assert served.results == {"s0": 1, "s1": 1, "s2": 1, "s4": 1, "s5": 1, "s6": 1}
    assert len(served.damaged) == 5
    served.assert_only_damage_reported()


async def test_damaged_results_are_set_aside_and_the_engine_side_keeps_consuming(
    tmp_path: Path,
) -> None:
    """Finding 6: the engine-side queues go through the same checks (results here)."""
    path = tmp_path / "d.db"
    await fill(path, range(2), results=range(5))
    as_int = pk_of(path, RESULTS, "r0")
    junk = pk_of(path, RESULTS, "r1")
    bad_id = pk_of(path, RESULTS, "r2")
    damage(path, as_int, "data", 42)
    damage(path, junk, "stalls", "]")
    damage(path, bad_id, "id", b"\x80")
    ids = {job_id(path, as_int), job_id(path, junk)}

    served = await serve(path, results=True)

    assert served.tasks == {"s0": 1, "s1": 1}
    assert served.results == {"r3": 1, "r4": 1, "s0": 1, "s1": 1}
    assert set(failed_by_id(served, RESULTS)) == ids
    assert len(served.quarantined[RESULTS]) == 1
    assert len(served.damaged) == 3
    served.assert_only_damage_reported()


async def test_restarts_on_a_damaged_file_serve_everything_else(tmp_path: Path) -> None:
    """A worker started on a file that already holds damaged rows serves everything else, at
    every restart; each damaged row is set aside once, at the first."""
    path = tmp_path / "d.db"
    await fill(path, range(6))
    damage(path, pk_of(path, TASKS, "s0"), "data", "not json at all")  # bad input, not damage
    damage(path, pk_of(path, TASKS, "s1"), "data", 10**13)
    damage(path, pk_of(path, TASKS, "s2"), "stalls", "{")
    damage(path, pk_of(path, TASKS, "s3"), "id", b"\xff")
    damage(path, pk_of(path, TASKS, "s4"), "priority", "first")
    first = await serve(path)
    assert first.tasks == {"s5": 1}
    assert len(first.failed[TASKS]) == 4
    assert len(first.quarantined[TASKS]) == 1
    assert len(first.damaged) == 4
    assert left_on(path, TASKS) == {"failed": 4, "quarantine": 1}
    for restart in range(3):
        # More good jobs, and one more damaged row, each time.
        start = 10 * (restart + 1)
        await fill(path, range(start, start + 3))
        damage(path, pk_of(path, TASKS, f"s{start}"), "attempts", "many")
        again = await serve(path)
        assert again.tasks == {f"s{start + 1}": 1, f"s{start + 2}": 1}
        assert len(again.damaged) == 1  # only the new one: nothing set aside twice
        again.assert_only_damage_reported()
        assert len(again.failed[TASKS]) == 5 + restart
        assert len(again.quarantined[TASKS]) == 1
        assert left_on(path, TASKS) == {"failed": 5 + restart, "quarantine": 1}


# ------------------------------------------------------------------------------ property


class BadText(bytes):
    """Bytes to store as TEXT as they are (not valid UTF-8, as another program may write)."""


STORED_VALUES = st.one_of(
    st.binary(max_size=24),
    st.text(st.characters(exclude_categories=["Cs"]), max_size=24),
    st.binary(min_size=1, max_size=8).map(lambda b: BadText(b"\xff" + b)),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([300_000_000, 10**13, 2**53, -1, 0]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
)
COLUMNS = [
    "id",
    "data",
    "priority",
    "attempts",
    "stalled_count",
    "stalls",
    "worker",
    "seq",
    "token",
    "claimed_at",
    "failed_at",
    "error",
    "pushed_at",
]
DAMAGES = st.lists(
    st.tuples(st.sampled_from([TASKS, RESULTS]), st.sampled_from(COLUMNS), STORED_VALUES),
    min_size=1,
    max_size=4,
)


def must_be_set_aside(column: str, kind: bytes, value: object) -> bool:
    """Whether the broker must hand this row over as damaged (or quarantine it), from the
    value as SQLite stored it (``kind``: its ``typeof``). Other damage may still make the job
    fail (bad input), which the accounting covers."""
    if column == "data":
        return kind in (b"integer", b"real", b"null")
    if column == "id":
        return kind != b"text" or not _utf8(value)
    if column == "priority":
        return kind != b"integer"
    if column in ("attempts", "stalled_count"):
        return kind != b"integer" or not 0 <= int(value) < 2**53  # type: ignore[call-overload]
    if column == "error":
        return kind != b"null"
    return False


def _utf8(value: object) -> bool:
    try:
        bytes(value).decode()  # type: ignore[call-overload]
    except UnicodeDecodeError:
        return False
    return True


_files = itertools.count()


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(damages=DAMAGES)
def test_property_any_stored_value_in_any_column(
    tmp_path: Path, damages: list[tuple[str, str, object]]
) -> None:
    """Arbitrary values of every storage class in every field of task and result rows: the
    worker and the engine-side consumer survive, every good job is served once, every other
    row is served once, failed once or quarantined once; nothing is left pending or lost."""
    path = tmp_path / f"p{next(_files)}.db"
    tasks, results = 4, 3
    trio.run(fill, path, range(tasks), range(tasks, tasks + results))
    rows = {
        TASKS: [pk_of(path, TASKS, f"s{n}") for n in range(tasks)],
        RESULTS: [pk_of(path, RESULTS, f"r{n}") for n in range(tasks, tasks + results)],
    }
    verdicts: dict[tuple[int, str], bool] = {}  # (row, column) -> must be set aside
    for n, (queue, column, value) in enumerate(damages):
        pk = rows[queue][n % len(rows[queue])]
        placeholder = "CAST(? AS TEXT)" if isinstance(value, BadText) else "?"
        try:
            sql(path, f"UPDATE dt_jobs SET {column} = {placeholder} WHERE pk = ?", (value, pk))
        except (sqlite3.IntegrityError, OverflowError):
            continue  # the schema refused it: never stored
        ((kind, stored),) = sql(
            path, f"SELECT typeof({column}), {column} FROM dt_jobs WHERE pk = ?", (pk,)
        )
        verdicts[pk, column] = must_be_set_aside(column, kind, stored)  # (the last write wins)
    touched: dict[int, bool] = {}  # row -> must be set aside
    for (pk, _), verdict in verdicts.items():
        touched[pk] = touched.get(pk, False) or verdict

    served = trio.run(partial(serve, path, results=True))

    served.assert_only_damage_reported()
    failed = {q: served.failed[q] for q in (TASKS, RESULTS)}
    quarantined = {q: served.quarantined[q] for q in (TASKS, RESULTS)}
    # Every untouched task is served exactly once, and its result consumed once.
    for n, pk in enumerate(rows[TASKS]):
        if pk not in touched:
            assert served.tasks[f"s{n}"] == 1
            assert served.results[f"s{n}"] == 1
    for n, pk in zip(range(tasks, tasks + results), rows[RESULTS], strict=True):
        if pk not in touched:
            assert served.results[f"r{n}"] == 1
    # Nothing served twice (no loop), nothing lost: each touched row is served, failed or
    # quarantined, once (a served task also leaves its result behind, consumed).
    assert all(count == 1 for count in served.tasks.values())
    assert all(count == 1 for count in served.results.values())
    set_aside = sum(len(failed[q]) + len(quarantined[q]) for q in (TASKS, RESULTS))
    consumed = len(served.tasks) + sum(1 for step in served.results if step.startswith("r"))
    assert consumed + set_aside == tasks + results
    # Every row that had to be set aside was, as damaged (never run) or quarantined; each
    # damaged or quarantined row was reported once.
    quarantined_total = sum(len(quarantined[q]) for q in quarantined)
    gone = 0
    for pk, must in touched.items():
        if not must:
            continue
        if pk in rows[TASKS]:
            assert served.tasks[f"s{rows[TASKS].index(pk)}"] == 0
        found = sql(path, "SELECT state, error FROM dt_jobs WHERE pk = ?", (pk,))
        if not found:
            gone += 1  # quarantined (a damaged claim is never completed)
            continue
        ((state, error),) = found
        assert state == b"failed"
        assert error.startswith(b"damaged: ")
    assert gone <= quarantined_total
    damaged_failed = sum(
        job.error.startswith("damaged:") for q in (TASKS, RESULTS) for job in failed[q]
    )
    assert len(served.damaged) == damaged_failed + quarantined_total
    # Rows left: the failed ones (completed jobs are deleted) plus the quarantine.
    assert total_rows(path) == set_aside
