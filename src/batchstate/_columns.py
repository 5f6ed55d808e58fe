"""Per-row columns a scheduler declares once and every transition carries.

A column set is a frozen attrs class deriving from `Columns`, one field per
column, each one of:

- `Mirrored[np.float32]` (a numpy scalar type of `SCALAR_NAMES`): a device
  tensor and its read-only host mirror, taken and concatenated on the host
  and uploaded with the transition's other columns, in the same copy;
- `DeviceOnly`: a device tensor the host never reads, gathered and
  concatenated on the device (the host does not know its values);
- `HostColumn[np.int64]` (a read-only numpy array): host data only.

Any other field, or a set that is not frozen attrs of its own, is a
`ColumnError` when a transition first reads the class, and a mypy error
where it is written with `batchstate.mypy_plugin` enabled.

This module holds the declaration: the base classes, the type variables
transitions are generic over, and the reading of a set's fields (kinds and
dtypes, once per class). How a set's values are stored (its columns of one
dtype packed into one array) is `_column_packs`, building a set
`_column_building`, checking one `_column_checks`, and taking, joining and
slicing its rows `_column_rows`: filter, split, merge and decode handle
every field through those functions, so a column can be forgotten in no
lifecycle method: there is none to write. The library never names a column.

>>> import torch
>>> from batchstate import build_columns
>>> @attrs.frozen(eq=False)
... class Lora(Columns):
...     adapter: Mirrored[np.int32]
>>> lora = build_columns(Lora, {"adapter": [3, 0]}, torch.device("cpu"))
>>> lora.adapter.host.tolist(), lora.adapter.device.dtype
([3, 0], torch.int32)
"""

from __future__ import annotations

import sys
import typing
from typing import Final, NamedTuple, TypeAlias, final

import attrs
import numpy as np
import numpy.typing as npt
from typing_extensions import TypeVar

from batchstate._copies import by_fields
from batchstate._errors import ColumnError
from batchstate._mirrored import DeviceOnly, Mirrored
from batchstate._scalars import SCALAR_NAMES

__all__ = [
    "Columns",
    "HostColumn",
    "NoColumns",
]

ScalarT = TypeVar("ScalarT", bound=np.generic)
HostColumn: TypeAlias = npt.NDArray[ScalarT]  # a read-only host-only column


class Columns:
    """Base of a column set: subclass it with a frozen attrs class (`eq=False`)."""

    # No __slots__: a set the library builds keeps its values packed in its __dict__
    # (`_column_packs`: one array per dtype), each column a view made when first read.
    # A slot here would clash with the slots of any other base a set may have.

    # A copy or pickle carries the fields alone, frozen, and is re-packed like a set
    # built by hand: the packs (in `__dict__` when the class has no slots) stay behind.
    __reduce__ = by_fields

    if not typing.TYPE_CHECKING:  # mypy must not take every name for a column

        def __getattr__(self, name: str) -> object:
            # Only reached for a field not yet set: a packed set's column not yet read.
            from batchstate._column_packs import column_view  # noqa: PLC0415  # it imports this

            return column_view(self, name)


@final
@attrs.frozen(eq=False)
class NoColumns(Columns):
    """The default column set: no extra column, and no cost in any transition."""


NO_COLUMNS: Final = NoColumns()
C = TypeVar("C", bound=Columns, default=NoColumns)
D = TypeVar("D", bound=Columns, default=NoColumns)  # a second, independent column set


class _Field(NamedTuple):
    name: str
    kind: str  # "mirrored", "device" or "host"
    dtype: np.dtype[np.generic] | None  # None: a DeviceOnly field (no declared dtype)


def _fields(cls: type[Columns]) -> tuple[_Field, ...]:
    # A column set's fields, their kinds and dtypes, read once from its annotations.
    known = _FIELDS.get(cls)
    if known is None:
        known = _FIELDS[cls] = _read_fields(cls)
    return known


_FIELDS: dict[type[Columns], tuple[_Field, ...]] = {}


def _read_fields(cls: type[Columns]) -> tuple[_Field, ...]:
    # Its own decoration: an undecorated subclass of a set would inherit its fields and
    # silently drop the ones it declares itself.
    if not attrs.has(cls) or "__attrs_attrs__" not in vars(cls):
        raise ColumnError(f"{cls.__name__}: a column set must be an attrs class")
    # A mutable set would be shared by a transition's input and output: writing one
    # would change the other. attrs gives a frozen class its own __setattr__.
    if getattr(cls.__setattr__, "__name__", "") != "_frozen_setattrs":
        raise ColumnError(
            f"{cls.__name__}: a column set must be a frozen attrs class"
            " (@attrs.frozen, not @attrs.define)"
        )
    # The class's module first; the names a column is written with as a fallback
    # (a class made by `exec` or in a notebook may have no module to look in).
    module = sys.modules.get(cls.__module__)
    hints = typing.get_type_hints(
        cls, globalns=dict(vars(module)) if module else {}, localns=_NAMES
    )
    fields = []
    for field in attrs.fields(cls):
        if field.converter is not None:
            # Transitions rebuild a set from its columns' rows: a converter would run
            # again at every step, on values it already converted.
            raise ColumnError(
                f"{cls.__name__}.{field.name}: a column takes no converter; convert the"
                " values before `build_columns` (a validator may check them)"
            )
        hint = hints[field.name]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if hint is DeviceOnly:
            fields.append(_Field(field.name, "device", None))
        elif origin is Mirrored or hint is Mirrored:
            scalar = args[0] if args else np.int64
            fields.append(
                _Field(field.name, "mirrored", _dtype(f"{cls.__name__}.{field.name}", scalar))
            )
        elif origin is np.ndarray and len(args) == 2:
            scalar = typing.get_args(args[1])[0]
            fields.append(
                _Field(field.name, "host", _dtype(f"{cls.__name__}.{field.name}", scalar))
            )
        else:
            raise ColumnError(
                f"{cls.__name__}.{field.name}: a column is Mirrored[...], DeviceOnly or"
                f" HostColumn[...], got {hint}"
            )
    return tuple(fields)


def _dtype(where: str, scalar: type[np.generic]) -> np.dtype[np.generic]:
    # A column's numpy scalar type must be one of SCALAR_NAMES, the mypy plugin's list too.
    try:
        dtype: np.dtype[np.generic] | None = np.dtype(scalar)
    except TypeError:  # an abstract type (np.integer), which has no dtype
        dtype = None
    if dtype is None or dtype not in _SCALARS:
        raise ColumnError(
            f"{where}: a column's scalar type is one of"
            f" {', '.join(f'np.{scalar}' for scalar in SCALAR_NAMES)}, got {scalar}"
        )
    return dtype


_SCALARS: Final = frozenset(np.dtype(getattr(np, scalar)) for scalar in SCALAR_NAMES)


_NAMES: Final = {
    "Mirrored": Mirrored,
    "DeviceOnly": DeviceOnly,
    "HostColumn": HostColumn,
    "np": np,
    "numpy": np,
}
