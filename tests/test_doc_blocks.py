"""The code blocks of README.md and docs/*.md, run through Sybil (docs/decisions.md, "Docs whose
code runs: Sybil").

Sybil parses each page (fenced blocks, and the ``<!-- invisible-code-block: python -->``
comments that give a fragment the names its prose takes for granted); the evaluators here run
them:

- ``python`` blocks in order in one namespace per page (a later block may use an earlier one's
  names, as a reader does), in a fresh working folder. A block with a top-level ``await`` or
  ``async with`` (a reference fragment) runs under ``trio.run``. A block runs against the
  backend its URL names: ``redis://127.0.0.1:6379/0`` is pointed at the suite's private
  server, ``sqlite:////var/lib/...`` at a file in the working folder.
- ``sh`` blocks line by line, each ``durable-trio`` command as a real process of this venv's
  script (``--watch`` given ``--iterations 1``); a line that installs or recurses (``make
  test``, ``pip install``) cannot run inside the suite and must be in ``COVERED_ELSEWHERE``,
  with the test that covers it.
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
_SQLITE_ABSOLUTE = re.compile(r"sqlite:////var/lib/")
DURABLE_TRIO = Path(sys.executable).with_name("durable-trio")
SHELL_BOUND = 120.0

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
    """What one page's blocks share: the working folder, the private Redis URL."""

    def __init__(self, folder: Path, redis_url: str) -> None:
        self.folder = folder
        self.redis_url = redis_url

    def source(self, code: str) -> str:
        if _REDIS.search(code):
            assert self.redis_url, "a block names Redis: the page must start the private server"
            code = _REDIS.sub(self.redis_url, code)
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

    def shell(self, example: Example) -> None:
        for line in _lines_to_run(example.parsed):
            argv = shlex.split(line)
            assert argv[0] == "durable-trio", f"a shell line neither run nor covered: {line}"
            if "--watch" in argv and "--iterations" not in argv:
                argv += ["--iterations", "1"]
            argv = [self.source(a) for a in argv]
            done = subprocess.run(
                [str(DURABLE_TRIO), *argv[1:]],
                cwd=self.folder,
                capture_output=True,
                text=True,
                timeout=SHELL_BOUND,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                check=False,
            )
            assert done.returncode == 0, f"{line}: exit {done.returncode}\n{done.stderr}"


def _parsers(page: _Page) -> list[Callable[[Document], Any]]:
    return [CodeBlockParser("python", page.python), CodeBlockParser("sh", page.shell)]


def blocks(page: Path) -> list[tuple[str, str, str]]:
    """``(id, language, code)`` of each fenced block (id: ``page:line``)."""
    text = page.read_text()
    return [
        (f"{page.name}:{text[: m.start()].count(chr(10)) + 1}", m.group(1), m.group(2))
        for m in _FENCE.finditer(text)
    ]


def _has_code(page: Path) -> bool:
    return any(language in ("python", "sh") for _, language, _ in blocks(page))


@pytest.mark.chaos
@pytest.mark.redis
@pytest.mark.parametrize("page", [p for p in PAGES if _has_code(p)], ids=lambda p: p.name)
def test_the_code_blocks_of_a_page_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    needs_redis = bool(_REDIS.search(page.read_text()))
    url = request.getfixturevalue("redis_url") if needs_redis else ""
    monkeypatch.chdir(tmp_path)
    shared = _Page(tmp_path, url)
    document = Document.parse(str(page), *_parsers(shared))
    document.namespace["__name__"] = "__doc__"
    examples = list(document)
    assert examples, "the page's blocks were not found"
    try:
        for example in examples:
            example.evaluate()
    finally:
        dt.uninstrument()


def test_every_block_that_is_not_code_says_its_language() -> None:
    unnamed = [b[0] for page in PAGES for b in blocks(page) if not b[1]]
    assert not unnamed, "give these blocks a language (text, sh, sql): " + ", ".join(unnamed)


def test_every_shell_line_runs_or_is_covered_elsewhere() -> None:
    # What the shell evaluator refuses, listed up front: no page can hide a line that nothing
    # runs (it would fail only when its page's test reaches it).
    for page in PAGES:
        for block_id, language, code in blocks(page):
            if language != "sh":
                continue
            for line in _lines_to_run(code):
                assert line.startswith("durable-trio "), f"{block_id}: {line}"
