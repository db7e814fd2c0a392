"""What a newcomer met on first contact with the command line (this session's walk through
README.md, docs/getting-started.md and docs/operations.md in an empty folder): each test is one
defect found there, on real files."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import TYPE_CHECKING

import pytest
import trio

import durable_trio as dt
from durable_trio.cli._main import main
from durable_trio.redis import RedisDatabaseRefused, open_redis

if TYPE_CHECKING:
    from pathlib import Path

    from _redis_server import RedisServer


def _store_with_a_run(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'x.db'}"

    async def make() -> None:
        async with dt.open_backend(url) as backend, backend.open_run_store("shop") as store:
            await store.create_run(dt.RunRecord("r-1", "order", 1, dt.RunStatus.PENDING, 0, 0))

    trio.run(make)
    return url


def test_no_schedules_is_a_sentence_not_a_bare_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`schedules list` of a namespace without schedules printed the table's header alone,
    where `runs list`, `queues` and `jobs failed` say so in words."""
    url = _store_with_a_run(tmp_path)
    assert main(["schedules", "list", "--backend", url]) == 0
    assert capsys.readouterr().out == "no schedules in namespace 'shop'\n"
    assert main(["schedules", "list", "--json", "--backend", url]) == 0
    assert capsys.readouterr().out == "[]\n"


