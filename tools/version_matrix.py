"""Run the fast tests against other torch and Python versions, each in a fresh virtualenv.

pyproject.toml declares only what has been tested (see docs/versions.md). To
widen it, run this for the versions in question, then widen the range:

    python tools/version_matrix.py --torch 2.14.1 2.15.0
    python tools/version_matrix.py --python python3.12 --torch 2.13.0

Each cell makes a virtualenv under --root, installs that torch (the CPU build,
from PyTorch's CPU index, unless --index-url says otherwise), the project's
other dependencies, and the project itself without its pinned dependencies
(so the pin does not refuse the torch under test), then runs
`pytest -m "not slow"`. It prints one line per cell and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parent.parent
CPU_INDEX: Final = "https://download.pytorch.org/whl/cpu"
# The project's own dependencies except torch, and what the fast tests need.
OTHERS: Final = (
    "attrs>=24.1",
    "returns>=0.30,<0.31",
    "tqdm>=4.66,<5",
    "numpy>=1.26,<3",
    "immutables>=0.20,<1",
    "mypy>=1.19,<2.5",
    "pytest>=8,<10",
    "pytest-xdist>=3.6,<4",
    "hypothesis>=6.150,<7",
    "types-tqdm>=4.66,<5",
    "matplotlib>=3.8",
)


def run_cell(python: str, torch: str, root: Path, index_url: str) -> tuple[bool, str]:
    """Install one (Python, torch) pair into a fresh venv and run the fast tests there."""
    venv = root / f"{Path(python).name}-torch{torch}"
    bin_dir = venv / "bin"
    steps = [
        [python, "-m", "venv", str(venv)],
        [str(bin_dir / "pip"), "install", "-q", f"torch=={torch}", "--index-url", index_url],
        [str(bin_dir / "pip"), "install", "-q", *OTHERS],
        [str(bin_dir / "pip"), "install", "-q", "--no-deps", "-e", str(ROOT)],
        [str(bin_dir / "python"), "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider"],
    ]
    output = ""
    for step in steps:
        done = subprocess.run(step, cwd=ROOT, capture_output=True, text=True, check=False)
        output = done.stdout.strip()
        if done.returncode:
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            return False, f"{' '.join(step[:4])} failed: {' / '.join(tail)}"
    return True, output.splitlines()[-1] if output else ""  # pytest's summary line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", nargs="+", default=["2.13.0"], help="torch versions")
    parser.add_argument("--python", nargs="+", default=[sys.executable], help="interpreters")
    parser.add_argument("--index-url", default=CPU_INDEX, help="where torch comes from")
    parser.add_argument("--root", type=Path, default=None, help="where the venvs go (a temp dir)")
    args = parser.parse_args(argv)
    root = args.root or Path(tempfile.mkdtemp(prefix="batchstate-matrix-"))
    failed = 0
    for python in args.python:
        for torch in args.torch:
            start = time.perf_counter()
            ok, what = run_cell(python, torch, root, args.index_url)
            failed += not ok
            took = time.perf_counter() - start
            print(f"{'ok  ' if ok else 'FAIL'} {python} torch {torch} ({took:.0f} s): {what}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
