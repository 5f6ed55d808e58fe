"""The docs say what the code does: the table and the API pages are current.

That every python block of README.md and docs/ runs is tests/docs/test_doc_blocks.py's job.
"""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import typing
from collections import Counter
from pathlib import Path
from typing import Final

import attrs
import pytest

import batchstate
import batchstate.audit
import batchstate.backends
import batchstate.cli
import batchstate.engine
import batchstate.mypy_plugin
from batchstate.table import render_transitions
from tests.base.test_public_face import NAMESPACES

DOCS: Final = Path(__file__).resolve().parents[2] / "docs"
README: Final = DOCS.parent / "README.md"
REFERENCE: Final = DOCS / "reference"
# The modules whose `__all__` the API reference documents.
PUBLIC_MODULES: Final = (
    batchstate,
    *(
        importlib.import_module(f"batchstate.{namespace}")
        for namespace in NAMESPACES
        if namespace != "errors"  # after the audit, below
    ),
    batchstate.audit,  # before errors: DeviceReadError is documented with the audit
    batchstate.errors,
    batchstate.table,
    batchstate.backends,
    batchstate.engine,
    batchstate.cli,
    batchstate.mypy_plugin,
)
# A mkdocstrings directive: `::: batchstate.extend` on a line of its own.
DIRECTIVE: Final = re.compile(r"^::: (\S+)$", re.M)


def test_transitions_doc_is_rendered_from_the_table() -> None:
    """docs/transitions.md holds exactly the table that TRANSITIONS renders to.

    To update it: `python tools/render_transitions.py`.
    """
    text = (DOCS / "transitions.md").read_text()
    block = re.search(r"<!-- transitions:begin -->\n(.*?)<!-- transitions:end -->", text, re.S)
    assert block is not None
    assert block.group(1) == render_transitions()


def test_reference_pages_document_every_public_name_once() -> None:
    """Each name in a public module's `__all__` has one `::: module.name` directive across
    docs/reference/*.md, and no directive names anything else (a private module's object,
    a name since removed). An object is documented where it is first exported: a name of
    the core (`batchstate.__all__`) there, not again in its namespace."""
    directives = Counter(
        path for page in REFERENCE.glob("*.md") for path in DIRECTIVE.findall(page.read_text())
    )
    public: list[str] = []
    seen: set[int] = set()  # an object is documented once, where it is first exported
    for module in PUBLIC_MODULES:
        for name in module.__all__:
            value = getattr(module, name)
            if id(value) not in seen or isinstance(value, int | str):
                public.append(f"{module.__name__}.{name}")
            seen.add(id(value))
    assert [path for path in public if path not in directives] == []
    assert sorted(path for path, count in directives.items() if count > 1) == []
    assert sorted(set(directives) - set(public)) == []


def test_reference_pages_are_in_the_sidebar() -> None:
    """mkdocs.yml's nav lists every page of docs/reference/, so the sidebar reaches each."""
    nav = (DOCS.parent / "mkdocs.yml").read_text()
    pages = sorted(page.name for page in REFERENCE.glob("*.md"))
    assert len(pages) > 1
    assert [page for page in pages if f" reference/{page}\n" not in nav] == []


def test_api_map_links_every_name_to_its_reference_entry() -> None:
    """docs/api.md's entry for each name of `batchstate` and `batchstate.audit` links to the
    object's reference entry (`[**`name...`**][batchstate.name]`); the strict docs build
    fails if a link does not resolve."""
    text = (DOCS / "api.md").read_text()
    unlinked = []
    for module in (batchstate, batchstate.audit):
        for name in module.__all__:
            path = f"{module.__name__}.{name}"
            entry = rf"\[\*\*`{re.escape(name)}\b[^`]*`\*\*\]\[{re.escape(path)}\]"
            if re.search(entry, text) is None:
                unlinked.append(path)
    assert unlinked == []


def test_api_doc_names_every_public_name() -> None:
    """Every name in batchstate.__all__ has an entry in docs/api.md."""
    text = (DOCS / "api.md").read_text()
    missing = [name for name in batchstate.__all__ if f"**`{name}" not in text]
    assert missing == []


MEMBER_CLASSES: Final = (
    batchstate.Mirrored,
    batchstate.DeviceOnly,
    batchstate.Pools,
    batchstate.FreeList,
    batchstate.TokenTable,
    batchstate.Rows,
)


