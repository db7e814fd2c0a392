"""The console's views (issue 30, items 11-12), in-process over a memory backend holding real
runs: a cancelled run's history (its interrupted step, the cancel event, cancelled not red),
step inputs and outputs, the schedules page and its actions, the engines the run store knows,
starting a run and sending a signal, the run of a set-aside job, times labelled with their
zone. And ``durable-trio runs show`` of a cancelled run on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio

import durable_trio as dt
from durable_trio._engine._cancel import mark_in_store
from durable_trio._engine._records import RunRecord, RunStatus, StepKind, StepRecord, StepState
from durable_trio._engine._schedules import Schedules
from durable_trio.cli._main import main
from durable_trio.cli._operations import _time
from durable_trio.console import create_app
from durable_trio.console._html import VALUE_LIMIT, stamp
from helpers import set_aside_by_stalls

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytest.importorskip("starlette")

ACTION = {"X-Durable-Console": "action"}
STATIC = Path(dt.__file__).parent / "console" / "static"


def _app(seen: dict[str, Any]) -> dt.App:
    app = dt.App("shop")

    @app.step("pack")
    async def pack(x: Any) -> Any:
        seen["packing"].set()
        await trio.sleep(3600)  # cancelled with its run
        return x

    @app.step("unpack")
    async def unpack(x: Any) -> str:
        return "unpacked"

    @app.step("echo")
    async def echo(x: Any) -> Any:
        return x

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, x: Any) -> Any:
        try:
            return await ctx.step("pack", x)
        except dt.RunCancelled:
            await ctx.step("unpack", x)  # compensation
            raise

    @app.workflow("echo")
    async def echo_flow(ctx: dt.WorkflowContext, x: Any) -> Any:
        return await ctx.step("echo", x)

    @app.workflow("approval")
    async def approval(ctx: dt.WorkflowContext, x: Any) -> Any:
        return await ctx.wait_signal("approve")

    return app


@pytest.fixture
async def world(autojump_clock: trio.testing.MockClock) -> AsyncIterator[dict[str, Any]]:
    """A run cancelled by the operator while its step ``pack`` ran on a worker (the engine
    delivered RunCancelled, the workflow compensated with ``unpack``), and a completed run
    whose step has a large input."""
    seen: dict[str, Any] = {"packing": trio.Event()}
    app = _app(seen)
    async with (
        dt.open_backend("memory://") as backend,
        dt.open_worker(app, backend, instance_id="worker-a"),
        dt.open_engine(app, backend, engine_id="engine-1", reconcile_interval=1.0) as engine,
        dt.open_operations(backend, namespace="shop") as ops,
    ):
        await engine.start("order", {"sku": "x"}, run_id="cut")
        await seen["packing"].wait()
        assert await ops.cancel_run("cut", reason="customer changed their mind")
        await engine.start("echo", {"rows": "y" * (2 * VALUE_LIMIT)}, run_id="big")
        await engine.result("big")
        yield {"ops": ops, "engine": engine, "backend": backend}


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


def _row(page: str, css: str, key: str) -> str:
    """The ``<tr class="{css}...">`` whose first cell is ``key``."""
    found = re.search(
        rf'<tr class="{css}[^"]*"><td class="mono">{re.escape(key)}</td>(.*?)</tr>', page
    )
    assert found is not None, f"no {css} row {key!r}"
    return found[1]


async def test_a_cancelled_runs_pending_step_is_shown_interrupted(world: dict[str, Any]) -> None:
    ops = world["ops"]
    details = await ops.show_run("cut")
    assert details.run.status is dt.RunStatus.CANCELLED
    pack, mark, unpack = (
        next(s for s in details.steps if s.name == name) for name in ("pack", "cancel", "unpack")
    )
    # the store keeps the step as the run left it: pending
    stored = await ops.store.get_step("cut", pack.step_id)
    assert stored.status is StepState.PENDING
    assert pack.status is StepState.PENDING
    assert pack.interrupted
    assert pack.shown_status == "interrupted"
    assert [a.status for a in pack.attempts] == ["interrupted"]
    assert pack.to_json()["interrupted"] is True
    assert pack.to_json()["attempts"][0]["status"] == "interrupted"
    assert mark.cancel_mark
    assert mark.kind is StepKind.CANCEL
    assert not unpack.interrupted
    assert unpack.shown_status == "completed"


async def test_the_run_page_shows_the_interrupted_step_and_the_cancel_event(
    world: dict[str, Any],
) -> None:
    async with client(create_app(world["ops"])) as http:
        page = (await http.get("/runs/cut")).text
    assert '<h1>Run <span class="mono">cut</span> <span class="badge badge-cancelled">' in page
    pack = _row(page, "step", "1")
    assert "badge-interrupted" in pack
    assert "badge-running" not in pack
    assert "badge-pending" not in pack
    assert 'class="step interrupted"' in page
    # the attempt of the interrupted step: interrupted, not running
    attempt = page.split('<tr class="step interrupted">', 1)[1].split('<tr class="attempt">')[1]
    assert "badge-interrupted" in attempt.split("</tr>")[0]
    event = _row(page, "event cancel-event", "cancel:run")
    assert "badge-cancel_requested" in event
    assert "cancel requested" in event
    assert "customer changed their mind" in event
    assert "interrupting step 1 (pack)" in event
    assert "badge-completed" not in event
    # the event sits after the step it interrupted, before the compensation it started
    assert page.index("cancel-event") < page.index("<b>unpack</b>")
    assert page.index("<b>pack</b>") < page.index("cancel-event")
    # why it was cancelled: not in the red of an error, here nor on the runs page
    async with client(create_app(world["ops"])) as http:
        runs = (await http.get("/runs")).text
    assert '<td class="cancel-text">customer changed their mind</td>' in runs
    assert "<h2>Why it was cancelled</h2>" in page
    assert '<p class="cancel-text">RunCancelled: customer changed their mind</p>' in page


def _rule(css: str, selector: str) -> str:
    found = re.search(rf"(?m)^[^{{}}]*{re.escape(selector)}\b[^{{]*\{{([^}}]*)\}}", css)
    assert found is not None, selector
    return found[1]


def test_cancelled_is_not_in_the_red_of_failed() -> None:
    css = (STATIC / "console.css").read_text()
    assert "var(--bad)" in _rule(css, ".badge-failed")
    cancelled = _rule(css, ".badge-cancelled")
    assert "var(--bad)" not in cancelled
    assert "var(--cancel)" in cancelled
    assert "var(--bad)" not in _rule(css, ".badge-interrupted")


async def test_a_steps_input_and_output_are_folded_cut_and_linked(world: dict[str, Any]) -> None:
    async with client(create_app(world["ops"])) as http:
        page = (await http.get("/runs/big")).text
        assert '<details data-key="io-1"><summary>input · output</summary>' in page
        link = "/raw/run?id=big&step=1&value=input"
        assert f'href="{link.replace("&", "&amp;")}"' in page
        assert f"shown: the first {VALUE_LIMIT:,} of " in page
        # the run's input and output and the step's (each 128 KiB), each cut at 64 KiB
        assert len(page) < 5 * VALUE_LIMIT
        whole = await http.get(link)
        assert whole.status_code == 200
        assert whole.json() == {"rows": "y" * (2 * VALUE_LIMIT)}
        output = await http.get("/raw/run", params={"id": "big", "step": "1", "value": "output"})
        assert output.json() == whole.json()
        missing = await http.get("/raw/run", params={"id": "big", "step": "9", "value": "input"})
        assert missing.status_code == 404
        assert "no step '9'" in missing.json()["message"]
        which = await http.get("/raw/run", params={"id": "big", "step": "1"})
        assert which.status_code == 400
        # a failed step shows its error, folded with its input
        page = (await http.get("/runs/cut")).text
        assert '<details data-key="io-1"><summary>input</summary>' in page
        assert '<details data-key="io-2"><summary>input · output</summary>' in page
        assert "&quot;unpacked&quot;" in page or '"unpacked"' in page


async def test_the_step_values_of_a_page_share_a_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A run of many steps with large values: past STEP_VALUES_BUDGET a step's values are
    linked, not shown, so the page stays bounded."""
    from durable_trio.console._run_view import STEP_VALUES_BUDGET

    async with (
        dt.open_backend("memory://") as backend,
        dt.open_operations(backend, namespace="shop") as ops,
    ):
        store = ops.store
        now = store.now()
        await store.create_run(RunRecord("many", "w", None, RunStatus.RUNNING, now, now))
        big = "z" * VALUE_LIMIT
        for n in range(1, 41):
            await store.begin_step(
                StepRecord("many", str(n), StepKind.LOCAL, f"s{n}", StepState.PENDING, input=big)
            )
        async with client(create_app(ops)) as http:
            page = (await http.get("/runs/many")).text
    assert STEP_VALUES_BUDGET < len(page) < STEP_VALUES_BUDGET + 40 * 4096
    assert page.count("not shown: this page already shows its share of step values") > 20
    assert 'href="/raw/run?id=many&amp;step=40&amp;value=input"' in page


