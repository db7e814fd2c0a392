"""Stored strings reach the terminal visible, never interpreted: a run id, a workflow and a
step name, an error, a queue name and a worker id holding ESC sequences, BEL, CR, LF, a C1
control, DEL and a bidi override, written into a real SQLite store by a real engine, worker
and broker; every command that prints them (``runs list | show | signal | retry | cancel``,
``jobs failed | requeue | delete``, ``queues``, ``schedules list``, ``health``) prints no
control character but its line ends, and ``--json`` stays the exact values."""

from __future__ import annotations

import io
import json
import logging
import unicodedata
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from durable_trio._engine._schedules import Schedule
from durable_trio._logs import get_logger
from durable_trio._naming import QueueNames
from durable_trio._terminal import visible
from durable_trio.brokers import Job
from durable_trio.cli._main import main

if TYPE_CHECKING:
    from pathlib import Path

#: Sets the terminal's title, rings, clears the screen, forges a row, a C1 CSI, DEL, and a
#: right-to-left override.
EVIL = "\x1b]0;pwned\x07\x1b[2J\r\nforged  row\x9b31m\x7f\u202eevil"
RUN = f"run{EVIL}"
WORKFLOW = f"wf{EVIL}"
STEP = f"charge{EVIL}"
WORKER = f"w{EVIL}"
QUEUE = f"shop:tasks:q{EVIL}"
JOB = f"job{EVIL}"
SCHEDULE = f"nightly{EVIL}"


def test_visible_spells_out_controls_and_keeps_ordinary_text() -> None:
    assert visible("order-42 · café ✓ 東京 🙂 a\\b") == "order-42 · café ✓ 東京 🙂 a\\b"
    assert visible("a\x1b[2Jb\x07\r\n\t\x00\x7f\x9b") == "a\\x1b[2Jb\\x07\\r\\n\\t\\x00\\x7f\\x9b"
    assert visible("\u202eabc\u2066\u200b\ufeff") == "\\u202eabc\\u2066\\u200b\\ufeff"
    assert visible("line\u2028para\u2029") == "line\\u2028para\\u2029"
    assert visible("\U000e0041") == "\\U000e0041"  # a tag character (Cf)
    assert visible("lone \ud800") == "lone \\ud800"  # would not even encode to UTF-8
    assert visible("no\u00a0break") == "no\u00a0break"  # a space, not a control
    assert visible(visible(EVIL)) == visible(EVIL)


def _inert(text: str) -> bool:
    """No character a terminal acts on, but the line ends of the output itself."""
    return not any(
        unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp", "Cs") for c in text.replace("\n", "")
    )


def _app() -> dt.App:
    app = dt.App("shop")

    @app.step(STEP, retry=dt.Retry(max_attempts=1))
    async def charge(value: Any) -> Any:
        raise ValueError(f"declined {EVIL}")

    @app.workflow(WORKFLOW)
    async def order(ctx: dt.WorkflowContext, value: Any) -> Any:
        return await ctx.step(STEP, value)

    return app


async def _populate(url: str) -> None:
    app = _app()
    async with dt.open_backend(url) as backend:
        async with (
            dt.open_worker(app, backend, instance_id=WORKER),
            dt.open_engine(app, backend) as engine,
        ):
            await engine.start(WORKFLOW, {"note": EVIL}, run_id=RUN)
            with pytest.raises(dt.RunFailed):
                await engine.result(RUN)
        broker: Any = backend.broker
        await broker.push_on(QUEUE, Job(JOB, b'{"kind": "task"}'))
        claimed = await broker.pop_from(QUEUE, worker=WORKER)
        assert await broker.fail_job(claimed.lease, QUEUE, f"poison {EVIL}")
        async with dt.open_operations(backend, namespace="shop") as ops:
            fine = Schedule.make("ok", WORKFLOW, every=60.0, created_at=0.0)
            assert await ops.store.put_schedule("ok", fine.dumps(), replace=False)
            # a name the CLI would refuse, as an older or foreign writer could have stored it
            assert await ops.store.put_schedule(SCHEDULE, "{damaged", replace=False)


