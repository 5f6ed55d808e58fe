"""A package's public names, each imported from its module on first use (PEP 562)."""

from __future__ import annotations

import ast
import importlib
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import NamedTuple

__all__ = ["Source", "attach", "typing_imports"]


class Source(NamedTuple):
    """Where a package's name is imported from: a module, and the name there."""

    module: str
    name: str


def attach(
    namespace: MutableMapping[str, object], deprecated: Mapping[str, str] | None = None
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A package's module `__getattr__` and `__dir__`, for `namespace`, its globals.

    Each name the `if TYPE_CHECKING:` block of the package's `__init__.py`
    imports (read once, with `ast`) is imported on first use from the module
    that block names, then kept in `namespace`: the imports are written once,
    where mypy and the docs read them. `__all__` is the package's face (what
    `import *` and the docs list); a name imported there but left out of it
    still loads, so that code written against an older, larger face keeps
    working. A name in `deprecated` (old name -> what to use instead) loads
    with a `DeprecationWarning` each time it is looked up.
    """
    package = str(namespace["__name__"])
    sources: dict[str, Source] = {}
    renamed = dict(deprecated or {})

    def load(name: str) -> object:
        if not sources:
            sources.update(typing_imports(Path(str(namespace["__file__"]))))
        source = sources.get(name)
        if source is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value: object = getattr(importlib.import_module(source.module), source.name)
        if name in renamed:
            warnings.warn(
                f"{package}.{name} is deprecated: use {renamed[name]}",
                DeprecationWarning,
                stacklevel=2,
            )
            return value  # not kept: each lookup warns
        namespace[name] = value  # later lookups find it without calling `load`
        return value

    def names() -> list[str]:
        public = namespace["__all__"]
        return sorted({*namespace, *(public if isinstance(public, list) else ())})

    return load, names


def typing_imports(init: Path) -> dict[str, Source]:
    """Each name that `init` imports under `if TYPE_CHECKING:`, and where it comes from."""
    tree = ast.parse(init.read_text(encoding="utf-8"))
    return {
        alias.asname or alias.name: Source(node.module, alias.name)
        for block in tree.body
        if isinstance(block, ast.If)
        and isinstance(block.test, ast.Name)
        and block.test.id == "TYPE_CHECKING"
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names
    }