async def test_the_schedules_page_and_its_actions(world: dict[str, Any]) -> None:
    ops = world["ops"]
    schedules = Schedules(ops.store, time.time)
    assert await schedules.add("nightly", "echo", cron="0 3 * * *", input={"n": 1})
    assert await schedules.add("often", "echo", every=90)
    assert await schedules.pause("often")
    async with client(create_app(ops)) as http:
        page = (await http.get("/schedules")).text
        assert 'aria-current="page">Schedules' in page
        nightly = page.split('data-schedule="nightly">', 1)[1].split("</tr>")[0]
        assert "cron 0 3 * * * (UTC)" in nightly
        assert "badge-active" in nightly
        assert re.search(r"<time [^>]*>\d{4}-\d\d-\d\d 03:00:00 UTC</time>", nightly)
        assert "&quot;n&quot;: 1" in nightly or '"n": 1' in nightly
        often = page.split('data-schedule="often">', 1)[1].split("</tr>")[0]
        assert "every 90 s" in often
        assert "badge-paused" in often
        assert 'data-action="resume"' in often
        assert " disabled" in often
        refused = await http.post("/api/schedules/pause", json={"name": "nightly"}, headers=ACTION)
        assert refused.status_code == 403
    async with client(create_app(ops, allow_actions=True)) as http:
        no_header = await http.post("/api/schedules/pause", json={"name": "nightly"})
        assert no_header.status_code == 403
        cross = await http.post(
            "/api/schedules/delete",
            json={"name": "nightly"},
            headers={**ACTION, "Origin": "http://evil.example"},
        )
        assert cross.status_code == 403
        paused = await http.post("/api/schedules/pause", json={"name": "nightly"}, headers=ACTION)
        assert paused.status_code == 200, paused.text
        assert "nightly paused" in paused.json()["message"]
        info = await schedules.get("nightly")
        assert info is not None
        assert info.schedule is not None
        assert info.schedule.paused
        resumed = await http.post("/api/schedules/resume", json={"name": "often"}, headers=ACTION)
        assert resumed.status_code == 200
        info = await schedules.get("often")
        assert info is not None
        assert info.schedule is not None
        assert not info.schedule.paused
        deleted = await http.post("/api/schedules/delete", json={"name": "often"}, headers=ACTION)
        assert deleted.status_code == 200
        assert await schedules.get("often") is None
        again = await http.post("/api/schedules/delete", json={"name": "often"}, headers=ACTION)
        assert again.status_code == 404
        nameless = await http.post("/api/schedules/pause", json={}, headers=ACTION)
        assert nameless.status_code == 400


