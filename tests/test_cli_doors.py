"""Bad values at the command line's doors, as a newcomer types them: each is one line on stderr
starting `error: `, exit status 2, no traceback, and nothing started or served."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import trio

import durable_trio as dt
from durable_trio.cli._main import main

if TYPE_CHECKING:
    from pathlib import Path

FLOWS = """
import durable_trio as dt

app = dt.App("shop")


@app.step("hello")
async def hello(name: str) -> str:
    return f"hello, {name}"


@app.workflow("greet")
async def greet(ctx: dt.WorkflowContext, name: str) -> str:
    return await ctx.step("hello", name)
"""


def _one_error_line(err: str) -> str:
    assert err.count("\n") == 1, err
    assert err.startswith("error: "), err
    assert "Traceback" not in err
    return err


async def _run_ids(url: str) -> list[str]:
    async with dt.open_operations(url, namespace="shop") as ops:
        return [run.run_id for run in (await ops.list_runs()).runs]


@pytest.mark.parametrize("timeout", ["-1", "nan", "inf"])
def test_run_refuses_a_bad_timeout_before_it_starts_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], timeout: str
) -> None:
    (tmp_path / "door_flows.py").write_text(FLOWS)
    url = f"sqlite:///{tmp_path / 'x.db'}".replace("///", "////", 1)
    target = f"{tmp_path / 'door_flows.py'}:app"
    status = main(["run", target, "greet", '"you"', "--timeout", timeout, "--backend", url])
    assert status == 2
    err = _one_error_line(capsys.readouterr().err)
    assert "--timeout must be a finite number of seconds >= 0" in err
    assert not (tmp_path / "x.db").exists()  # nothing opened, so no run left behind
    assert main(["run", target, "greet", '"you"', "--with-worker", "--backend", url]) == 0
    assert len(trio.run(_run_ids, url)) == 1


def test_run_says_error_before_an_input_that_is_not_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "door_flows2.py").write_text(FLOWS)
    target = f"{tmp_path / 'door_flows2.py'}:app"
    assert main(["run", target, "greet", "{oops", "--backend", "memory://"]) == 2
    assert _one_error_line(capsys.readouterr().err).startswith("error: INPUT is not JSON")
    assert main(["run", target, "greet", "--input", "{oops", "--backend", "memory://"]) == 2
    assert _one_error_line(capsys.readouterr().err).startswith("error: --input is not JSON")
