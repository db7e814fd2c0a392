"""The layer map in ``durable_trio._engine``'s docstring names every module of the package, each
once, and the imports between them go down its layers (or stay within one)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import durable_trio._engine as engine_package

PACKAGE = Path(engine_package.__file__).parent
LAYER = re.compile(r"^(\d+)\. [^:]+: ")
NAME = re.compile(r"``(_?\w+)``")


def layers() -> dict[str, int]:
    """Module (or sub-package) name -> its layer number, from the docstring's numbered list."""
    doc = engine_package.__doc__ or ""
    text: dict[int, str] = {}
    current = 0
    for line in doc[doc.index("Layers, bottom up") :].splitlines():
        match = LAYER.match(line)
        if match:
            current = int(match[1])
        elif current == 0:
            continue  # the lines before the list
        elif not line.startswith("   "):
            break
        text[current] = text.get(current, "") + " " + line
    found: dict[str, int] = {}
    for layer, names in text.items():
        # What a name's parentheses say (a sub-package's parts, a gloss) is not a layer's.
        for name in NAME.findall(re.sub(r"\([^)]*\)", "", names)):
            assert name not in found, f"{name} named twice in the layer map"
            found[name] = layer
    return found


def modules() -> dict[str, Path]:
    """The package's modules (a sub-package counts as one), by name."""
    found = {path.stem: path for path in PACKAGE.glob("_*.py") if path.stem != "__init__"}
    for sub in PACKAGE.iterdir():
        if (sub / "__init__.py").exists():
            found[sub.name] = sub
    return found


def imports(path: Path) -> set[str]:
    """The package's modules imported (anywhere, at any level) by ``path`` (or a sub-package)."""
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    found: set[str] = set()
    for file in files:
        depth = len(file.relative_to(PACKAGE).parts) - 1
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.level != depth + 1:
                continue
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def test_the_layer_map_names_every_module_once() -> None:
    named = layers()
    assert sorted(named) == sorted(modules())


def test_imports_go_down_the_layers() -> None:
    named = layers()
    upward = [
        f"{name} (layer {named[name]}) imports {target} (layer {named[target]})"
        for name, path in modules().items()
        for target in imports(path)
        if target in named and target != name and named[target] > named[name]
    ]
    assert not upward


def test_the_parser_reads_the_layers() -> None:
    named = layers()
    assert named["_records"] == 1
    assert named["_stores"] == 2
    assert named["_engine"] == named["_open"] == 8
    assert imports(PACKAGE / "_open.py") >= {"_engine", "_options"}
