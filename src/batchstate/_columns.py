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

Filter, split, merge and decode handle every field through the functions
here, so a column can be forgotten in no lifecycle method: there is none to
write. The library never names a column.

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
from collections.abc import Mapping, Sequence
from typing import Final, NamedTuple, TypeAlias, final

import attrs
import numpy as np
import numpy.typing as npt
import torch
from typing_extensions import TypeVar

from batchstate._column_values import exact_values
from batchstate._errors import ColumnError
from batchstate._mirrored import (
    DeviceOnly,
    HostArray,
    Mirrored,
    frozen,
    gather_rows,
    torch_dtype,
    upload,
)
from batchstate._scalars import SCALAR_NAMES

__all__ = [
    "Columns",
    "HostColumn",
    "NoColumns",
    "Pending",
    "build_columns",
    "cat_pending",
    "check_column_set",
    "empty_columns",
    "join_pending",
    "slice_columns",
    "take_pending",
]

ScalarT = TypeVar("ScalarT", bound=np.generic)
HostColumn: TypeAlias = npt.NDArray[ScalarT]  # a read-only host-only column


class Columns:
    """Base of a column set: subclass it with a frozen attrs class (`eq=False`)."""

    __slots__ = ()


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


def empty_columns(cls: type[C], device: torch.device) -> C:
    """Zero rows of every column of `cls`, both sides."""
    if cls is NoColumns:
        return NO_COLUMNS  # type: ignore[return-value]  # C is NoColumns here
    values: dict[str, object] = {}
    for field in _fields(cls):
        if field.kind == "mirrored":
            assert field.dtype is not None
            values[field.name] = Mirrored.empty(field.dtype.type, device)
        elif field.kind == "device":
            values[field.name] = DeviceOnly.empty(torch.int64, device)
        else:
            assert field.dtype is not None
            values[field.name] = frozen(np.empty(0, dtype=field.dtype))
    return cls(**values)


def build_columns(
    cls: type[C],
    values: Mapping[str, Sequence[object] | npt.NDArray[np.generic]],
    device: torch.device,
) -> C:
    """A column set for new rows from per-row host values, in one host-to-device copy.

    Args:
        cls: the column set.
        values: column name -> one value per row (Python scalars or a 1-D
            array). `DeviceOnly` fields take their dtype from the values.
        device: where the device sides live.

    Raises:
        ColumnError: a column is missing or unknown, the columns' lengths
            differ, or a value does not fit its column's dtype exactly (a
            float into an int column, an int out of range): nothing is
            wrapped or truncated.
    """
    fields = _fields(cls)
    names = {field.name for field in fields}
    if set(values) != names:
        raise ColumnError(f"{cls.__name__}: columns {sorted(names)} expected, got {sorted(values)}")
    lengths = {len(column) for column in values.values()}
    if len(lengths) > 1:
        raise ColumnError(f"{cls.__name__}: columns of different lengths {sorted(lengths)}")
    hosts = [
        exact_values(f"{cls.__name__}.{field.name}", values[field.name], field.dtype)
        for field in fields
    ]
    on_device = [host for host, field in zip(hosts, fields, strict=True) if field.kind != "host"]
    sides = upload(on_device, device)
    built: dict[str, object] = {}
    side = iter(sides)
    for host, field in zip(hosts, fields, strict=True):
        if field.kind == "mirrored":
            built[field.name] = Mirrored._pair(frozen(host.copy()), next(side))
        elif field.kind == "device":
            built[field.name] = DeviceOnly(next(side))
        else:
            built[field.name] = frozen(host.copy())
    return cls(**built)


def check_column_set(columns: Columns, length: int, device: torch.device, where: str) -> None:
    """Raise `ColumnError` unless every column has `length` rows of its dtype, on `device`."""
    if type(columns) is NoColumns:
        return
    for field in _fields(type(columns)):
        value = getattr(columns, field.name)
        name = f"{where}.{type(columns).__name__}.{field.name}"
        if field.kind == "mirrored" and isinstance(value, Mirrored):
            _check_host(name + ".host", value.host, field.dtype, length)
            _check_device(name + ".device", value.device, field.dtype, length, device)
        elif field.kind == "device" and isinstance(value, DeviceOnly):
            _check_device(name, value.device, None, length, device)
        elif field.kind == "host" and isinstance(value, np.ndarray):
            _check_host(name, value, field.dtype, length)
        else:
            raise ColumnError(f"{name}: expected a {field.kind} column, got {type(value).__name__}")


def _check_host(
    name: str, array: npt.NDArray[np.generic], dtype: np.dtype[np.generic] | None, length: int
) -> None:
    if array.shape != (length,) or array.dtype != dtype or array.flags.writeable:
        raise ColumnError(
            f"{name}: expected a read-only {dtype} array [{length}], got a"
            f" {'writable' if array.flags.writeable else 'read-only'} {array.dtype}"
            f" array {list(array.shape)}"
        )
    base = array.base
    while isinstance(base, np.ndarray):
        if base.flags.writeable:
            # Its owner can still write it: the records would change under a passing check.
            raise ColumnError(
                f"{name}: a read-only view of a writable array; pass a copy"
                f" (`frozen(array.copy())`) or build the set with `build_columns`"
            )
        base = base.base