async def test_the_logs_print_stored_strings_inert(tmp_path: Path) -> None:
    """What the package logs while the run above fails (its step's attempt raising an error
    whose message holds the sequences, for a run, a step and a worker named with them) reaches
    a plain handler inert: ``durable-trio worker`` writes these lines to its terminal."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    package = logging.getLogger("durable_trio")
    level = package.level
    root.addHandler(handler)
    package.setLevel(logging.DEBUG)
    try:
        await _populate(f"sqlite:///{tmp_path / 'evil.db'}")
    finally:
        root.removeHandler(handler)
        package.setLevel(level)
    text = out.getvalue()
    assert "declined" in text  # the step's failure was logged, with its traceback
    assert "Traceback" in text
    assert visible(RUN) in text
    assert _inert(text), text


def test_a_child_logger_and_an_exception_text_are_made_visible() -> None:
    """Any logger of the package (a child too): the message and the exception's text spelled
    out, the line breaks of the exception's text kept; an ordinary record left as it was."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger = get_logger("durable_trio.redis")
    logger.addHandler(handler)
    try:
        try:
            raise ValueError(f"bad {EVIL}")
        except ValueError:
            logger.exception("job %s failed", JOB)
        logger.warning("plain %s", "words")
    finally:
        logger.removeHandler(handler)
    lines = out.getvalue().split("\n")
    assert lines[0] == f"job {visible(JOB)} failed"
    assert lines[1] == "Traceback (most recent call last):"
    # (an error's message keeps its line breaks, as a multi-line message from PostgreSQL does;
    # every other control character in it is spelled out)
    evil_lines = [visible(line) for line in f"ValueError: bad {EVIL}".split("\n")]
    at = lines.index(evil_lines[0])
    assert lines[at : at + len(evil_lines)] == evil_lines
    assert lines[-2:] == ["plain words", ""]
    assert _inert(out.getvalue())


def test_an_ordinary_record_is_left_to_the_formatter() -> None:
    """A record with nothing to spell out is not touched: its message and arguments stay, and
    its traceback is left for the handler's own formatter to write (none written ahead)."""
    records: list[tuple[logging.LogRecord, str | None]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append((record, record.exc_text))  # (before any other handler formats it)

    handler = Keep()
    logger = get_logger("durable_trio")
    logger.addHandler(handler)
    try:
        try:
            raise ValueError("plain\nand multi-line")
        except ValueError:
            logger.exception("job %s failed", "j1")
    finally:
        logger.removeHandler(handler)
    [(record, exc_text)] = records
    assert (record.msg, record.args) == ("job %s failed", ("j1",))
    assert exc_text is None


async def test_every_command_prints_stored_strings_inert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'evil.db'}"
    await _populate(url)
    common = ["--backend", url, "--namespace", "shop"]

    async def run(*argv: str, json_out: bool = False) -> tuple[int, str]:
        def call() -> tuple[int, str]:
            status = main([*argv, *common, *(["--json"] if json_out else [])])
            return status, capsys.readouterr().out

        status, out = await trio.to_thread.run_sync(call)
        if not json_out:
            assert _inert(out), (argv, out)
        return status, out

    status, out = await run("runs", "list")
    assert status == 0
    assert len(out.splitlines()) == 2  # the header and the one run: no forged row
    assert visible(RUN) in out
    assert visible(WORKFLOW) in out
    status, out = await run("runs", "list", json_out=True)
    (listed,) = json.loads(out)["runs"]
    assert (listed["runId"], listed["workflow"]) == (RUN, WORKFLOW)

    status, out = await run("runs", "show", RUN)
    assert status == 0
    for shown in (RUN, WORKFLOW, STEP, WORKER):
        assert visible(shown) in out, shown
    assert visible(f"ValueError: declined {EVIL}")[:50] in out  # (shortened to its column)
    status, out = await run("runs", "show", RUN, json_out=True)
    details = json.loads(out)
    assert (details["runId"], details["workflow"]) == (RUN, WORKFLOW)
    assert details["steps"][0]["name"] == STEP
    assert details["steps"][0]["attempts"][0]["worker"] == WORKER

    status, out = await run("jobs", "failed")
    assert status == 0
    assert visible(QUEUE) in out
    assert visible(JOB) in out
    assert len([line for line in out.splitlines() if "job" in line]) == 2  # header and JOB
    status, out = await run("jobs", "failed", json_out=True)
    assert [(j["queue"], j["id"]) for j in json.loads(out) if j["id"] == JOB] == [(QUEUE, JOB)]

    status, out = await run("queues")
    assert status == 0
    assert visible(QUEUE) in out
    status, out = await run("queues", json_out=True)
    assert QUEUE in [q["queue"] for q in json.loads(out)]

    status, out = await run("schedules", "list")
    assert status == 0
    assert visible(SCHEDULE) in out
    assert visible(WORKFLOW) in out
    assert len(out.splitlines()) == 3  # the header, "ok" and the damaged one
    status, out = await run("schedules", "list", json_out=True)
    assert {s["name"] for s in json.loads(out)} == {"ok", SCHEDULE}

    # the action messages, which repeat the ids they were given
    status, out = await run("runs", "retry", RUN)
    assert status == 0
    assert out == f"run {visible(RUN)} reopened (pending): a live engine resumes it\n"
    status, out = await run("runs", "signal", RUN, f"go{EVIL}", '"x"')
    assert status == 0
    assert visible(RUN) in out
    status, out = await run("runs", "cancel", RUN, "--grace", "0")
    assert (status, out) == (0, f"run {visible(RUN)} cancelled\n")
    status, out = await run("runs", "cancel", RUN)
    assert status == 1
    assert visible(RUN) in out
    status, out = await run("jobs", "requeue", QUEUE, JOB)
    assert (status, out) == (0, f"job {visible(JOB)} requeued\n")
    status, out = await run("jobs", "delete", QUEUE, JOB)
    assert (status, out) == (1, f"job {visible(JOB)} is not failed on {visible(QUEUE)}\n")

    # runs prune (issue 34): the run is cancelled, so finished
    await trio.sleep(0.01)
    status, out = await run("runs", "prune", "--older-than", "0.001", "--workflow", WORKFLOW,
                            "--dry-run")  # fmt: skip
    assert status == 0
    assert out.startswith(f"would delete 1 finished run of workflow {visible(WORKFLOW)} ")
    status, out = await run("runs", "prune", "--older-than", "0.001", "--workflow", WORKFLOW)
    assert status == 2  # not a terminal to ask: --yes or --dry-run
    status, out = await run("runs", "prune", "--older-than", "0.001", "--workflow", WORKFLOW,
                            "--yes")  # fmt: skip
    assert status == 0
    assert out.startswith(f"deleted 1 finished run of workflow {visible(WORKFLOW)} ")
    status, out = await run("runs", "prune", "--older-than", "1s", "--yes", json_out=True)
    assert json.loads(out)["count"] == 0
    status, out = await run("runs", "list")
    assert out == "no runs\n"


