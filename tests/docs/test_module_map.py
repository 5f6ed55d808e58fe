"""docs/design.md's module map is the code's: every module once, in its layer, layers in order;
and no page of the docs names a module of the package that does not exist.

The map has a table per layer of the import-linter `layers` contract in
pyproject.toml, bottom to top, under a `### ` heading naming the layer's
members in backticks (`### `transitions` and `checks``); the package's own
`__init__.py` sits in a table before the first heading. Each row names one
module by its path under src/batchstate/ and says what concept it holds.
"""

from __future__ import annotations

import re
import tomllib
from collections import Counter
from pathlib import Path
from typing import Final

import attrs

ROOT: Final = Path(__file__).resolve().parents[2]
PACKAGE: Final = ROOT / "src" / "batchstate"
DESIGN: Final = ROOT / "docs" / "design.md"
DOCS: Final = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
ROW: Final = re.compile(r"^\| `(?P<module>[^`]+)` \| (?P<concept>.*\S) \|$")
MEMBER: Final = re.compile(r"`([\w.]+)`")


@attrs.frozen
class Section:
    """One table of the map: the layer its heading names ((), before any heading), its rows."""

    layer: tuple[str, ...]
    rows: tuple[tuple[str, str], ...]  # (module path, concept)


def read_map(text: str) -> list[Section]:
    """The sections of the `## Module map` chapter of `text`, in order."""
    chapter = text.split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]
    sections: list[Section] = []
    layer: tuple[str, ...] = ()
    rows: list[tuple[str, str]] = []
    for line in chapter.splitlines():
        if line.startswith("### "):
            sections.append(Section(layer, tuple(rows)))
            layer, rows = tuple(MEMBER.findall(line)), []
        elif (row := ROW.match(line)) is not None:
            rows.append((row["module"], row["concept"]))
    sections.append(Section(layer, tuple(rows)))
    return sections


def contract_layers() -> list[tuple[str, ...]]:
    """The `layers` contract's layers, bottom to top, each the names it joins with `|`."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    layers: list[str] = contract["layers"]
    return [tuple(name.strip() for name in layer.split("|")) for layer in reversed(layers)]


def modules() -> list[str]:
    """Every module of the package, by its path under src/batchstate/."""
    return sorted(path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py"))


def member(module: str) -> str:
    """The layer member that holds `module`: its folder, or its own name at the top."""
    return module.split("/", 1)[0].removesuffix(".py")


SECTIONS: Final = read_map(DESIGN.read_text())
MAPPED: Final = [module for section in SECTIONS for module, _ in section.rows]


def test_every_module_is_in_the_map_once() -> None:
    assert sorted(set(MAPPED)) == modules()
    assert [module for module, count in Counter(MAPPED).items() if count > 1] == []


def test_the_map_names_nothing_that_does_not_exist() -> None:
    assert [module for module in MAPPED if not (PACKAGE / module).is_file()] == []


def test_the_sections_follow_the_layers_contract_bottom_to_top() -> None:
    first, *layered = SECTIONS
    assert first.layer == ()
    assert [section.layer for section in layered] == contract_layers()


def test_each_module_is_in_its_layers_section() -> None:
    first, *layered = SECTIONS
    assert [module for module, _ in first.rows] == ["__init__.py"]
    misplaced = [
        (module, section.layer)
        for section in layered
        for module, _ in section.rows
        if member(module) not in section.layer
    ]
    assert misplaced == []


def test_each_module_says_what_it_holds() -> None:
    assert all(concept.strip(" -") for section in SECTIONS for _, concept in section.rows)


def test_the_map_is_read_by_heading_and_row() -> None:
    """Each heading starts a section with its members; rows after the chapter are not read."""
    text = (
        "intro\n\n## Module map\n\n| module | concept |\n|---|---|\n"
        "| `__init__.py` | the core |\n\n### `base`\n\n| module | concept |\n|---|---|\n"
        "| `base/mirrored.py` | pairs |\n| `pools/pools.py` | pools |\n\n"
        "### `transitions` and `checks`\n\n| `checks/leaks.py` | leaks |\n\n## Next\n"
        "| `base/lazy.py` | not in the map |\n"
    )
    sections = read_map(text)
    assert [section.layer for section in sections] == [(), ("base",), ("transitions", "checks")]
    assert [len(section.rows) for section in sections] == [1, 2, 1]
    assert member("pools/pools.py") not in sections[1].layer
    assert member("audit.py") == "audit"


# A module path in backticks: `src/batchstate/pools/pools.py`, `engine/_run.py`, `_pools.py`.
PATH: Final = re.compile(r"`(?P<prefix>(?:src/)?batchstate/)?(?P<path>(?:\w+/)*\w+\.py)`")
# Files of other projects that the docs name by their own paths.
ELSEWHERE: Final = frozenset({"sglang/_platform_stubs.py"})  # SGLang's triton stub


def package_paths(text: str) -> list[str]:
    """The paths under src/batchstate/ that `text` names: a path written from the package
    (`batchstate/...`), one under a folder of the package (`engine/_run.py`), or a private
    module's bare name (`_pools.py`); other files (`benchmarks/step.py`) are not the package's."""
    folders = {path.name for path in PACKAGE.iterdir() if path.is_dir()}
    named = []
    for match in PATH.finditer(text):
        path = match["path"]
        if path in ELSEWHERE:
            continue
        if match["prefix"] or path.split("/", 1)[0] in folders or path.startswith("_"):
            named.append(path)
    return named


def test_the_docs_name_only_modules_that_exist() -> None:
    """A page that names a module by a path the package no longer has (a module moved or
    renamed) fails here, with the page and the path."""
    stale = [
        f"{page.relative_to(ROOT)}: {path}"
        for page in DOCS
        for path in package_paths(page.read_text())
        if not (PACKAGE / path).is_file()
    ]
    assert stale == []


def test_module_paths_are_found_in_the_docs_text() -> None:
    text = (
        "`engine/_run.py`, `_pools.py`, `src/batchstate/base/lazy.py`, `benchmarks/step.py`,"
        " `test_docs.py`, `sglang/_platform_stubs.py`"
    )
    assert package_paths(text) == ["engine/_run.py", "_pools.py", "base/lazy.py"]
