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
from typing import Final

ROOT: Final = Path(__file__).resolve().parent.parent
_LINE: Final = re.compile(r"^(?P<module>\w+)\.py:\d+: error: (?P<message>.*)$")


def mypy_errors(snippets: Mapping[str, str]) -> dict[str, list[str]]:
    """Error messages mypy reports for each snippet, keyed like `snippets`.

    Keys must be valid module names. Uses `pyproject.toml` (strict, returns
    plugin), with a cache under `.mypy_cache` so that warm runs are fast.
    """
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
    errors: dict[str, list[str]] = {name: [] for name in snippets}
    for line in result.stdout.splitlines():
        match = _LINE.match(line)
        if match and match["module"] in errors:
            errors[match["module"]].append(match["message"])
    return errors
