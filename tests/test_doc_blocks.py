"""The code blocks of README.md and docs/*.md, run through Sybil (docs/decisions.md, "Docs whose
code runs: Sybil").

Sybil parses each page (fenced blocks, and the ``<!-- invisible-code-block: python -->``
comments that give a fragment the names its prose takes for granted); the evaluators here run
them:

- ``python`` blocks in order in one namespace per page (a later block may use an earlier one's
  names, as a reader does), in a fresh working folder. A block with a top-level ``await`` or
  ``async with`` (a reference fragment) runs under ``trio.run``. A block runs against the
  backend its URL names: ``redis://127.0.0.1:6379/0`` is pointed at the suite's private
  server, ``postgresql://app@localhost:5432/app`` at the private PostgreSQL server's
  database, ``sqlite:////var/lib/...`` at a file in the working folder.
- ``sh`` blocks line by line, each ``durable-trio`` command as a real process of this venv's
  script (``--watch`` given ``--iterations 1``); a line that installs or recurses (``make
  test``, ``pip install``) cannot run inside the suite and must be in ``COVERED_ELSEWHERE``,
  with the test that covers it.
- ``console`` blocks are transcripts: each ``$ durable-trio ...`` line runs as a real process
  (as ``sh`` lines do, in the page's working folder) and what it prints (stdout, then stderr)
  must be the lines that follow it, up to the next ``$`` line. Times and durations are compared
  by their shape (``2026-12-02 08:39:03``, ``0.003 s``), not their value; a transcript may end a
  line with ``…`` where the command itself cuts it.
- Other blocks (``text``, ``sql``, benchmark output) are output, not code: they must say their
  language.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio
from sybil import Document, Example
from sybil.evaluators.python import pad
from sybil.parsers.markdown import CodeBlockParser

import durable_trio as dt

if TYPE_CHECKING:
    from collections.abc import Callable

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_REDIS = re.compile(r"redis://127\.0\.0\.1:6379/0|redis://localhost:6379/0")
_POSTGRES = re.compile(r"postgresql://app@localhost:5432/app")
_SQLITE_ABSOLUTE = re.compile(r"sqlite:////var/lib/")
DURABLE_TRIO = Path(sys.executable).with_name("durable-trio")
SHELL_BOUND = 120.0
#: ``DT_UPDATE_TRANSCRIPTS=1``: write what each transcript's commands print now into its page
#: (after a deliberate change of the output; review the diff).
UPDATE_TRANSCRIPTS = os.environ.get("DT_UPDATE_TRANSCRIPTS") == "1"
#: What a transcript compares by shape, not value: a wall-clock time, a duration in seconds.
_VARYING = (
    (re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"), "YYYY-MM-DD hh:mm:ss"),
    (re.compile(r"\b\d+\.\d{3} s\b"), "n.nnn s"),
)

#: Shell lines that cannot run inside the suite, and what runs them instead.
COVERED_ELSEWHERE = {
    "make test": "CI runs it (.ci/run); it is this suite",
    "make demo": "`durable-trio examples run --all`, run from docs/getting-started.md",
    "python3 -m venv .venv && .venv/bin/pip install -e '.[test]'": (
        "the Makefile's install step, which every `make test` runs first"
    ),
    ".venv/bin/python -m pip install --target /tmp/redispy --no-deps redis trio-asyncio "
    "greenlet": "a download from PyPI for the optional redis-py comparison (make bench)",
    "PYTHONPATH=/tmp/redispy .venv/bin/python -m benchmarks.redis_clients": (
        "make bench (the redis-clients section)"
    ),
}


def _lines_to_run(code: str) -> list[str]:
    """The command lines of a ``sh`` block (comments dropped) that are not covered elsewhere."""
    lines = (raw.split("  #")[0].strip() for raw in code.splitlines())
    return [ln for ln in lines if ln and not ln.startswith("#") and ln not in COVERED_ELSEWHERE]


class _Page:
    """What one page's blocks share: the working folder, the private servers' URLs."""

    def __init__(self, folder: Path, redis_url: str, postgres_url: str = "") -> None:
        self.folder = folder
        self.redis_url = redis_url
        self.postgres_url = postgres_url
        self.transcripts: list[tuple[str, str]] = []
        """``(as written, as printed now)`` of each transcript run."""

    def source(self, code: str) -> str:
        if _REDIS.search(code):
            assert self.redis_url, "a block names Redis: the page must start the private server"
            code = _REDIS.sub(self.redis_url, code)
        if _POSTGRES.search(code):
            assert self.postgres_url, "a block names PostgreSQL: the page must start the server"
            code = _POSTGRES.sub(self.postgres_url, code)
        return _SQLITE_ABSOLUTE.sub(f"sqlite:///{self.folder}/var/lib/", code)

    def python(self, example: Example) -> None:
        source = pad(self.source(example.parsed), example.line + example.parsed.line_offset)
        flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        code = compile(source, example.path, "exec", flags=flags, dont_inherit=True)
        namespace = example.namespace
        if code.co_flags & inspect.CO_COROUTINE:
            coroutine = eval(code, namespace)

            async def block() -> None:
                await coroutine

            trio.run(block)
        else:
            exec(code, namespace)
        namespace.pop("__builtins__", None)

    def run(self, line: str) -> subprocess.CompletedProcess[str]:
        """One ``durable-trio`` command line, as a real process in the page's folder."""
        argv = shlex.split(line)
        assert argv[0] == "durable-trio", f"a shell line neither run nor covered: {line}"
        if "--watch" in argv and "--iterations" not in argv:
            argv += ["--iterations", "1"]
        argv = [self.source(a) for a in argv]
        return subprocess.run(
            [str(DURABLE_TRIO), *argv[1:]],
            cwd=self.folder,
            capture_output=True,
            text=True,
            timeout=SHELL_BOUND,
            env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{self.folder}"},
            check=False,
        )

    def shell(self, example: Example) -> None:
        for line in _lines_to_run(example.parsed):
            done = self.run(line)
            assert done.returncode == 0, f"{line}: exit {done.returncode}\n{done.stderr}"

    def console(self, example: Example) -> None:
        written = []
        for line, expected in _transcript(example.parsed):
            done = self.run(line)
            printed = (done.stdout + done.stderr).splitlines()
            written += [f"$ {line}", *(p.rstrip() for p in printed)]
            if not UPDATE_TRANSCRIPTS:
                assert _shape(printed) == _shape(expected), (
                    f"{line} (exit {done.returncode}) printed:\n" + "\n".join(printed)
                )
        self.transcripts.append((example.parsed, "\n".join(written) + "\n"))