async def test_the_schedules_page_marks_a_workflow_no_live_engine_runs(
    world: dict[str, Any],
) -> None:
    """As ``schedules list``: the engines' keys say which workflows they run."""
    schedules = Schedules(world["ops"].store, time.time)
    assert await schedules.add("known", "echo", every=90)
    assert await schedules.add("typo", "ecko", every=90)
    async with client(create_app(world["ops"])) as http:
        page = (await http.get("/schedules")).text
    typo = page.split('data-schedule="typo">', 1)[1].split("</tr>")[0]
    assert "badge-unknownworkflow" in typo
    assert "no live engine runs &#x27;ecko&#x27;" in typo or "no live engine runs 'ecko'" in typo
    known = page.split('data-schedule="known">', 1)[1].split("</tr>")[0]
    assert "badge-active" in known
    assert "unknown" not in known


async def test_an_empty_schedules_page_says_how_to_add_one(world: dict[str, Any]) -> None:
    async with client(create_app(world["ops"])) as http:
        page = (await http.get("/schedules")).text
    assert "no schedule in this namespace" in page


async def test_the_workers_page_shows_the_engines_the_run_store_knows(
    world: dict[str, Any],
) -> None:
    engine = world["engine"]
    await engine.start("approval", None, run_id="waits")
    # A run written straight into the store (no wake rung), as a pod or an older client
    # leaves it: pending until an engine's next reconcile.
    await engine.store.create_run(
        RunRecord("later", "approval", None, RunStatus.PENDING, engine.store.now(), 0.0)
    )
    async with client(create_app(world["ops"])) as http:
        page = (await http.get("/workers")).text
    assert "<h2>Engines</h2>" in page
    assert "Engines do not advertise themselves" in page
    row = page.split('<table class="engines">', 1)[1].split("</table>")[0]
    assert '<td class="mono">engine-1</td>' in row
    assert "badge-live" in row
    assert "1 pending run (driven by no engine yet)" in page


