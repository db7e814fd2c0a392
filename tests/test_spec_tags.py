"""The behaviour ids cited in the repository resolve: every id has its section in docs/spec.md,
every file that cites ids names that page, the links into and out of the page land on a heading,
and no reference to a section number of a document outside the repository is left."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "docs" / "spec.md"
#: Where ids are cited: the code, the tests, the benchmarks, the examples and the pages.
SCANNED = ("durable_trio", "tests", "benchmarks", "examples", "docs")
THIS_FILE = Path(__file__).resolve()

#: An id, or a range of them ("T18–T23", "T7-T10").
_ID = re.compile(r"\bT(\d{1,2})\b(?:\s*[–-]\s*T(\d{1,2})\b)?")
_SECTION = re.compile(r"^### T(\d{1,2}) — \S", re.MULTILINE)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
#: A section sign, or the name of the outside document the old tags pointed at.
_OUTSIDE = re.compile("\u00a7|\\b" + "DESI" + "GN\\b")


def _files() -> list[Path]:
    found = [ROOT / "README.md"]
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            # Not the peers' environments `make bench` installs (benchmarks/peers/.envs: other
            # projects' files, ignored by git) or any other hidden or npm folder.
            hidden = any(
                part.startswith(".") or part == "node_modules"
                for part in path.relative_to(ROOT).parts
            )
            wanted = path.suffix in (".py", ".md") and path != THIS_FILE and not hidden
            if wanted and path.is_file():
                found.append(path)
    return found


def _ids_in(text: str) -> set[int]:
    ids: set[int] = set()
    for match in _ID.finditer(text):
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) else first
        ids.update(range(first, last + 1))
    return ids


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (heading := re.match(r"#{1,6} (.+)", line)):
            anchors.add(_slug(heading.group(1)))
    return anchors


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_spec_has_one_section_per_id_in_order() -> None:
    assert [int(n) for n in _SECTION.findall(SPEC.read_text())] == list(range(1, 25))


def test_every_cited_id_has_a_section() -> None:
    sections = {int(n) for n in _SECTION.findall(SPEC.read_text())}
    missing = {
        _relative(path): sorted(ids - sections)
        for path in _files()
        if (ids := _ids_in(path.read_text())) - sections
    }
    assert missing == {}


def test_every_file_citing_ids_names_the_spec_page() -> None:
    """A reader who meets an id finds the page from the same file (a module docstring, a link)."""
    unnamed = [
        _relative(path)
        for path in _files()
        if path != SPEC and _ids_in(path.read_text()) and "spec.md" not in path.read_text()
    ]
    assert unnamed == []


def test_no_reference_to_an_outside_document_section_is_left() -> None:
    left = [
        f"{_relative(path)}:{number}: {line.strip()}"
        for path in _files()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _OUTSIDE.search(line)
    ]
    assert left == []


@pytest.mark.parametrize(
    "page", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=_relative
)
def test_links_into_and_out_of_the_spec_land_on_a_heading(page: Path) -> None:
    broken = []
    for target in _LINK.findall(page.read_text()):
        file, _, anchor = target.partition("#")
        if not anchor or "://" in file:
            continue
        linked = (page.parent / file).resolve() if file else page
        if SPEC not in (page, linked) or not linked.is_file():
            continue  # other pages' anchors, and missing files, are tools/docs.py's to check
        if anchor not in _anchors(linked):
            broken.append(target)
    assert broken == []