def _transcript(code: str) -> list[tuple[str, list[str]]]:
    """A ``console`` block's ``(command line, the lines it prints)`` pairs."""
    pairs: list[tuple[str, list[str]]] = []
    for raw in code.splitlines():
        if raw.startswith("$ "):
            pairs.append((raw[2:].strip(), []))
        else:
            assert pairs, f"a transcript starts with its command: {raw!r}"
            pairs[-1][1].append(raw)
    return pairs


def _shape(lines: list[str]) -> list[str]:
    """Lines as a transcript compares them: varying values by their shape, no trailing space."""
    shaped = []
    for line in lines:
        for pattern, shape in _VARYING:
            line = pattern.sub(shape, line)
        shaped.append(line.rstrip())
    return shaped


def _parsers(page: _Page) -> list[Callable[[Document], Any]]:
    return [
        CodeBlockParser("python", page.python),
        CodeBlockParser("sh", page.shell),
        CodeBlockParser("console", page.console),
    ]


def blocks(page: Path) -> list[tuple[str, str, str]]:
    """``(id, language, code)`` of each fenced block (id: ``page:line``)."""
    text = page.read_text()
    return [
        (f"{page.name}:{text[: m.start()].count(chr(10)) + 1}", m.group(1), m.group(2))
        for m in _FENCE.finditer(text)
    ]


def _has_code(page: Path) -> bool:
    return any(language in ("python", "sh", "console") for _, language, _ in blocks(page))


@pytest.mark.chaos
@pytest.mark.redis
@pytest.mark.postgres
@pytest.mark.parametrize("page", [p for p in PAGES if _has_code(p)], ids=lambda p: p.name)
def test_the_code_blocks_of_a_page_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    needs_redis = bool(_REDIS.search(page.read_text()))
    url = request.getfixturevalue("redis_url") if needs_redis else ""
    needs_postgres = bool(_POSTGRES.search(page.read_text()))
    postgres_url = request.getfixturevalue("postgres_url") if needs_postgres else ""
    monkeypatch.chdir(tmp_path)
    shared = _Page(tmp_path, url, postgres_url)
    document = Document.parse(str(page), *_parsers(shared))
    document.namespace["__name__"] = "__doc__"
    examples = list(document)
    assert examples, "the page's blocks were not found"
    try:
        for example in examples:
            example.evaluate()
    finally:
        dt.uninstrument()
    if UPDATE_TRANSCRIPTS and shared.transcripts:
        text = page.read_text()
        for written, printed in shared.transcripts:
            text = text.replace(f"```console\n{written}```", f"```console\n{printed}```", 1)
        page.write_text(text)


def test_every_block_that_is_not_code_says_its_language() -> None:
    unnamed = [b[0] for page in PAGES for b in blocks(page) if not b[1]]
    assert not unnamed, "give these blocks a language (text, sh, sql): " + ", ".join(unnamed)


def test_every_python_block_a_reader_copies_is_a_valid_file() -> None:
    """A reader pastes a block into a file and runs it: no top-level ``await`` or ``async
    with`` (a ``SyntaxError`` there), ``trio.run(main)`` instead. (The evaluator above still
    accepts top-level awaits, for the invisible blocks only the tests read.)"""
    invalid = []
    for page in PAGES:
        for block_id, language, code in blocks(page):
            if language != "python":
                continue
            try:
                compile(code, block_id, "exec", dont_inherit=True)
            except SyntaxError as error:
                invalid.append(f"{block_id}: {error.msg}")
    assert not invalid, "wrap these in `async def main()` + `trio.run(main)`: " + "; ".join(invalid)


def test_every_shell_line_runs_or_is_covered_elsewhere() -> None:
    # What the shell evaluator refuses, listed up front: no page can hide a line that nothing
    # runs (it would fail only when its page's test reaches it).
    for page in PAGES:
        for block_id, language, code in blocks(page):
            if language == "sh":
                lines = _lines_to_run(code)
            elif language == "console":
                lines = [line for line, _ in _transcript(code)]
            else:
                continue
            for line in lines:
                assert line.startswith("durable-trio "), f"{block_id}: {line}"