async def _forged_worker_key(backend: dt.Backend, group: str, instance: str) -> None:
    """A liveness key whose group and instance hold what a real worker's never do (it
    sanitizes them), as a foreign or damaged writer of the key store could leave it."""
    keys = backend.keys
    assert keys is not None
    marker = QueueNames("shop").worker_heartbeat("", "").removesuffix(":")
    (real, *_) = await keys.entries(marker)
    await keys.put(f"{marker}{group}:{instance}", real.value, 60.0)


async def test_health_prints_group_names_and_worker_ids_inert(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from durable_trio.cli._health import HealthReader, render_text

    async with dt.open_backend("memory://") as backend:
        async with dt.open_worker(_app(), backend, instance_id="w1"):
            await trio.sleep(0.1)
            await _forged_worker_key(backend, f"g{EVIL}", WORKER)
            out = render_text(await HealthReader(backend, "shop").read(), "shop")
    assert _inert(out), out
    assert visible(WORKER) in out
    assert visible(f"g{EVIL}") in out


async def test_the_live_table_prints_worker_ids_inert_and_without_markup(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``health --watch`` draws with rich: a worker id is neither a control nor markup."""
    pytest.importorskip("rich")
    from rich.console import Console

    from durable_trio.cli._health import watch

    marked = f"w[bold]{EVIL}[/bold][link=evil.example]x[/link]"
    screen = io.StringIO()
    async with dt.open_backend("memory://") as backend:
        async with dt.open_worker(_app(), backend, instance_id="w1"):
            await trio.sleep(0.1)
            await _forged_worker_key(backend, "g", marked)
            console = Console(file=screen, width=400, force_terminal=False)
            await watch(backend, "shop", iterations=1, console=console)
    out = screen.getvalue()
    assert _inert(out), out
    assert visible(marked) in out
