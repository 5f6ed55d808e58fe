"""batchstate's mypy plugin: column sets checked where they are declared and where they flow.

Enable it beside returns' plugin, after it:

    [tool.mypy]
    plugins = ["returns.contrib.mypy.returns_plugin", "batchstate.mypy_plugin"]

It adds two checks that mypy's types alone cannot make (docs/api.md,
"Checking column sets with mypy"):

- a class deriving from `Columns` must be a frozen attrs class whose every
  field is `Mirrored[S]`, `DeviceOnly` or `HostColumn[S]`, `S` a numpy
  scalar type a column can hold; anything else is a `column-set` error on
  the field's line, naming it;
- a call of a package function generic over a column set takes that set
  from its arguments, never from its context: arguments of different sets
  are an `arg-type` error even nested in another call (`decode(merge(f, e),
  pools)`) or passed where `Any` goes, and the call's result carries the
  set its arguments agree on.

The plugin imports mypy, never torch or numpy; the package itself never
imports the plugin.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Final

from mypy.nodes import TypeInfo
from mypy.plugin import ClassDefContext, FunctionContext, Plugin, ReportConfigContext
from mypy.types import Type

from batchstate.mypy_plugin.calls import check_call, generic_signatures
from batchstate.mypy_plugin.declarations import COLUMNS, check_declaration

__all__ = ["plugin"]


class _BatchstatePlugin(Plugin):
    def report_config_data(self, ctx: ReportConfigContext) -> str:
        # mypy's cache keeps the errors of a module whose plugins are unchanged, and sees
        # only this file of them: the hash of every file behind the checks stands for them.
        return _SOURCES_HASH

    def get_base_class_hook(self, fullname: str) -> Callable[[ClassDefContext], None] | None:
        # The base named is Columns, or a class deriving from it (a set extending another).
        if fullname == COLUMNS:
            return check_declaration
        symbol = self.lookup_fully_qualified(fullname)
        node = symbol.node if symbol is not None else None
        return check_declaration if isinstance(node, TypeInfo) and node.has_base(COLUMNS) else None

    def get_function_hook(self, fullname: str) -> Callable[[FunctionContext], Type] | None:
        if not fullname.startswith("batchstate."):
            return None
        symbol = self.lookup_fully_qualified(fullname)
        signatures = generic_signatures(symbol.node if symbol is not None else None)
        if not signatures:
            return None
        return functools.partial(
            check_call, name=fullname.rsplit(".", maxsplit=1)[-1], signatures=signatures
        )


def _sources_hash() -> str:
    # The plugin's own modules and the scalar names it reads: a change to any is a new plugin.
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for path in (
        package / "__init__.py",
        package / "calls.py",
        package / "declarations.py",
        package.parent / "base" / "scalars.py",
    ):
        digest.update(path.read_bytes())
    return digest.hexdigest()


_SOURCES_HASH: Final = _sources_hash()


def plugin(version: str) -> type[Plugin]:
    """mypy's entry point: the plugin class, for every mypy the project supports."""
    return _BatchstatePlugin
