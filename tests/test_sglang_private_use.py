"""batchstate.sglang uses batchstate's public API, but for one adapter module (eviction)."""

from __future__ import annotations

import ast
from pathlib import Path

SGLANG = Path(__file__).parents[1] / "src" / "batchstate" / "sglang"


def _private_batchstate_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("batchstate._"):
            found.append(node.module or "")
    return found


def test_only_the_cache_adapter_imports_batchstate_privates() -> None:
    users = {p.name: _private_batchstate_imports(p) for p in sorted(SGLANG.glob("*.py"))}
    assert {name for name, found in users.items() if found} == {"_cache_adapter.py"}
    assert len(users) > 10  # the package was found


def test_the_replica_reads_no_private_attribute_of_a_cache_or_pools() -> None:
    text = (SGLANG / "replica.py").read_text()
    for name in ("._leaves", "._nodes", "._evict", "._lock", "._unlock", "._commit"):
        assert name not in text
