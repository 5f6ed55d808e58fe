"""Run mypy (the project's own configuration) over code snippets, from pytest.

One mypy run checks every snippet of a test module, each as its own module,
so a cold run over torch is paid once per module, not once per case.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Final, NamedTuple

ROOT: Final = Path(__file__).resolve().parent.parent
_LINE: Final = re.compile(r"^(?P<module>\w+)\.py:\d+: (?P<kind>error|note): (?P<message>.*)$")
_REVEALED: Final = re.compile(r'^Revealed type is "(?P<type>.*)"$')


class Report(NamedTuple):
    """What mypy said about one snippet: its errors, and each `reveal_type`'s type, in order."""

    errors: list[str]
    revealed: list[str]


def mypy_errors(snippets: Mapping[str, str]) -> dict[str, list[str]]:
    """Error messages mypy reports for each snippet, keyed like `snippets`.

    Keys must be valid module names. Uses `pyproject.toml` (strict, the returns
    and batchstate plugins), with a cache under `.mypy_cache` so that warm runs
    are fast.
    """
    return {name: report.errors for name, report in mypy_reports(snippets).items()}


def mypy_reports(snippets: Mapping[str, str]) -> dict[str, Report]:
    """mypy's errors and revealed types for each snippet, keyed like `snippets`."""
    with tempfile.TemporaryDirectory() as folder:
        for name, code in snippets.items():
            (Path(folder) / f"{name}.py").write_text(code)
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "mypy",
                "--config-file",
                str(ROOT / "pyproject.toml"),
                "--cache-dir",
                str(ROOT / ".mypy_cache" / "snippets"),
                "--no-error-summary",
                "--hide-error-context",
                *(f"{name}.py" for name in snippets),
            ],
            cwd=folder,
            capture_output=True,
            text=True,
            check=False,
        )
    if result.returncode not in (0, 1):
        raise RuntimeError(f"mypy crashed:\n{result.stdout}\n{result.stderr}")
    reports: dict[str, Report] = {name: Report([], []) for name in snippets}
    for line in result.stdout.splitlines():
        match = _LINE.match(line)
        if not match or match["module"] not in reports:
            continue
        report = reports[match["module"]]
        revealed = _REVEALED.match(match["message"])
        if match["kind"] == "error":
            report.errors.append(match["message"])
        elif revealed:
            report.revealed.append(revealed["type"])
    return reports