def test_prune_counts_one_run_in_the_singular(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`runs prune --dry-run` said `would delete 1 finished runs`."""
    url = f"sqlite:///{tmp_path / 'x.db'}"

    async def make() -> None:
        async with dt.open_backend(url) as backend, backend.open_run_store("shop") as store:
            await store.create_run(dt.RunRecord("r-1", "order", 1, dt.RunStatus.PENDING, 0, 0))
            assert await store.finish_run("r-1", dt.RunStatus.COMPLETED, output=2)

    trio.run(make)
    later = time.time() + 3600  # (the SQLite store's clock is the wall clock: an hour on)
    monkeypatch.setattr(time, "time", lambda: later)
    assert main(["runs", "prune", "--older-than", "1m", "--dry-run", "--backend", url]) == 0
    out = capsys.readouterr().out
    assert out.startswith("would delete 1 finished run that ended before "), out
    assert main(["runs", "prune", "--older-than", "1m", "--yes", "--backend", url]) == 0
    assert capsys.readouterr().out.startswith("deleted 1 finished run that ended before ")


async def test_a_database_number_the_server_refuses_is_said_as_such(
    redis_server: RedisServer,
) -> None:
    """`redis://host:port/99` on a server of 16 databases said "Redis at ... is unavailable
    (ERR DB index is out of range)": an outage, for a wrong URL. It is a ConfigError naming the
    database now, at every try (the client's backoff after the first refusal included)."""
    url = f"redis://127.0.0.1:{redis_server.port}/99"
    async with open_redis(url) as client:
        for _ in range(2):  # the second while the client backs off
            with pytest.raises(RedisDatabaseRefused) as refused:
                await client.execute("PING")
            assert isinstance(refused.value, dt.ConfigError)
            assert str(refused.value) == (
                f"Redis at 127.0.0.1:{redis_server.port} refused database 99 of the backend "
                "URL: ERR DB index is out of range (the /DB after the host must be below the "
                "server's `databases` setting, 16 by default)"
            )
    status, err = await trio.to_thread.run_sync(
        lambda: _cli_status_and_err("runs", "list", "--backend", url)
    )
    assert status == 2
    assert err.splitlines() == [f"error: {refused.value}"]


def _cli_status_and_err(*argv: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "durable_trio", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return done.returncode, done.stderr


@pytest.mark.parametrize(
    ("command", "name"),
    [
        (["runs", "list"], "runs list"),
        (["runs", "show", "r-1"], "runs show"),
        (["runs", "cancel", "r-1"], "runs cancel"),
        (["jobs", "failed"], "jobs failed"),
        (["queues"], "queues"),
        (["schedules", "list"], "schedules list"),
        (["health"], "health"),
        (["console", "--port", "0"], "console"),
    ],
)
def test_an_operator_command_on_memory_is_refused_not_an_empty_store(
    capsys: pytest.CaptureFixture[str], command: list[str], name: str
) -> None:
    """`runs list --backend memory://` said "no runs" (and `health` "no live workers") whatever
    the workers and engines held: the command opened an empty store of its own process."""
    assert main([*command, "--backend", "memory://"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"error: {name}: memory:// is a store of one process, empty in this one: it holds no "
        "other process's runs, jobs or workers; give the URL the workers and engines use "
        "(--backend sqlite:///... or redis://..., or $DURABLE_TRIO_BACKEND)"
    ]


def test_a_detached_run_on_memory_is_refused_not_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`run app:app wf --detach --backend memory://` printed `"status": "pending"` and exit 0
    for a run gone with the process."""
    (tmp_path / "memory_app_mod.py").write_text(
        "import durable_trio as dt\napp = dt.App('shop')\n\n"
        "@app.workflow('wf')\nasync def wf(ctx: dt.WorkflowContext, x: int) -> int:\n"
        "    return x\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    target = "memory_app_mod:app"
    assert main(["run", target, "wf", "1", "--detach", "--backend", "memory://"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "error: run --detach on memory:// records the run in this process's memory, gone when "
        "it exits, before any engine could drive it: give the URL the engines use "
        "(sqlite:///..., redis://...), or leave out --detach"
    ]
    assert main(["run", target, "wf", "1", "--backend", "memory://"]) == 0  # (driven here)
    assert '"output": 1' in capsys.readouterr().out


def test_an_empty_run_id_is_refused_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`run app:app wf --run-id ''` (an unset shell variable) started a run under a new random
    id, which the script that chose the id could then not find."""
    (tmp_path / "empty_id_app_mod.py").write_text(
        "import durable_trio as dt\napp = dt.App('shop')\n\n"
        "@app.workflow('wf')\nasync def wf(ctx: dt.WorkflowContext, x: int) -> int:\n"
        "    return x\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    url = f"sqlite:///{tmp_path / 'x.db'}"
    assert main(["run", "empty_id_app_mod:app", "wf", "1", "--run-id", "", "--backend", url]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "error: run: --run-id must not be empty\n")
    assert not (tmp_path / "x.db").exists()  # refused before anything opened


def test_health_help_names_its_default_backend(capsys: pytest.CaptureFixture[str]) -> None:
    """`health --help` said `backend URL (default as for examples)`, and nothing of
    `--interval`'s default; every other command names its default backend."""
    with pytest.raises(SystemExit):
        main(["health", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "backend URL (default: $DURABLE_TRIO_BACKEND or sqlite:///.durable/demo.db)" in text
    assert "seconds between refreshes (2)" in text


def test_a_backfill_range_refused_is_said_in_utc_times(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`schedules backfill --from 2026-12-08 --to 2026-12-07` said `the start 1796688000.0 is
    after the end 1796601600.0`: Unix floats for times the operator typed as dates."""
    url = _store_with_a_run(tmp_path)
    common = ["--backend", url]
    assert main(["schedules", "add", "nightly", "order", "--every", "60", "--force", *common]) == 0
    capsys.readouterr()
    backfill = ["schedules", "backfill", "nightly", *common]
    assert main([*backfill, "--from", "2026-12-08", "--to", "2026-12-07"]) == 2
    assert capsys.readouterr().err == (
        "error: backfill: the start 2026-12-08 00:00:00 UTC is after the end "
        "2026-12-07 00:00:00 UTC\n"
    )
    assert main([*backfill, "--from", "2026-12-08", "--to", "2999-01-01T00:00:00Z"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: backfill: the end 2999-01-01 00:00:00 UTC is after now (")
    assert err.endswith(" UTC): a backfill starts past ticks (the schedule starts the others)\n")


@pytest.mark.parametrize(
    "command",
    [
        ["runs", "list"],
        ["health"],
        ["schedules", "list"],
        ["queues"],
        ["worker", "nsapp:app"],
        ["engine", "nsapp:app"],
    ],
)
def test_an_empty_namespace_is_refused_not_read_as_the_default(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: list[str],
) -> None:
    """`--namespace ''` read as no namespace: `runs list` listed the default namespace's runs
    (and a worker served it) where the user had asked for another, if by mistake (an unset
    shell variable, `--namespace "$NS"`)."""
    (tmp_path / "nsapp.py").write_text('import durable_trio as dt\napp = dt.App("shop")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    url = _store_with_a_run(tmp_path)
    assert main([*command, "--namespace", "", "--backend", url]) == 2
    assert capsys.readouterr().err == (
        "error: --namespace must not be empty (leave it out for the default)\n"
    )


def test_an_option_a_command_does_not_take_is_said_with_that_command_s_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`queues --limit 3` printed the top-level usage (`durable-trio [-h] [--version]
    {examples,health,...}`), which does not say what `queues` takes."""
    with pytest.raises(SystemExit) as exited:
        main(["queues", "--limit", "3"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: durable-trio queues ")
    assert err.endswith("durable-trio queues: error: unrecognized arguments: --limit 3\n")
    with pytest.raises(SystemExit):
        main(["runs", "list", "--bogus"])
    assert capsys.readouterr().err.endswith(
        "durable-trio runs list: error: unrecognized arguments: --bogus\n"
    )
