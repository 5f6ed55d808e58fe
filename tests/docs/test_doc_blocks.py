"""Every python code block of README.md and docs/ runs as written.

The conventions a block follows:

- A block fenced as ```` ```python ```` runs; any other (```` ```sh ````,
  ```` ```text ````, a bare fence) is not python and does not.
- A block runs alone, in a fresh namespace: it sees no other block's names.
- A fragment, a block that shows one step of a longer program, is marked by
  a visible line just before its fence that names its setup, a section of
  docs/fragment-setup.md: `> Fragment: continues [the setup](fragment-setup.md#on-the-cpu).`
  It runs after that section's python block, in a fresh namespace (`device`,
  `pools`, `running`, ...); an unmarked block gets nothing.
- A fragment that calls a library the project does not install (FlashInfer,
  FA3) on a GPU continues the `#on-a-cuda-device` setup and names the module:
  `...; needs flashinfer.` It runs where the module imports and a CUDA device
  is available, and is skipped, saying why, elsewhere.
- A whole program that runs only on a CUDA device says so just above it:
  `> Needs a CUDA device.`
- Every block passes `mypy --strict` with the project's configuration and
  plugins (a fragment after its setup): one mypy run checks the blocks that
  need no library, one run each library's. SGLang's are checked whether or not
  it is installed (pyproject reads it as Any); a library that is neither
  (FlashInfer, FA3 where absent) has its blocks skipped, named.
- The block's `assert`s are its checks: one that fails fails the test.
- `print(x)  # text`: a print whose line ends in a comment claims that it
  prints `text`. A block that makes such a claim must print exactly its
  claims, one line each, in order.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib.util
import io
import re
import tomllib
from pathlib import Path
from typing import Final

import attrs
import pytest
import torch

from tests.typecheck import mypy_errors

ROOT: Final = Path(__file__).resolve().parents[2]
SETUP_PAGE: Final = ROOT / "docs" / "fragment-setup.md"
FRAGMENT: Final = re.compile(
    r"^> Fragment: continues \[[^\]]+\]\((?:docs/)?fragment-setup\.md#(?P<setup>[\w-]+)\)"
    r"(?:; needs (?P<needs>[\w.]+)(?: \([^)]*\))?)?\.$"
)
CUDA_SETUP: Final = "on-a-cuda-device"
NEEDS_CUDA: Final = "> Needs a CUDA device."  # a whole program that runs only there
# A whole program that runs only where an optional package is installed.
NEEDS_PACKAGE: Final = re.compile(r"^> Needs the `(?P<module>[\w.]+)` package\b.*\.$")
FENCE: Final = re.compile(r"^```(\S*)\s*$")
CLAIM: Final = re.compile(r"^\s*print\(.*\)\s+# (.+)$")


@attrs.frozen
class Block:
    """One fenced code block: where it starts, its language, its text."""

    path: Path
    line: int  # of the opening fence, counted from 1
    language: str
    code: str
    setup: str = ""  # a fragment's: the section of docs/fragment-setup.md it continues
    needs: tuple[str, ...] = ()  # modules (or `cuda`) it runs only with

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def fragment(self) -> bool:
        return bool(self.setup)

    @property
    def program(self) -> str:
        """What runs: the block, after its setup's code if it is a fragment."""
        return (SETUPS[self.setup] + "\n" if self.setup else "") + self.code


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
        setup = mark["setup"] if mark else ""
        needs = (mark["needs"],) if mark and mark["needs"] else ()
        if before.strip() == NEEDS_CUDA:
            needs = ("cuda",)
        package = NEEDS_PACKAGE.match(before.strip())
        if package:
            needs = (package["module"],)
        blocks.append(
            Block(
                path=path,
                line=index + 1,
                language=opening.group(1),
                code="\n".join(lines[index + 1 : end]) + "\n",
                setup=setup,
                needs=(*needs, "cuda") if setup == CUDA_SETUP else needs,
            )
        )
        index = end + 1
    return blocks


