"""One check for the doors that take a value of one type: a `TypeError` naming the argument.

For callers without mypy: an argument of another type would otherwise fail
deep inside with an `AttributeError` naming none of the caller's names.
"""

from __future__ import annotations

__all__ = ["expect_instance"]


def expect_instance(value: object, kind: type | tuple[type, ...], where: str) -> None:
    """Raise `TypeError` unless `value` is a `kind`; `where` names the function and argument."""
    if not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        expected = " or ".join(each.__name__ for each in kinds)
        raise TypeError(f"{where} must be {expected}, got {type(value).__name__}")