async def test_start_a_run_from_the_console(autojump_clock: trio.testing.MockClock) -> None:
    """With no engine, a start is stored pending (as ``run --detach``); an engine that comes
    up takes it over and runs it."""
    app = _app({"packing": trio.Event()})
    async with (
        dt.open_backend("memory://") as backend,
        dt.open_operations(backend, namespace="shop") as ops,
    ):
        async with client(create_app(ops)) as http:
            refused = await http.post(
                "/api/runs/start", json={"workflow": "echo", "input": "1"}, headers=ACTION
            )
            assert refused.status_code == 403
            assert (
                "start run: the console is read-only (start it with --allow-actions)"
                in (await http.get("/runs")).text.lower()
            )
        async with client(create_app(ops, allow_actions=True)) as http:
            runs = (await http.get("/runs")).text
            assert (
                '<form class="action-form" data-action="start" data-url="/api/runs/start">' in runs
            )
            no_header = await http.post("/api/runs/start", json={"workflow": "echo", "input": "1"})
            assert no_header.status_code == 403
            bad = await http.post(
                "/api/runs/start", json={"workflow": "echo", "input": "{oops"}, headers=ACTION
            )
            assert bad.status_code == 400
            assert bad.json()["message"].startswith("the input is not JSON: ")
            nameless = await http.post("/api/runs/start", json={"input": "1"}, headers=ACTION)
            assert nameless.status_code == 400
            started = await http.post(
                "/api/runs/start",
                json={"workflow": "echo", "input": '{"hello": [1, 2]}', "run_id": "mine"},
                headers=ACTION,
            )
            assert started.status_code == 200, started.text
            assert started.json()["location"] == "/runs/mine"
            assert "run mine of 'echo' stored (pending)" in started.json()["message"]
            run = await ops.store.get_run("mine")
            assert run is not None
            assert (run.status, run.owner, run.input) == (
                RunStatus.PENDING,
                None,
                {"hello": [1, 2]},
            )
            taken = await http.post(
                "/api/runs/start", json={"workflow": "echo", "run_id": "mine"}, headers=ACTION
            )
            assert taken.status_code == 409
            assert "exists already" in taken.json()["message"]
            blank = await http.post(
                "/api/runs/start", json={"workflow": "echo", "input": ""}, headers=ACTION
            )
            assert blank.status_code == 200
            blank_id = blank.json()["location"].removeprefix("/runs/")
            blank_run = await ops.store.get_run(blank_id)
            assert blank_run is not None
            assert blank_run.input is None
        async with dt.open_worker(app, backend), dt.open_engine(app, backend) as engine:
            assert await engine.result("mine") == {"hello": [1, 2]}