def read_setups(text: str) -> dict[str, str]:
    """Each `## ` section of docs/fragment-setup.md, by its anchor: its python block's code."""
    setups: dict[str, str] = {}
    for section in text.split("\n## ")[1:]:
        heading, _, body = section.partition("\n")
        anchor = re.sub(r"[^\w]+", "-", heading.strip().lower()).strip("-")
        code = [b for b in read_blocks(SETUP_PAGE, body) if b.language == "python"]
        assert len(code) == 1, f"the section {heading!r} needs one python block"
        setups[anchor] = code[0].code
    return setups


SETUPS: Final = read_setups(SETUP_PAGE.read_text())
DOC_FILES: Final = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCKS: Final = [block for path in DOC_FILES for block in read_blocks(path, path.read_text())]
PYTHON: Final = [block for block in BLOCKS if block.language == "python"]


def run_block(block: Block, *, with_setup: bool) -> str:
    """Execute `block` in a fresh namespace (after its setup, if asked); return what it printed."""
    namespace: dict[str, object] = {"__name__": "doc_block"}
    code = block.program if with_setup else block.code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, block.name, "exec"), namespace)
    return printed.getvalue()


def claims(code: str) -> list[str]:
    """The lines a block's `print(...)  # text` comments say it prints."""
    return [match.group(1) for line in code.splitlines() if (match := CLAIM.match(line))]


def test_the_docs_have_python_blocks_and_fragments() -> None:
    """The collection finds what it should: the README's example, and fragments marked."""
    assert any(block.path.name == "README.md" for block in PYTHON)
    assert any(block.fragment for block in PYTHON)
    assert not any(block.fragment for block in BLOCKS if block.language != "python")
    assert set(SETUPS) == {"on-the-cpu", CUDA_SETUP, "a-mutable-batch"}


def test_fragments_are_marked_where_a_reader_sees_it() -> None:
    """No fragment is marked by an HTML comment (GitHub and the site hide it), and each
    visible mark names a setup that docs/fragment-setup.md shows."""
    for path in DOC_FILES:
        text = path.read_text()
        assert "<!-- fragment" not in text, path
        for line in text.splitlines():
            if line.startswith("> Fragment:") and path != SETUP_PAGE:
                mark = FRAGMENT.match(line)
                assert mark is not None and mark["setup"] in SETUPS, (path, line)


def _require(needs: tuple[str, ...]) -> None:
    # Skip, saying why, where a library a block calls (or a CUDA device) is missing.
    for need in needs:
        if need == "cuda":
            if not torch.cuda.is_available():
                pytest.skip("needs a CUDA device")
        elif need == "sglang":
            # Installed is enough: importing SGLang itself needs batchstate.sglang's stubs.
            if importlib.util.find_spec(need) is None:
                pytest.skip("needs SGLang 0.5.23: docs/sglang.md#install")
        else:
            pytest.importorskip(need)


@pytest.mark.parametrize("block", PYTHON, ids=lambda block: block.name)
def test_python_block_runs_as_written(block: Block) -> None:
    _require(block.needs)
    printed = run_block(block, with_setup=block.fragment)
    promised = claims(block.code)
    if promised:
        assert printed.splitlines() == promised


@pytest.mark.parametrize(
    "block", [block for block in PYTHON if block.fragment], ids=lambda block: block.name
)
def test_a_fragment_needs_its_setup(block: Block) -> None:
    """A block marked as a fragment does not run alone: the mark is not a way to skip it."""
    _require(block.needs)
    with pytest.raises(NameError):
        run_block(block, with_setup=False)


# The modules pyproject.toml's mypy overrides read as Any where they are not installed
# (`ignore_missing_imports`: SGLang, which ships no types).
ANY_WHEN_ABSENT: Final = tuple(
    module
    for override in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"][
        "overrides"
    ]
    if override.get("ignore_missing_imports")
    for module in (
        [override["module"]] if isinstance(override["module"], str) else override["module"]
    )
)
# Each library a block needs (FlashInfer, FA3, SGLang), beside a CUDA device.
LIBRARIES: Final = sorted({need for block in PYTHON for need in block.needs} - {"cuda"})


def _mypy_resolves(module: str) -> bool:
    """Whether mypy can check an import of `module` here: it is installed, or pyproject
    has mypy read it as Any where it is not (SGLang: its blocks are checked either way)."""
    read_as_any = any(
        module == pattern.removesuffix(".*") or fnmatch.fnmatchcase(module, pattern)
        for pattern in ANY_WHEN_ABSENT
    )
    return read_as_any or importlib.util.find_spec(module) is not None


