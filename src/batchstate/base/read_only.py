"""Deep copies and pickles of records and pools that keep their host arrays read-only.

numpy's `deepcopy` and pickle hand back writable arrays, so a copied record's
mirror could be written without its device side. The classes here rebuild a
copy field by field instead (`__reduce__`, which both `copy.deepcopy` and
pickle use) and freeze every numpy array among the fields, and those of the
column set a record carries. A copied `Pools` is a lineage of its own: its
table, free lists and version stamp are copies too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final, TypeVar, cast

import attrs
import numpy as np

__all__ = ["by_fields", "read_only_copies"]

_T = TypeVar("_T")
_MARK: Final = "_batchstate_read_only_copies"


def read_only_copies(cls: type[_T]) -> type[_T]:
    """Class decorator for attrs classes: copies and unpickled values keep arrays read-only.

    A class may define `_rebuilt(self)` to restore what a field-by-field
    copy cannot (a view of another field, say).
    """
    cls.__reduce__ = by_fields  # type: ignore[method-assign]  # the point
    setattr(cls, _MARK, True)
    return cls


def by_fields(self: object) -> tuple[Callable[..., object], tuple[object, ...]]:
    """`__reduce__` of an attrs instance: its fields alone, arrays frozen on the way back.

    What its `__dict__` holds besides them (a column set's packs, say) is
    left behind.
    """
    names = _NAMES.get(type(self))
    if names is None:
        fields = attrs.fields(cast("type[attrs.AttrsInstance]", type(self)))
        names = _NAMES[type(self)] = tuple(field.name for field in fields)
    return (_rebuild, (type(self), {name: getattr(self, name) for name in names}))


_NAMES: dict[type, tuple[str, ...]] = {}


def _rebuild(cls: type[object], state: Mapping[str, object]) -> object:
    value = object.__new__(cls)
    for name, field in state.items():
        _freeze(field)
        object.__setattr__(value, name, field)
    rebuilt = getattr(value, "_rebuilt", None)
    if rebuilt is not None:
        rebuilt()
    return value


def _freeze(value: object) -> None:
    # Arrays read-only; a column set's fields too (its class is the user's, not marked).
    if isinstance(value, np.ndarray):
        value.setflags(write=False)
    elif attrs.has(type(value)) and not getattr(type(value), _MARK, False):
        for field in attrs.fields(cast("type[attrs.AttrsInstance]", type(value))):
            inner = getattr(value, field.name)
            if isinstance(inner, np.ndarray):
                inner.setflags(write=False)