def test_api_doc_lists_every_public_member_of_the_value_classes() -> None:
    """`Mirrored.take`, `Pools.slot_tokens` and the like: each has an entry, methods with
    their signature as the code has it."""
    text = (DOCS / "api.md").read_text()
    missing = []
    for cls in MEMBER_CLASSES:
        fields = attrs.fields(cls) if attrs.has(cls) else ()
        names = [field.name for field in fields if not field.name.startswith("_")]
        names += [name for name in vars(cls) if not name.startswith("_") and name not in names]
        for name in names:
            entry = f"{cls.__name__}.{name}"
            member = inspect.getattr_static(cls, name)
            function = getattr(member, "__func__", member)
            if inspect.isfunction(function):
                parameters = list(inspect.signature(function).parameters.values())
                if not isinstance(member, staticmethod):
                    parameters = parameters[1:]  # self or cls
                signature = inspect.signature(function).replace(parameters=parameters)
                entry += str(signature).replace("'", "")
            if f"**`{entry}`**" not in text:
                missing.append(entry)
    assert missing == []


def test_api_doc_signatures_are_current() -> None:
    """Every public function's entry in docs/api.md shows its signature as the code has it."""
    text = (DOCS / "api.md").read_text()
    stale = []
    for module in (batchstate, batchstate.audit):
        for name in module.__all__:
            function = getattr(module, name)
            if inspect.isfunction(function):
                # An overloaded function is documented by its overloads, not its body.
                for variant in typing.get_overloads(function) or [function]:
                    signature = name + str(inspect.signature(variant)).replace("'", "")
                    if f"**`{signature}`**" not in text:
                        stale.append(signature)
    assert stale == []


def test_readme_has_exactly_two_setup_commands() -> None:
    """The README's set-up section gives two shell commands, the second the one CI runs."""
    text = README.read_text()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```sh\n(.*?)\n```", setup, re.S)
    assert len(commands) == 2
    ci = (DOCS.parent / ".ci" / "run").read_text()
    assert commands[1] in ci


# What a reader of this repository alone cannot follow: issue numbers, and
# paths or documents that live outside it. This file, whose pattern names
# what it looks for, is the one file not scanned.
OUTSIDE_REFERENCES: Final = re.compile(
    r"\bissues?\s+#?\d+"  # "issue 5", "issues #4"
    r"|(?<![\w&/])#\d+\b"  # "#12" (not a colour like #1f77b4, nor &#12;)
    r"|\.\./"  # a path that climbs out of the repository
    r"|\bshared[/]"
    r"|(?-i:\bDESIGN\.md|\bDESIGN §)"  # not docs/design.md, this repository's own
    r"|\bthe\sbrief\b",
    re.IGNORECASE,
)


def _tracked_text_files() -> list[Path]:
    root = DOCS.parent
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    files = []
    for name in filter(None, listed.split("\0")):
        path = root / name
        try:
            path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # images and other binaries; files deleted but not yet staged
        if path != Path(__file__).resolve():
            files.append(path)
    return files


# A Markdown link up a folder, `[Device reads](../syncs.md)`: the target's path.
PARENT_LINK: Final = re.compile(r"\]\((\.\./[^)#\s]*)")


def _without_links_inside(path: Path, line: str) -> str:
    """`line` with each Markdown link up a folder that lands inside the repository
    (docs/reference/'s pages link `../syncs.md`) written from the root instead; a link
    that leaves it stays as it is."""
    root = DOCS.parent.resolve()

    def inside(link: re.Match[str]) -> str:
        target = (path.parent / link.group(1)).resolve()
        if not target.is_relative_to(root):
            return link.group(0)
        return "](" + target.relative_to(root).as_posix()

    return PARENT_LINK.sub(inside, line)


def test_tracked_text_files_stand_on_their_own() -> None:
    """No tracked text file cites an issue number or a path outside the repository."""
    files = _tracked_text_files()
    assert any(path.name == "README.md" for path in files)
    cited = [
        f"{path.relative_to(DOCS.parent)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE_REFERENCES.search(_without_links_inside(path, line))
    ]
    assert cited == []


def test_a_link_up_a_folder_counts_only_when_it_leaves_the_repository() -> None:
    page = DOCS / "reference" / "checks.md"
    assert _without_links_inside(page, "see [reads](../syncs.md).") == "see [reads](docs/syncs.md)."
    outside = "see [notes](../../../notes.md)."
    assert OUTSIDE_REFERENCES.search(_without_links_inside(page, outside))


# Each kind of outside reference, put together from parts: the examples are
# not themselves references to anything.
_ISSUE, _PARENT, _DOC, _BRIEF = "issue", "..", "DESIGN", "brief"


@pytest.mark.parametrize(
    "line",
    [
        f"as {_ISSUE} 5 asks",
        "see #" + "12",
        f"from {_PARENT}/notes",
        f"{_DOC}.md section 1",
        f"per the {_BRIEF}",
    ],
)
def test_outside_references_are_caught(line: str) -> None:
    assert OUTSIDE_REFERENCES.search(line)


@pytest.mark.parametrize("line", ["see docs/design.md", "colour #1f77b4", "--seed 6", "a & b"])
def test_repository_references_pass(line: str) -> None:
    assert OUTSIDE_REFERENCES.search(line) is None
