"""Without SGLang or the `sglang` extra, docs/sglang.md's examples stop at their first
SGLang call with an ImportError that gives docs/sglang.md's install commands, not a bare
`ModuleNotFoundError: transformers`. Runs with or without SGLang installed: each case
hides what it lacks from a fresh interpreter."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest

DOCS: Final = Path(__file__).resolve().parents[2] / "docs" / "sglang.md"

# docs/sglang.md's audit example, up to its first SGLang call, in an interpreter where
# the modules named on its command line are not importable.
_PROBE: Final = """\
import sys
for name in sys.argv[1:]:
    sys.modules[name] = None  # importing it raises ModuleNotFoundError
from batchstate.sglang import Watch, audit, cpu_topology
with cpu_topology(), Watch() as watch:
    pass
"""


def _install_commands() -> list[str]:
    section = DOCS.read_text().split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, re.S)


@pytest.mark.parametrize(
    "hidden", [("sglang",), ("transformers",), ("sglang", "transformers")], ids="+".join
)
def test_a_missing_sglang_or_extra_names_the_install_commands(hidden: tuple[str, ...]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *hidden],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: batchstate.sglang runs SGLang's scheduler; "), last
    for name in hidden:
        assert name in last.split(" not installed: ")[0], last
    commands = _install_commands()
    assert len(commands) == 2
    for command in commands:
        assert command in last, (command, last)
