"""``make docs`` (``python -m tools.docs``): regenerate docs/schemas/*.json and check that every
relative link in docs/ and the README resolves. Exits non-zero on a broken link.

A repository tool, not part of the package: it writes into the repository it lives in.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from durable_trio._codec import MESSAGE_TYPES, json_schema

#: The repository this file lives in (tools/docs.py), whatever the working folder.
REPOSITORY = Path(__file__).resolve().parent.parent

_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def main(root: Path = REPOSITORY) -> int:
    """Write the schemas under ``root``/docs/schemas and check the links of its pages.

    Args:
        root: the repository (the one this file lives in by default).

    Returns:
        the exit status: 0, or 1 when a link is broken.
    """
    schemas = root / "docs" / "schemas"
    schemas.mkdir(parents=True, exist_ok=True)
    for cls in MESSAGE_TYPES:
        text = json.dumps(json_schema(cls), indent=2, sort_keys=False) + "\n"
        (schemas / f"{cls.__name__}.json").write_text(text)
    broken = []
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    for page in pages:
        for target in _LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(root)}: {target}")
    for line in broken:
        print(f"broken link: {line}", file=sys.stderr)
    print(f"docs: {len(MESSAGE_TYPES)} schemas written, {len(pages)} pages checked")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
