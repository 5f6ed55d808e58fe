"""docs/design.md's module map is the code's: every module once, in its layer, layers in order.

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
