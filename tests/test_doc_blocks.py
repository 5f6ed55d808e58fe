"""Every python code block of README.md and docs/ runs as written.

The conventions a block follows:

- A block fenced as ```` ```python ```` runs; any other (```` ```sh ````,
  ```` ```text ````, a bare fence) is not python and does not.
- A block runs alone, in a fresh namespace: it sees no other block's names.
- A fragment, a block that shows one step of a longer program, is marked by
  the line `<!-- fragment -->` just before its fence (invisible on GitHub
  and in the built site). It runs in a fresh copy of the globals of
  tests/doc_prelude.py, which defines what fragments use (`device`,
  `pools`, `running`, ...); an unmarked block gets nothing.
- A block that calls a library the project does not install (FlashInfer,
  FA3) on a GPU is marked `<!-- fragment; needs: flashinfer, cuda -->`: it
  runs as a fragment where each named module imports (`cuda`: where a CUDA
  device is available), and is skipped, saying why, elsewhere.
- The block's `assert`s are its checks: one that fails fails the test.
- `print(x)  # text`: a print whose line ends in a comment claims that it
  prints `text`. A block that makes such a claim must print exactly its
  claims, one line each, in order.
"""

from __future__ import annotations

import contextlib
import io
import re
import runpy
from pathlib import Path
from typing import Final

import attrs
import pytest
import torch

ROOT: Final = Path(__file__).resolve().parent.parent
PRELUDE: Final = Path(__file__).resolve().parent / "doc_prelude.py"
FRAGMENT: Final = re.compile(r"^<!-- fragment(?:; needs: ([\w., ]+))? -->$")
FENCE: Final = re.compile(r"^```(\S*)\s*$")
CLAIM: Final = re.compile(r"^\s*print\(.*\)\s+# (.+)$")


@attrs.frozen
class Block:
    """One fenced code block: where it starts, its language, its text."""

    path: Path
    line: int  # of the opening fence, counted from 1
    language: str
    code: str
    fragment: bool
    needs: tuple[str, ...] = ()  # modules (or `cuda`) it runs only with

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def read_blocks(path: Path, text: str) -> list[Block]:
    """The fenced code blocks of `text`, the Markdown file at `path`, in order."""
    lines = text.splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = next(
            (i for i in range(index + 1, len(lines)) if lines[i].rstrip() == "```"), len(lines)
        )
        before = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        mark = FRAGMENT.match(before.strip())
        blocks.append(
            Block(
                path=path,
                line=index + 1,
                language=opening.group(1),
                code="\n".join(lines[index + 1 : end]) + "\n",
                fragment=mark is not None,
                needs=tuple(n.strip() for n in (mark.group(1) or "").split(",") if n.strip())
                if mark
                else (),
            )
        )
        index = end + 1
    return blocks


DOC_FILES: Final = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCKS: Final = [block for path in DOC_FILES for block in read_blocks(path, path.read_text())]
PYTHON: Final = [block for block in BLOCKS if block.language == "python"]


def run_block(block: Block, *, with_prelude: bool) -> str:
    """Execute `block` in a fresh namespace (the prelude's, if asked); return what it printed."""
    namespace: dict[str, object] = (
        dict(runpy.run_path(str(PRELUDE))) if with_prelude else {"__name__": "doc_block"}
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block.code, block.name, "exec"), namespace)
    return printed.getvalue()


def claims(code: str) -> list[str]:
    """The lines a block's `print(...)  # text` comments say it prints."""
    return [match.group(1) for line in code.splitlines() if (match := CLAIM.match(line))]


def test_the_docs_have_python_blocks_and_fragments() -> None:
    """The collection finds what it should: the README's example, and fragments marked."""
    assert any(block.path.name == "README.md" for block in PYTHON)
    assert any(block.fragment for block in PYTHON)
    assert not any(block.fragment for block in BLOCKS if block.language != "python")


def _require(needs: tuple[str, ...]) -> None:
    # Skip, saying why, where a library a block calls (or a CUDA device) is missing.
    for need in needs:
        if need == "cuda":
            if not torch.cuda.is_available():
                pytest.skip("needs a CUDA device")
        else:
            pytest.importorskip(need)


@pytest.mark.parametrize("block", PYTHON, ids=lambda block: block.name)
def test_python_block_runs_as_written(block: Block) -> None:
    _require(block.needs)
    printed = run_block(block, with_prelude=block.fragment)
    promised = claims(block.code)
    if promised:
        assert printed.splitlines() == promised


@pytest.mark.parametrize(
    "block", [block for block in PYTHON if block.fragment], ids=lambda block: block.name
)
def test_a_fragment_needs_the_prelude(block: Block) -> None:
    """A block marked as a fragment does not run alone: the mark is not a way to skip it."""
    _require(block.needs)
    with pytest.raises(NameError):
        run_block(block, with_prelude=False)


def test_a_wrong_claim_or_a_failing_assert_fails() -> None:
    """The checks can fail: a print that prints something else, an assert that is false."""
    wrong = Block(ROOT / "README.md", 1, "python", 'print("a")  # b\n', fragment=False)
    assert run_block(wrong, with_prelude=False).splitlines() != claims(wrong.code)
    false = Block(ROOT / "README.md", 1, "python", "assert 1 == 2\n", fragment=False)
    with pytest.raises(AssertionError):
        run_block(false, with_prelude=False)


def test_blocks_are_read_with_their_language_and_mark() -> None:
    text = (
        "intro\n\n<!-- fragment -->\n```python\nx = 1\n```\n\n```sh\nls\n```\n\n```\nplain\n```\n"
    )
    blocks = read_blocks(ROOT / "docs" / "example.md", text)
    assert [(b.language, b.fragment, b.code) for b in blocks] == [
        ("python", True, "x = 1\n"),
        ("sh", False, "ls\n"),
        ("", False, "plain\n"),
    ]
    assert blocks[0].line == 4
    needing = read_blocks(
        ROOT / "docs" / "example.md", "<!-- fragment; needs: flashinfer, cuda -->\n```python\n```\n"
    )
    assert [(b.fragment, b.needs) for b in needing] == [(True, ("flashinfer", "cuda"))]
