"""The command line and the examples: every example runs, from one command."""

from __future__ import annotations

from typing import TYPE_CHECKING

from durable_trio._cli import _discover, main

if TYPE_CHECKING:
    import pytest


def test_examples_list_names_every_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["examples", "list"]) == 0
    out = capsys.readouterr().out
    for name in _discover():
        assert name in out
    assert {"hello_step", "fan_out", "graceful_close"} <= set(_discover())


def test_every_example_runs_on_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["examples", "run", "--all", "--backend", "memory://"]) == 0
    out = capsys.readouterr().out
    assert f"All {len(_discover())} example(s) passed" in out


def test_an_unknown_example_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["examples", "run", "nope", "--backend", "memory://"]) == 2
    assert "unknown example" in capsys.readouterr().out


def test_run_needs_a_name_or_all(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["examples", "run", "--backend", "memory://"]) == 2
