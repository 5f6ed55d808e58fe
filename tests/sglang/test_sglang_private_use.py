"""batchstate.sglang uses batchstate's public namespaces; it evicts named prefixes through
batchstate.pools.eviction, and touches the prefix cache's tree operations nowhere."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SGLANG = Path(__file__).parents[2] / "src" / "batchstate" / "sglang"
# What batchstate.sglang may import from: the package, its public namespaces, and itself.
PUBLIC = re.compile(
    r"batchstate(\.(errors|audit|engine|base|columns|cache|memory|pools(\.eviction)?|records|transitions"
    r"|speculative|forward|captured|checks|table|backends)|\.sglang(\.\w+)*)?"
)


def _imports(path: Path) -> list[str]:
    return [
        node.module or ""
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("batchstate")
    ]


def test_every_import_is_of_a_public_namespace() -> None:
    found = {str(p.relative_to(SGLANG)): _imports(p) for p in sorted(SGLANG.rglob("*.py"))}
    assert len(found) > 10  # the package was found
    inner = {
        name: [m for m in modules if not PUBLIC.fullmatch(m)] for name, modules in found.items()
    }
    assert {name: modules for name, modules in inner.items() if modules} == {}


def test_no_shadow_module_uses_the_tree_operations() -> None:
    """Mirroring SGLang's evictions leaf by leaf takes the prefix cache's tree operations:
    batchstate.pools.eviction does it, for every shadow."""
    operations = re.compile(r"\.(nodes\(\)|lock\(|unlock\()")
    users = {path.name for path in SGLANG.rglob("*.py") if operations.search(path.read_text())}
    assert users == set()
    assert operations.search((SGLANG.parent / "pools" / "eviction.py").read_text())
