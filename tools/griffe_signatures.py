"""A griffe extension for the API reference: signatures say only what a caller can write.

mkdocs.yml loads it (`extensions: [tools/griffe_signatures.py]`). Two fixes:

- Overloads. With `overloads_only`, mkdocstrings shows an overloaded
  function's `@overload` signatures and hides its implementation's, but the
  docstring's Parameters and Returns sections still take their types and
  defaults from the implementation: `columns (Any, default: NO_COLUMNS)`.
  The implementation gets the types every overload that has the parameter
  agrees on, none where they differ (the signatures above say those), and
  no default where the overloads declare none.
- Private defaults. A field or parameter whose default is a constant the
  package does not export (`columns: C = NO_COLUMNS`) shows the constant's
  value instead (`NoColumns()`), which a reader can look up.
"""

from __future__ import annotations

from typing import Any

import griffe

Default = str | griffe.Expr | None


def _common(values: list[str | None]) -> str | None:
    """The one value every overload gives, or None where they differ."""
    return values[0] if values and all(value == values[0] for value in values) else None


def _text(expression: Default) -> str | None:
    return None if expression is None else str(expression)


def _exported(package: griffe.Module) -> set[str]:
    """The names in `__all__` of the package and of its public submodules."""
    names: set[str] = set()
    pending = [package]
    while pending:
        module = pending.pop()
        names.update(str(name) for name in module.exports or ())
        pending.extend(
            sub
            for name, sub in module.members.items()
            if isinstance(sub, griffe.Module) and not name.startswith("_")
        )
    return names


def _public_value(value: Default, package: griffe.Module, exported: set[str]) -> Default:
    """`value`, or the value of the unexported constant it names."""
    if not isinstance(value, griffe.ExprName):
        return value
    top, _, rest = value.canonical_path.partition(".")
    if top != package.name or not rest or value.name in exported:
        return value
    try:
        target = package[rest]
    except KeyError:
        return value
    if isinstance(target, griffe.Attribute) and target.value is not None:
        return target.value
    return value


class PublicSignatures(griffe.Extension):
    """Show overloaded functions as their overloads, and private defaults as their values."""

    def on_function_instance(
        self,
        *,
        node: object,
        func: griffe.Function,
        agent: griffe.Visitor | griffe.Inspector,
        **kwargs: Any,  # griffe's hook signature
    ) -> None:
        overloads = func.overloads
        if not overloads:
            return
        for parameter in func.parameters:
            seen = [
                variant.parameters[parameter.name]
                for variant in overloads
                if parameter.name in variant.parameters
            ]
            annotation = _common([_text(variant.annotation) for variant in seen])
            parameter.annotation = None if annotation is None else seen[0].annotation
            default = _common([_text(variant.default) for variant in seen])
            parameter.default = None if default is None else seen[0].default
        returns = _common([_text(variant.returns) for variant in overloads])
        func.returns = None if returns is None else overloads[0].returns

    def on_package(
        self,
        *,
        pkg: griffe.Module,
        loader: griffe.GriffeLoader,
        **kwargs: Any,  # griffe's hook signature
    ) -> None:
        exported = _exported(pkg)
        pending: list[griffe.Object] = [pkg]
        while pending:
            current = pending.pop()
            for member in current.members.values():
                if isinstance(member, griffe.Alias):
                    continue  # documented where it is defined
                if isinstance(member, griffe.Attribute) and current.is_class:
                    member.value = _public_value(member.value, pkg, exported)
                elif isinstance(member, griffe.Function):
                    for parameter in member.parameters:
                        parameter.default = _public_value(parameter.default, pkg, exported)
                elif isinstance(member, (griffe.Module, griffe.Class)):
                    pending.append(member)
