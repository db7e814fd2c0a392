"""The code blocks of README.md and docs/*.md, run (a small collector: docs/decisions.md, "Docs
whose code runs").

Each page's ``python`` blocks run in order in one namespace (a later block may use an earlier
one's names, as a reader does), in a fresh working folder; a Redis URL in a block is replaced by
the private server's. Blocks that are not Python (shell, output, SQL) are listed as not run,
with their language. The fragments that do not run yet are listed in ``NOT_YET`` (expected to
fail, so one that starts to run is seen): turning them into runnable blocks is open work.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import durable_trio as dt

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_REDIS = re.compile(r"redis://127\.0\.0\.1:6379/0|redis://localhost:6379/0")

#: Fragments that do not run as they stand (``await`` outside a function, names from prose).
NOT_YET = {
    "engine.md:8",
    "engine.md:56",
    "engine.md:124",
    "engine.md:162",
    "engine.md:189",
    "engine.md:302",
    "getting-started.md:14",
    "getting-started.md:58",
    "remote.md:16",
    "remote.md:119",
}


def blocks(page: Path) -> list[tuple[str, str, str]]:
    """``(id, language, code)`` of each fenced block (id: ``page:line``)."""
    text = page.read_text()
    return [
        (f"{page.name}:{text[: m.start()].count(chr(10)) + 1}", m.group(1), m.group(2))
        for m in _FENCE.finditer(text)
    ]


@pytest.mark.chaos
@pytest.mark.redis
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_python_blocks_of_a_page_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    found = [b for b in blocks(page) if b[1] == "python"]
    if not found:
        pytest.skip("no python block")
    needs_redis = any(_REDIS.search(code) for _, _, code in found)
    url = request.getfixturevalue("redis_url") if needs_redis else ""
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "__doc__"}
    failures = []
    try:
        for block_id, _, code in found:
            source = _REDIS.sub(url, code) if needs_redis else code
            try:
                exec(compile(source, block_id, "exec"), namespace)
            except Exception as exc:
                if block_id not in NOT_YET:
                    failures.append(f"{block_id}: {type(exc).__name__}: {exc}")
            else:
                assert block_id not in NOT_YET, f"{block_id} runs now: take it off NOT_YET"
    finally:
        dt.uninstrument()
    assert not failures


def test_every_block_that_is_not_python_says_its_language() -> None:
    unnamed = [b[0] for page in PAGES for b in blocks(page) if not b[1]]
    assert not unnamed, "give these blocks a language (text, sh, sql): " + ", ".join(unnamed)
