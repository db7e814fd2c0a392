"""``durable-trio migrate URL [--check]`` on the session's private PostgreSQL server: the check
changes nothing and says what is behind, the migration applies every part, and a role with
only the rights to use the tables then opens the backend and runs a workflow."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import pytest
import trio

import durable_trio as dt
from durable_trio._engine import App, WorkflowContext, open_engine, open_worker
from durable_trio.cli._main import main

if TYPE_CHECKING:
    from _postgres_server import PostgresServer

pytestmark = pytest.mark.postgres

app = App("shop")


@app.step("double")
async def double(value: int) -> int:
    return value * 2


@app.workflow("twice")
async def twice(ctx: WorkflowContext, value: int) -> int:
    doubled: int = await ctx.step("double", value)
    return doubled


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_check_migrate_check(postgres_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    schema = f"m_{uuid.uuid4().hex[:12]}"
    url = f"{postgres_url}?schema={schema}"
    status, out, err = _cli(capsys, "migrate", url, "--check")
    assert (status, err) == (1, "")
    assert out.splitlines() == [
        f"schema '{schema}': not current",
        "part    version  newest  status",
        "broker  0        5       not created",
        "keys    0        1       not created",
        "runs    0        11      not created",
        "store   0        1       not created",
    ]
    assert _cli(capsys, "migrate", url, "--check")[0] == 1  # the check created nothing

    status, out, err = _cli(capsys, "migrate", url)
    assert (status, err) == (0, "")
    assert out.splitlines()[0] == f"schema '{schema}': current"
    assert out.splitlines()[2:] == [
        "broker  5        5       current",
        "keys    1        1       current",
        "runs    11       11      current",
        "store   1        1       current",
    ]
    assert _cli(capsys, "migrate", url, "--check")[:2] == (0, out)
    assert _cli(capsys, "migrate", url)[:2] == (0, out)  # again: nothing to do


def test_migrate_takes_backend_as_every_other_command_does(
    postgres_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`migrate --backend URL` was `unrecognized arguments: --backend`: every other command
    takes the URL so, and a newcomer types it so."""
    url = f"{postgres_url}?schema=m_{uuid.uuid4().hex[:12]}"
    status, out, err = _cli(capsys, "migrate", "--backend", url, "--check")
    assert (status, err) == (1, "")
    assert "not current" in out.splitlines()[0]
    status, out, err = _cli(capsys, "migrate", "--backend", url)
    assert (status, err) == (0, "")
    assert _cli(capsys, "migrate", url, "--backend", url, "--check")[:2] == (0, out)
    status, out, err = _cli(capsys, "migrate", url, "--backend", "sqlite:///x.db")
    assert (status, out, err) == (
        2, "", "error: give the backend URL once: as URL or as --backend\n"
    )


def test_migrate_refuses_other_backends_and_reports_errors_without_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DURABLE_TRIO_BACKEND", raising=False)
    status, out, err = _cli(capsys, "migrate")
    assert (status, out) == (2, "")
    assert "say which backend" in err
    status, out, err = _cli(capsys, "migrate", "sqlite:///x.db")
    assert (status, out) == (2, "")
    assert "only a PostgreSQL backend's tables are versioned" in err
    status, out, err = _cli(capsys, "migrate", "postgresql://h/db?schema=Bad")
    assert (status, out) == (2, "")
    assert err.startswith("error: a PostgreSQL schema name")
    status, _, err = _cli(
        capsys, "migrate", "postgresql://me:s3cret@127.0.0.1:1/db?connect_timeout=2"
    )
    assert status == 2
    assert err.startswith("error: ")
    assert "s3cret" not in err
    assert "Traceback" not in err


def test_after_migrate_a_role_that_only_uses_the_tables_runs_workflows(
    postgres_server: PostgresServer, postgres_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    schema = f"m_{uuid.uuid4().hex[:12]}"
    role = f"r_{uuid.uuid4().hex[:12]}"
    assert _cli(capsys, "migrate", f"{postgres_url}?schema={schema}")[0] == 0
    for grant in (
        f"CREATE ROLE {role} LOGIN",
        f"GRANT USAGE ON SCHEMA {schema} TO {role}",
        f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role}",
        f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA {schema} TO {role}",
    ):
        postgres_server.sql(grant)
    url = postgres_url.replace("postgres@", f"{role}@", 1) + f"?schema={schema}"
    assert role not in [
        row[0] for row in postgres_server.sql("SELECT rolname FROM pg_roles WHERE rolcreatedb")
    ]

    async def run() -> int:
        async with (
            dt.open_backend(url) as backend,
            open_worker(app, backend),
            open_engine(app, backend) as engine,
        ):
            with trio.fail_after(30):
                result: int = await engine.result(await engine.start("twice", 21))
                return result

    assert trio.run(run) == 42