def _check_device(
    name: str,
    tensor: torch.Tensor,
    dtype: np.dtype[np.generic] | None,
    length: int,
    device: torch.device,
) -> None:
    expected = None if dtype is None else torch_dtype(dtype)
    if (
        tensor.shape[:1] != (length,)
        or tensor.device != device
        or (expected is not None and tensor.dtype != expected)
    ):
        raise ColumnError(
            f"{name}: expected {expected or 'a tensor'} [{length}] on {device},"
            f" got {tensor.dtype} {list(tensor.shape)} on {tensor.device}"
        )


class Pending(NamedTuple):
    """A column set whose new host sides await the transition's upload.

    `hosts` join the other columns in one copy; `finish` takes their device
    copies back, in order, and returns the column set.
    """

    hosts: tuple[npt.NDArray[np.generic], ...]
    finish: typing.Callable[[Sequence[torch.Tensor]], Columns]


def take_pending(columns: C, index: HostArray) -> C | Pending:
    """The rows at host positions `index` of every column, mirrored hosts left for the upload.

    Host-only columns are taken now; `DeviceOnly` ones are gathered on the
    device once the positions are uploaded (the host does not know them).
    """
    if type(columns) is NoColumns:
        return columns
    fields = _fields(type(columns))
    hosts: list[npt.NDArray[np.generic]] = []
    built: dict[str, object] = {}
    gathers: list[str] = []
    for field in fields:
        value = getattr(columns, field.name)
        if field.kind == "mirrored":
            hosts.append(value.host.take(index))
        elif field.kind == "host":
            built[field.name] = frozen(value.take(index))
        else:
            gathers.append(field.name)
    if gathers:
        hosts.append(index)  # the gather needs the positions on the device

    def finish(sides: Sequence[torch.Tensor]) -> Columns:
        side = iter(sides)
        for field, host in zip((f for f in fields if f.kind == "mirrored"), hosts, strict=False):
            built[field.name] = Mirrored._pair(frozen(host), next(side))
        if gathers:
            positions = sides[-1]
            for name in gathers:
                built[name] = DeviceOnly(gather_rows(getattr(columns, name).device, positions))
        return type(columns)(**built)

    return Pending(tuple(hosts), finish)


def cat_pending(first: C, second: C) -> C | Pending:
    """Every column's rows of `first` followed by `second`'s, host sides left for the upload."""
    return join_pending((first, second))


def join_pending(parts: Sequence[C]) -> C | Pending:
    """Every column's rows of each part in turn, host sides left for the upload.

    Mirrored and host-only columns are joined on the host; `DeviceOnly` ones
    with one `cat` on the device each.
    """
    first = parts[0]
    if type(first) is NoColumns or len(parts) == 1:
        return first
    for part in parts[1:]:
        if type(part) is not type(first):
            raise ColumnError(
                f"cannot join {type(part).__name__} columns to {type(first).__name__} ones"
            )
    fields = _fields(type(first))
    hosts: list[npt.NDArray[np.generic]] = []
    built: dict[str, object] = {}
    for field in fields:
        values = [getattr(part, field.name) for part in parts]
        if field.kind == "mirrored":
            hosts.append(np.concatenate([value.host for value in values]))
        elif field.kind == "host":
            built[field.name] = frozen(np.concatenate(values))
        else:
            # An empty part (an `Idle` batch's) has no dtype of its own to give: leave it
            # out, so that `cat` keeps the rows' dtype instead of promoting to int64.
            tensors = [value.device for value in values if len(value)] or [values[0].device]
            built[field.name] = DeviceOnly(tensors[0] if len(tensors) == 1 else torch.cat(tensors))

    def finish(sides: Sequence[torch.Tensor]) -> Columns:
        mirrored = [field for field in fields if field.kind == "mirrored"]
        for field, host, side in zip(mirrored, hosts, sides, strict=True):
            built[field.name] = Mirrored._pair(frozen(host), side)
        return type(first)(**built)

    return Pending(tuple(hosts), finish)


def slice_columns(columns: C, start: int, stop: int) -> C:
    """Rows `[start, stop)` of every column, as views: no copy, no upload, no kernel."""
    if type(columns) is NoColumns:
        return columns
    built: dict[str, object] = {}
    for field in _fields(type(columns)):
        value = getattr(columns, field.name)
        if field.kind == "mirrored":
            built[field.name] = Mirrored._pair(value.host[start:stop], value.device[start:stop])
        elif field.kind == "host":
            built[field.name] = value[start:stop]  # a view of a read-only array: read-only
        else:
            built[field.name] = DeviceOnly(value.device[start:stop])
    return type(columns)(**built)