@pytest.mark.xdist_group("mypy")
@pytest.mark.parametrize("library", ["", *LIBRARIES], ids=lambda library: library or "none")
def test_every_python_block_passes_mypy_strict(library: str) -> None:
    """README's and the docs' python blocks, each a module (a fragment after its setup),
    checked with pyproject's configuration: strict, returns' plugin and the package's own.
    One mypy run for the blocks that need no library (with both setups), and one for those
    that need each library; where mypy cannot resolve that library (not installed, and
    not read as Any), its blocks are skipped, named."""
    if library:
        blocks = [block for block in PYTHON if library in block.needs]
    else:
        blocks = [block for block in PYTHON if set(block.needs) <= {"cuda"}]
        blocks += [Block(SETUP_PAGE, 0, "python", code) for code in SETUPS.values()]
    assert blocks
    if library and not _mypy_resolves(library):
        names = ", ".join(block.name for block in blocks)
        pytest.skip(f"needs {library}, not installed here: {names} not type-checked")
    errors = mypy_errors({f"block_{index}": block.program for index, block in enumerate(blocks)})
    named = {
        block.name: errors[f"block_{index}"]
        for index, block in enumerate(blocks)
        if errors[f"block_{index}"]
    }
    assert named == {}


def test_every_block_is_in_one_type_check() -> None:
    """The runs above cover every python block: those needing no library, and each
    library's; SGLang's are checked with or without SGLang installed."""
    grouped = [block for block in PYTHON if set(block.needs) <= {"cuda"}]
    grouped += [block for library in LIBRARIES for block in PYTHON if library in block.needs]
    assert sorted(block.name for block in grouped) == sorted(block.name for block in PYTHON)
    assert set(LIBRARIES) >= {"sglang", "flashinfer"}
    assert _mypy_resolves("sglang") and _mypy_resolves("sglang.srt.managers")
    assert not _mypy_resolves("not_a_module_anywhere")


def test_a_wrong_claim_or_a_failing_assert_fails() -> None:
    """The checks can fail: a print that prints something else, an assert that is false."""
    wrong = Block(ROOT / "README.md", 1, "python", 'print("a")  # b\n')
    assert run_block(wrong, with_setup=False).splitlines() != claims(wrong.code)
    false = Block(ROOT / "README.md", 1, "python", "assert 1 == 2\n")
    with pytest.raises(AssertionError):
        run_block(false, with_setup=False)


@pytest.mark.xdist_group("mypy")
def test_the_type_check_can_fail() -> None:
    """The README's old example reused one name across phases; mypy --strict refuses it."""
    code = (
        "import torch\n"
        "from batchstate import Req, decode, extend, idle, make_pools, unwrap\n"
        "device = torch.device('cpu')\n"
        "pools = make_pools(8, 64, 256, device, page_size=16)\n"
        "batch, pools = unwrap(extend(idle(device), [Req(0, (5, 6, 7))], pools))\n"
        "batch, pools = unwrap(decode(batch, pools))\n"
    )
    (errors,) = mypy_errors({"reused": code}).values()
    assert any("Incompatible types in assignment" in error for error in errors), errors


def test_blocks_are_read_with_their_language_and_mark() -> None:
    mark = "> Fragment: continues [the setup](fragment-setup.md#on-the-cpu)."
    text = f"intro\n\n{mark}\n```python\nx = 1\n```\n\n```sh\nls\n```\n\n```\nplain\n```\n"
    blocks = read_blocks(ROOT / "docs" / "example.md", text)
    assert [(b.language, b.setup, b.code) for b in blocks] == [
        ("python", "on-the-cpu", "x = 1\n"),
        ("sh", "", "ls\n"),
        ("", "", "plain\n"),
    ]
    assert blocks[0].line == 4
    needing = read_blocks(
        ROOT / "docs" / "example.md",
        "> Fragment: continues [the setup on a CUDA device](fragment-setup.md#on-a-cuda-device);"
        " needs flash_attn_interface (FA3).\n```python\n```\n",
    )
    assert [(b.setup, b.needs) for b in needing] == [(CUDA_SETUP, ("flash_attn_interface", "cuda"))]
