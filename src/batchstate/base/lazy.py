"""The package's public names, each imported from its module on first use (PEP 562)."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable, MutableMapping
from pathlib import Path

__all__ = ["attach"]


def attach(
    namespace: MutableMapping[str, object],
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A package's module `__getattr__` and `__dir__`, for `namespace`, its globals.

    Each name of the package's `__all__` is imported on first use from the
    module that the `if TYPE_CHECKING:` block of the package's `__init__.py`
    imports it from (read once, with `ast`), then kept in `namespace`: the
    imports are written once, where mypy and the docs read them.
    """
    package = str(namespace["__name__"])
    sources: dict[str, str] = {}

    def load(name: str) -> object:
        public = namespace["__all__"]
        if not isinstance(public, list) or name not in public:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if not sources:
            sources.update(typing_imports(Path(str(namespace["__file__"]))))
        if name not in sources:
            raise AttributeError(f"{package}.{name} is in __all__ but not imported for it")
        value: object = getattr(importlib.import_module(sources[name]), name)
        namespace[name] = value  # later lookups find it without calling `load`
        return value

    def names() -> list[str]:
        public = namespace["__all__"]
        return sorted({*namespace, *(public if isinstance(public, list) else ())})

    return load, names


def typing_imports(init: Path) -> dict[str, str]:
    """Each name that `init` imports under `if TYPE_CHECKING:`, and the module it comes from."""
    tree = ast.parse(init.read_text(encoding="utf-8"))
    return {
        alias.asname or alias.name: node.module
        for block in tree.body
        if isinstance(block, ast.If)
        and isinstance(block.test, ast.Name)
        and block.test.id == "TYPE_CHECKING"
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names
    }
