"""The command line and the examples: every example runs, from one command."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from durable_trio.cli import _main as _cli
from durable_trio.cli._main import _discover, main

if TYPE_CHECKING:
    from pathlib import Path


def test_examples_list_names_every_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["examples", "list"]) == 0
    out = capsys.readouterr().out
    for name in _discover():
        assert name in out
    assert {"hello_step", "fan_out", "graceful_close"} <= set(_discover())
    assert main(["examples"]) == 0  # (a newcomer's first try: the list, not a usage error)
    assert capsys.readouterr().out == out


def test_every_example_runs_on_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["examples", "run", "--all", "--backend", "memory://"]) == 0
    out = capsys.readouterr().out
    assert f"All {len(_discover())} example(s) passed" in out


def test_the_scheduled_report_never_reads_a_time_before_its_tick(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Each tick's report says when its step ran: never in the second before its tick (as a
    # clock read through strftime alone, the kernel's coarse one, could say).
    assert main(["examples", "run", "scheduled_report", "--backend", "memory://"]) == 0
    found = re.findall(r"T(\d\d:\d\d:\d\d)Z: report for ops at (\d\d:\d\d:\d\d) UTC",
                       capsys.readouterr().out)  # fmt: skip
    assert len(found) == 3
    for tick, ran in found:
        assert ran >= tick or tick == "00:00:00", (tick, ran)  # (bar a tick at midnight)


def test_an_unknown_example_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["examples", "run", "nope", "--backend", "memory://"]) == 2
    assert "unknown example" in capsys.readouterr().out


def test_run_needs_a_name_or_all(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["examples", "run", "--backend", "memory://"]) == 2


def test_without_a_checkout_examples_says_where_they_are(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # As installed from the wheel (tests/test_packaging.py runs the real one): no source checkout.
    monkeypatch.setattr(_cli, "_CHECKOUT_EXAMPLES", None)
    monkeypatch.delenv("DURABLE_TRIO_EXAMPLES", raising=False)
    assert main(["examples", "list"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert "examples/ folder of the durable_trio repository" in captured.err


def test_examples_follow_the_environment_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_cli, "_CHECKOUT_EXAMPLES", None)
    monkeypatch.setenv("DURABLE_TRIO_EXAMPLES", str(tmp_path))
    assert main(["examples", "list"]) == 2
    assert capsys.readouterr().err == f"no examples found in {tmp_path}\n"
    (tmp_path / "10_hi.py").write_text(
        '"""Says hi."""\n\n\nasync def main(url: str) -> None:\n    pass\n'
    )
    assert main(["examples", "run", "hi", "--backend", "memory://"]) == 0
    assert "✓ hi" in capsys.readouterr().out


def test_every_example_summary_is_whole_sentences_without_markup() -> None:
    from durable_trio.cli._main import _summary

    for name, path in _discover().items():
        summary = _summary(path)
        assert summary.endswith("."), f"{name}: {summary!r} stops mid-sentence"
        assert "`" not in summary, f"{name}: {summary!r} shows markup"
        assert "\n" not in summary


def test_a_deeply_nested_json_argument_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``json.loads`` recurses once per level: 100,000 ``[`` was a ``RecursionError``
    traceback from ``runs signal`` (and ``schedules add --input``, ``run --input``)."""
    deep = "[" * 100_000 + "]" * 100_000
    module = tmp_path / "deep_app.py"
    module.write_text(
        "import durable_trio as dt\n"
        "app = dt.App('deep')\n"
        "@app.workflow('wf')\n"
        "async def wf(ctx, input):\n"
        "    return input\n"
    )
    url = f"sqlite:///{tmp_path / 'deep.db'}"
    backend = ["--backend", url, "--namespace", "deep"]
    commands = [
        (["schedules", "add", "s", "wf", "--every", "60", "--input", deep, *backend], "--input"),
        (["runs", "signal", "r1", "go", deep, *backend], "PAYLOAD-JSON"),
        (["run", f"{module}:app", "wf", "--input", deep, "--backend", url], "--input"),
    ]
    for argv, what in commands:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err[:300]
        assert f"{what} is not JSON-serialisable: nested deeper than 200 levels" in err
    # Shallower than the recursion limit, deeper than the payload limit: the same one line.
    assert main(["runs", "signal", "r1", "go", "[" * 300 + "]" * 300, *backend]) == 2
    assert "nested deeper than 200 levels" in capsys.readouterr().err


@pytest.mark.postgres
def test_an_argument_that_is_not_utf8_is_one_line_and_exit_2(
    tmp_path: Path, postgres_url: str, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A command line's bytes that are not UTF-8 decode to lone surrogates, which no store can
    hold: ``runs show``, ``cancel``, ``retry``, ``signal`` and ``list --workflow`` were a
    ``UnicodeEncodeError`` traceback from the SQLite binding, psycopg or the Redis client.
    Each is now one line naming the argument, exit 2, before anything is opened."""
    odd = "a\udcffb"  # the bytes b"a\xffb", as Python decodes argv
    for url in (f"sqlite:///{tmp_path / 'odd.db'}", f"{postgres_url}?schema=odd", redis_url):
        backend = ["--backend", url, "--namespace", "odd"]
        for argv in (
            ["runs", "show", odd],
            ["runs", "cancel", odd],
            ["runs", "retry", odd],
            ["runs", "signal", odd, "go"],
            ["runs", "signal", "r1", odd],
            ["runs", "list", "--workflow", odd],
        ):
            assert main([*argv, *backend]) == 2
            err = capsys.readouterr().err
            assert (
                err == f"error: argument {argv.index(odd) + 1} ('a\\udcffb') is not valid UTF-8\n"
            )
    # The real decode, in a process of its own: the bytes as a shell passes them.
    url = f"sqlite:///{tmp_path / 'odd.db'}"
    done = subprocess.run(
        [sys.executable, "-m", "durable_trio", "runs", "show", b"a\xffb", "--backend", url],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (
        2,
        b"error: argument 3 ('a\\udcffb') is not valid UTF-8\n",
    )