async def test_a_start_of_a_workflow_no_live_engine_runs_is_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The console's start stored a mistyped workflow (`ordr`) pending, for an engine to fail:
    while engines are live it is checked against their workflows, as `schedules add` is."""
    app = _app({"packing": trio.Event()})
    async with (
        dt.open_backend("memory://") as backend,
        dt.open_operations(backend, namespace="shop") as ops,
        dt.open_engine(app, backend),
        client(create_app(ops, allow_actions=True)) as http,
    ):
        typo = await http.post(
            "/api/runs/start", json={"workflow": "ordr", "input": "1"}, headers=ACTION
        )
        assert typo.status_code == 400
        assert typo.json()["message"] == (
            "no live engine of namespace 'shop' runs workflow 'ordr' (they run: approval, echo, "
            "order): nothing started"
        )
        assert (await ops.list_runs()).runs == []
        known = await http.post(
            "/api/runs/start", json={"workflow": "echo", "input": "1"}, headers=ACTION
        )
        assert known.status_code == 200, known.text


async def test_a_start_with_a_field_it_does_not_take_is_refused_not_dropped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`runId` for `run_id` (and a field no start has) was dropped without a word: the run
    started under a random id. Now a 400 naming the fields, and nothing started."""
    async with (
        dt.open_backend("memory://") as backend,
        dt.open_operations(backend, namespace="shop") as ops,
        client(create_app(ops, allow_actions=True)) as http,
    ):
        typo = await http.post(
            "/api/runs/start",
            json={"workflow": "echo", "input": "1", "runId": "x", "timeout": "abc"},
            headers=ACTION,
        )
        assert typo.status_code == 400
        assert typo.json()["message"] == (
            "unknown fields 'runId', 'timeout': a start takes debounce_delay, "
            "debounce_key, debounce_max_wait, dedup_key, input, run_id, tags, workflow; "
            "nothing started"
        )
        assert (await ops.list_runs()).runs == []
        started = await http.post(
            "/api/runs/start",
            json={"workflow": "echo", "input": "1", "run_id": "x", "tags": ""},
            headers=ACTION,
        )
        assert started.status_code == 200, started.text
        assert [run.run_id for run in (await ops.list_runs()).runs] == ["x"]


async def test_send_a_signal_from_the_console(world: dict[str, Any]) -> None:
    engine = world["engine"]
    await engine.start("approval", None, run_id="waits")
    async with client(create_app(world["ops"])) as http:
        page = (await http.get("/runs/waits")).text
        assert "send signal: the console is read-only (start it with --allow-actions)" in (
            page.lower()
        )
        refused = await http.post(
            "/api/runs/signal", json={"run_id": "waits", "name": "approve"}, headers=ACTION
        )
        assert refused.status_code == 403
    async with client(create_app(world["ops"], allow_actions=True)) as http:
        page = (await http.get("/runs/waits")).text
        assert 'data-action="signal" data-url="/api/runs/signal"' in page
        assert '<input type="hidden" name="run_id" value="waits">' in page
        ended = (await http.get("/runs/cut")).text
        assert 'data-action="signal"' not in ended  # an ended run takes no signal
        bad = await http.post(
            "/api/runs/signal",
            json={"run_id": "waits", "name": "approve", "payload": "[1,"},
            headers=ACTION,
        )
        assert bad.status_code == 400
        assert bad.json()["message"].startswith("the payload is not JSON: ")
        nobody = await http.post(
            "/api/runs/signal", json={"run_id": "nope", "name": "approve"}, headers=ACTION
        )
        assert nobody.status_code == 404
        over = await http.post(
            "/api/runs/signal", json={"run_id": "cut", "name": "approve"}, headers=ACTION
        )
        assert over.status_code == 409
        assert "takes no more signals" in over.json()["message"]
        sent = await http.post(
            "/api/runs/signal",
            json={"run_id": "waits", "name": "approve", "payload": '{"by": "ana"}'},
            headers=ACTION,
        )
        assert sent.status_code == 200, sent.text
        assert sent.json()["message"] == "signal 'approve' #1 sent to run waits"
    assert await engine.result("waits") == {"by": "ana"}


async def test_a_set_aside_job_links_to_its_run(world: dict[str, Any]) -> None:
    ops = world["ops"]
    backend = ops.backend
    async with dt.open_queue_transport(backend, namespace="shop") as producer:
        job = await set_aside_by_stalls(backend.broker, producer, "refund", "kept")
    async with client(create_app(ops)) as http:
        page = (await http.get("/queues")).text
    row = page.split(f'data-job="{job}">', 1)[1].split("</tr>")[0]
    assert '<a class="mono" href="/runs/r">r</a>' in row


