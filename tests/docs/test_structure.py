"""The house by concept: layers that only point down, and nothing private crosses a folder.

import-linter's contracts (pyproject.toml) hold the layers, forbid import circles among
any package's modules and keep private modules inside their package; the checks below
add what import-linter cannot see: a private name imported from, or a private member
read on a value of, another subpackage.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Final

import pytest

SRC: Final = Path(__file__).resolve().parents[2] / "src" / "batchstate"
# Members every NamedTuple has, public API though they start with an underscore.
_NAMEDTUPLE: Final = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})


def _folder(path: Path) -> str:
    """The subpackage a module belongs to (a top-level module is its own)."""
    parts = path.relative_to(SRC).parts
    return parts[0] if len(parts) > 1 else path.stem


def _modules() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in sorted(SRC.rglob("*.py"))}


def test_import_contracts_hold() -> None:
    linter = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if linter is None:
        pytest.skip("import-linter is not installed (the dev extra installs it)")
    done = subprocess.run([linter], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_private_name_is_imported_across_subpackages() -> None:
    crossings = [
        f"{path.relative_to(SRC)}: {node.module}.{alias.name}"
        for path, tree in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("batchstate.")
        for alias in node.names
        if alias.name.startswith("_")
        and not alias.name.startswith("__")
        and (node.module or "").split(".")[1] != _folder(path)
    ]
    assert crossings == []


def test_no_private_member_is_read_across_subpackages() -> None:
    """`value._member` outside the subpackage whose classes define `_member`.

    By name, as a reader sees it: a member of one folder's classes read through any value
    of another folder (not `self`), where the reading folder defines no member of that name.
    """
    modules = _modules()
    defined: defaultdict[str, set[str]] = defaultdict(set)
    for path, tree in modules.items():
        for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
            for item in cls.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names = [item.name]
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names = [item.target.id]
                else:
                    continue
                for name in names:
                    if name.startswith("_") and not name.startswith("__"):
                        defined[name].add(_folder(path))
            for node in ast.walk(cls):  # `self._member = ...` in a method defines one too
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                    and node.attr.startswith("_")
                ):
                    defined[node.attr].add(_folder(path))
    crossings = sorted(
        f"{path.relative_to(SRC)}:{node.lineno}: .{node.attr} ({sorted(defined[node.attr])})"
        for path, tree in modules.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in defined
        and node.attr not in _NAMEDTUPLE
        and _folder(path) not in defined[node.attr]
        and not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"})
    )
    assert crossings == []
