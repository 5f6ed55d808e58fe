"""Every `--option` the docs, the README and the help name is one `batchstate` has.

Options of other tools are allowed only where the same section of a page
names the tool, and only those listed for it below.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Final

import pytest

from batchstate.cli._parser import build_parser

ROOT: Final = Path(__file__).resolve().parents[2]
OPTION: Final = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# A line of an ASCII diagram: `Idle --extend()--> Extended` draws an arrow, not an option.
ARROW: Final = "-->"

# The other tools the pages run, and the options of theirs they name.
OTHER_TOOLS: Final = {
    "torchrun": {"--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port"},
    "mkdocs": {"--strict"},
    "mypy": {"--strict"},
    "benchmarks.step": {
        "--docs",
        "--sizes",
        "--pages",
        "--repeats",
        "--warmup",
        "--alone",
        "--columns",
    },
    "benchmarks.profile": {"--sizes", "--page", "--steps", "--top", "--production"},
    "benchmarks.sglang_step": {"--quick", "--sizes", "--pages", "--steps", "--warmup", "--json"},
    "batchstate.sglang.launch": {"--shadow", "--shadow-full-check-every", "--drive"},
    "benchmarks.sglang_drive": {"--steps", "--sizes"},
    # SGLang's own server arguments, named where drive mode says which it refuses.
    "sglang.launch_server": {
        "--model-path",
        "--speculative-algorithm",
        "--disable-radix-cache",
        "--enable-mixed-chunk",
        "--enable-hierarchical-cache",
        "--enable-lmcache",
        "--enable-hisparse",
        "--enable-session-radix-cache",
        "--disaggregation-mode",
        "--enable-dp-attention",
        "--dp-size",
        "--tp-size",
        "--pp-size",
        "--enable-lora",
        "--enable-priority-scheduling",
        "--num-continuous-decode-steps",
        "--enable-two-batch-overlap",
        "--enable-pdmux",
        "--dllm-algorithm",
    },
    "benchmarks.columns": {"--sizes", "--pages", "--repeats", "--warmup"},
    "benchmarks.production": {
        "--docs",
        "--sizes",
        "--pages",
        "--repeats",
        "--rounds",
        "--warmup",
        "--threads",
        "--columns",
    },
    "tools/soak.py": {"--threads", "--production", "--requests", "--check-every", "--seed"},
    "tools/mutation.py": {"--max-children", "--left", "--survivors", "--report"},
    "mutmut": {"--max-children"},
    "pip install": {"--index-url", "--extra-index-url", "--no-deps"},
    "tools/version_matrix.py": {"--torch", "--python", "--index-url", "--root"},
    "tools/figures.py": {"--suite"},
}


def _parsers() -> list[argparse.ArgumentParser]:
    found: list[argparse.ArgumentParser] = [build_parser()]
    for parser in found:  # grows as subcommands are found
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                found.extend(action.choices.values())
    return found


def _options() -> set[str]:
    return {option for parser in _parsers() for a in parser._actions for option in a.option_strings}


def _sections(text: str) -> list[str]:
    return re.split(r"^#+ ", text, flags=re.MULTILINE)


def _unknown(text: str, options: set[str]) -> list[tuple[str, str]]:
    """`(option, line)` for each option in `text` that is neither `options` nor allowed."""
    unknown = []
    for section in _sections(text):
        allowed = set(options)
        for tool, theirs in OTHER_TOOLS.items():
            if tool in section:
                allowed |= theirs
        for line in section.splitlines():
            if ARROW in line:
                continue
            unknown += [(name, line) for name in OPTION.findall(line) if name not in allowed]
    return unknown


PAGES: Final = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_pages_name_only_real_options(page: Path) -> None:
    assert _unknown(page.read_text(encoding="utf-8"), _options()) == []


def test_the_help_of_every_command_names_only_real_options() -> None:
    parsers = _parsers()
    assert len(parsers) >= 2  # `batchstate` and its commands
    options = _options()
    for parser in parsers:
        named = set(OPTION.findall(parser.format_help()))
        assert named - options == set(), parser.prog


def test_the_engine_and_cli_messages_name_only_real_options() -> None:
    """The engine's errors and docstrings speak of the command's options."""
    options = _options()
    files = [
        *sorted((ROOT / "src/batchstate/cli").glob("*.py")),
        *sorted((ROOT / "src/batchstate/engine").glob("*.py")),
    ]
    named = {
        f"{path.name}: {name}"
        for path in files
        for name in OPTION.findall(path.read_text(encoding="utf-8"))
        if name not in options
    }
    assert named == set()


@pytest.mark.parametrize(
    ("text", "unknown"),
    [
        ("run `batchstate simulate --no-chunks`", ["--no-chunks"]),  # not an option
        ("`pytest --durations 5`", ["--durations"]),  # a tool not in the list
        ("`torchrun --nnodes 2` and `--bogus`", ["--bogus"]),
        ("`--nnodes 2`", ["--nnodes"]),  # torchrun's, but torchrun is not named here
        ("Idle --extend()--> Extended", []),
        ("## A\n`torchrun`\n## B\n`--nnodes`", ["--nnodes"]),  # named in another section
    ],
)
def test_the_check_catches_what_it_should(text: str, unknown: list[str]) -> None:
    assert [name for name, _ in _unknown(text, _options())] == unknown