def test_times_are_labelled_with_their_zone() -> None:
    assert stamp(1_800_000_000) == (
        '<time datetime="2027-01-15T08:00:00Z">2027-01-15 08:00:00 UTC</time>'
    )
    assert _time(1_800_000_000) == "2027-01-15 08:00:00 UTC"
    assert _time(12.5) == "12.500"  # memory://'s monotonic clock: no zone to tell


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_cli_runs_show_of_a_cancelled_run(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    """A run cancelled while its step was pending (the mark written, then settled): ``runs
    show`` shows the step interrupted, the cancel as a line of its own, times in UTC (SQLite's
    and PostgreSQL's stores keep wall-clock times)."""
    url = f"sqlite:///{tmp_path / 'ops.db'}"
    if kind == "postgres":
        url = str(request.getfixturevalue("postgres_schema_url"))
    async with (
        dt.open_backend(url) as backend,
        dt.open_operations(backend, namespace="shop") as ops,
    ):
        store = ops.store
        now = store.now()
        await store.create_run(RunRecord("c1", "order", 1, RunStatus.PENDING, now, now))
        await store.begin_step(
            StepRecord("c1", "1", StepKind.REMOTE, "pack", StepState.PENDING, input=1)
        )
        await store.begin_step(
            StepRecord("c1", "2", StepKind.TIMER, "sleep", StepState.PENDING, wake_at=now + 60)
        )
        assert await mark_in_store(store, "c1", "stop it")
        error = {"type": "RunCancelled", "message": "stop it"}
        assert await store.finish_run("c1", RunStatus.CANCELLED, error=error)

    def cli(*argv: str) -> tuple[int, str]:
        status = main([*argv, "--backend", url, "--namespace", "shop"])
        return status, capsys.readouterr().out

    status, out = await trio.to_thread.run_sync(lambda: cli("runs", "show", "c1"))
    assert status == 0, out
    assert "status cancelled" in out
    (pack,) = [line for line in out.splitlines() if line.startswith("1 ")]
    assert pack.split()[:5] == ["1", "remote", "pack", "1", "interrupted"]
    assert "running" not in out
    assert re.search(
        r"^cancel requested \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC: stop it, interrupting step 1, 2$",
        out,
        re.M,
    ), out
    assert "cancel:run" not in out  # an event, not a row of the steps table
    (timer,) = [line for line in out.splitlines() if line.startswith("2 ")]
    assert timer.split()[-1] == "interrupted"
    assert re.search(r"created \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", out)
    status, out = await trio.to_thread.run_sync(lambda: cli("runs", "show", "c1", "--json"))
    (step,) = [s for s in json.loads(out)["steps"] if s["stepId"] == "1"]
    data = json.loads(out)
    assert step["status"] == "pending"  # as stored
    assert step["interrupted"] is True
    assert step["attempts"][-1]["status"] == "interrupted"
    assert data["timers"][0]["interrupted"] is True


@pytest.mark.parametrize(
    ("status", "interrupted"),
    [
        (RunStatus.CANCELLED, True),
        (RunStatus.FAILED, True),  # e.g. timed out while the step ran
        (RunStatus.COMPLETED, True),  # it returned without awaiting the step
        (RunStatus.RUNNING, False),
        (RunStatus.BLOCKED, False),  # not over: it resumes with new code
        (RunStatus.PENDING, False),
    ],
)
def test_a_pending_step_is_interrupted_only_once_its_run_has_ended(
    status: RunStatus, interrupted: bool
) -> None:
    from durable_trio._ops_views import details_of

    run = RunRecord("r", "w", None, status, 1.0, 2.0)
    steps = [
        StepRecord("r", "1", StepKind.REMOTE, "a", StepState.PENDING, created_at=1.0),
        StepRecord("r", "2", StepKind.TIMER, "sleep", StepState.PENDING, wake_at=9.0),
        StepRecord("r", "3", StepKind.LOCAL, "b", StepState.COMPLETED, output=1),
    ]
    details = details_of(run, steps, now=2.0)
    pending, done = details.steps
    assert pending.interrupted is interrupted
    assert pending.attempts[-1].status == ("interrupted" if interrupted else "running")
    assert details.timers[0].state == ("interrupted" if interrupted else "waiting")
    assert not done.interrupted
    assert done.shown_status == "completed"


async def test_an_engine_whose_leases_expired_is_shown_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with (
        dt.open_backend("memory://") as backend,
        dt.open_operations(backend, namespace="shop") as ops,
    ):
        store = ops.store
        for run_id in ("a", "b"):
            now = store.now()
            await store.create_run(RunRecord(run_id, "w", None, RunStatus.PENDING, now, now))
            await store.claim_runs("gone-engine", 30.0)
        await trio.sleep(31)  # its leases lapse: it stopped renewing them
        async with client(create_app(ops)) as http:
            page = (await http.get("/workers")).text
    row = page.split('<td class="mono">gone-engine</td>', 1)[1].split("</tr>")[0]
    assert '<td class="num">2</td>' in row
    assert "badge-expired" in row
    assert "badge-live" not in row
