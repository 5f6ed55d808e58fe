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

This module holds the declaration (the base classes, the type variables
transitions are generic over, and the reading of a set's fields: kinds and
dtypes, once per class) and how a set's values are stored (its columns of
one dtype packed into one array, each column a view of its pack). Building
a set is `columns.building`'s, checking one `columns.arguments`', and
taking, joining and slicing its rows `columns.rows`': filter, split, merge
and decode handle every field through those functions, so a column can be
forgotten in no lifecycle method: there is none to write. The library never
names a column.

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
from collections.abc import Mapping, Sequence
from typing import Final, NamedTuple, TypeAlias, final

import attrs
import numpy as np
import numpy.typing as npt
import torch
from typing_extensions import TypeVar

from batchstate.base.errors import ColumnError
from batchstate.base.mirrored import DeviceOnly, Mirrored
from batchstate.base.read_only import by_fields
from batchstate.base.scalars import SCALAR_NAMES
from batchstate.base.setters import new_record, put_field

__all__ = [
    "Columns",
    "HostColumn",
    "Layout",
    "NoColumns",
    "Packed",
    "column_view",
    "for_upload",
    "host_packs",
    "layout",
    "packed_of",
    "packed_set",
]


ScalarT = TypeVar("ScalarT", bound=np.generic)
HostColumn: TypeAlias = npt.NDArray[ScalarT]  # a read-only host-only column


class Columns:
    """Base of a column set: subclass it with a frozen attrs class (`eq=False`)."""

    # No __slots__: a set the library builds keeps its values packed in its __dict__
    # (its packs: one array per dtype), each column a view made when first read.
    # A slot here would clash with the slots of any other base a set may have.

    # A copy or pickle carries the fields alone, frozen, and is re-packed like a set
    # built by hand: the packs (in `__dict__` when the class has no slots) stay behind.
    __reduce__ = by_fields

    if not typing.TYPE_CHECKING:  # mypy must not take every name for a column

        def __getattr__(self, name: str) -> object:
            # Only reached for a field not yet set: a packed set's column not yet read.

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


# How a column set's values are stored: its columns of one dtype packed into one array.
#
# A set the library builds (`build_columns`, `empty_columns`, and every take,
# join and slice of one) holds one read-only host array of shape `[columns,
# rows]` per kind and dtype, and for mirrored columns one device tensor,
# that array uploaded flat (a column's rows contiguous on both sides).
# Taking, joining and uploading a set then costs one numpy op and one array
# in the transition's upload per dtype, not one per column, and no torch op:
# the flat device tensor is kept as `upload` returns it (a torch slice or
# view of a CPU tensor costs 0.8-0.9 µs, `narrow` 1.5, a numpy row view
# 0.07 and a 2-D slice 0.15: `timeit`, best of 7 x 200,000, on 2 shared
# cores at load average ~3; more under heavier load).
#
# Each column is still read by name, typed as declared: a `Mirrored` whose
# two sides are views of its row in the packs, or a read-only host view. The
# view is made when the column is first read and then kept on the set, so a
# transition whose result no one reads by name (most of them: a scheduler
# reads its sampling columns once a step, if at all) makes none.
#
# A set built by hand (`Sampling(temperature=..., ...)`) has no packs: its
# columns are stacked on the host when a transition first takes or joins it
# (they are copied, not changed), and the result is packed. `DeviceOnly`
# columns are never packed: they declare no dtype, and the host does not know
# their values.


Host = npt.NDArray[np.generic]


class Group(NamedTuple):
    """A set's columns of one kind and dtype: the rows of one pack, in declaration order."""

    dtype: np.dtype[np.generic]
    names: tuple[str, ...]


class Layout(NamedTuple):
    """A set's columns grouped into packs, read once per class."""

    mirrored: tuple[Group, ...]  # packed on both sides
    host: tuple[Group, ...]  # packed on the host only
    device: tuple[str, ...]  # `DeviceOnly` columns: one tensor each
    places: Mapping[str, tuple[int, int]]  # a packed column -> (its pack, its row there)
    lazy: bool  # views made on first read; not for a class whose __init__ does more

    @property
    def groups(self) -> tuple[Group, ...]:
        """Every pack's group: the mirrored ones first, as `Packed.hosts` holds them."""
        return self.mirrored + self.host


class Packed(NamedTuple):
    """A set's values: per group one read-only host array [columns, rows]; per mirrored
    group one flat device tensor, where column `c`'s rows are
    `[c * stride + start, c * stride + start + rows)` (a slice of a set moves `start`)."""

    hosts: tuple[Host, ...]  # `Layout.groups`' order
    devices: tuple[torch.Tensor, ...]  # `Layout.mirrored`'s order, [columns * stride]
    start: int
    stride: int

    @staticmethod
    def uploaded(hosts: tuple[Host, ...], sides: Sequence[torch.Tensor], known: Layout) -> Packed:
        """Fresh host packs and the device copies of `for_upload(hosts)` (first in `sides`)."""
        mirrored = len(known.mirrored)
        return Packed(hosts, tuple(sides[:mirrored]), 0, hosts[0].shape[1] if hosts else 0)


def layout(cls: type[Columns]) -> Layout:
    """The packs of a column set's class, read from its declaration once."""
    known = _LAYOUTS.get(cls)
    if known is None:
        known = _LAYOUTS[cls] = _read_layout(cls)
    return known


_LAYOUTS: dict[type[Columns], Layout] = {}


def _read_layout(cls: type[Columns]) -> Layout:
    fields = _fields(cls)
    groups: dict[tuple[str, np.dtype[np.generic]], list[str]] = {}
    for field in fields:
        if field.dtype is not None:  # a mirrored or host column
            groups.setdefault((field.kind, field.dtype), []).append(field.name)
    mirrored = tuple(
        Group(dtype, tuple(names)) for (kind, dtype), names in groups.items() if kind == "mirrored"
    )
    host = tuple(
        Group(dtype, tuple(names)) for (kind, dtype), names in groups.items() if kind == "host"
    )
    places = {
        name: (pack, row)
        for pack, group in enumerate(mirrored + host)
        for row, name in enumerate(group.names)
    }
    # A validator or post-init hook must see every value: build those eagerly. (`_fields`
    # made sure it is attrs, and refused converters: they would convert values twice.)
    plain = attrs.has(cls) and not any(field.validator for field in attrs.fields(cls))
    hooks = hasattr(cls, "__attrs_post_init__") or hasattr(cls, "__attrs_pre_init__")
    device = tuple(field.name for field in fields if field.kind == "device")
    return Layout(mirrored, host, device, places, plain and not hooks)


def packed_of(columns: Columns) -> Packed | None:
    """The set's packs; None for a set built by hand (or the empty `NoColumns`)."""
    packed: Packed | None = columns.__dict__.get("_packed")  # no __getattr__ call
    return packed


def packed_set(
    cls: type[C], known: Layout, packed: Packed, device_only: Mapping[str, DeviceOnly]
) -> C:
    """A set of `cls` (whose `layout` is `known`) holding `packed`, with its `DeviceOnly`
    columns as given.

    `packed`'s host arrays must be read-only and owned by no one who writes
    them, its device tensors uploaded from them.
    """
    if known.lazy:
        columns = new_record(cls)
        for name, value in device_only.items():
            put_field(columns, name, value)
    else:
        views = {name: _view(packed, place) for name, place in known.places.items()}
        columns = cls(**views, **device_only)
    put_field(columns, "_packed", packed)
    return columns


def column_view(columns: Columns, name: str) -> object:
    """Column `name` of a packed set, made from its row of the packs and kept on the set."""
    packed = packed_of(columns)
    place = None if packed is None else layout(type(columns)).places.get(name)
    if packed is None or place is None:
        raise AttributeError(f"{type(columns).__name__!r} object has no attribute {name!r}")
    value = _view(packed, place)
    put_field(columns, name, value)
    return value


def _view(packed: Packed, place: tuple[int, int]) -> object:
    pack, row = place
    host = packed.hosts[pack][row]  # a view of a read-only array: read-only too
    if pack >= len(packed.devices):
        return host
    flat, rows = packed.devices[pack], host.shape[0]
    if packed.start == 0 and flat.shape[0] == rows:
        return Mirrored.trusted(host, flat)  # a pack of one column, all its rows: no torch op
    start = row * packed.stride + packed.start
    return Mirrored.trusted(host, flat[start : start + rows])


def host_packs(columns: Columns, known: Layout) -> tuple[Host, ...]:
    """The set's host packs; a set built by hand has its columns stacked (copied) into them."""
    packed: Packed | None = columns.__dict__.get("_packed")  # `packed_of`, inlined: per step
    if packed is not None:
        return packed.hosts
    stacked = [
        np.array([getattr(columns, name).host for name in group.names]) for group in known.mirrored
    ]
    stacked += [np.array([getattr(columns, name) for name in group.names]) for group in known.host]
    return tuple(stacked)


def for_upload(hosts: Sequence[Host], known: Layout) -> list[Host]:
    """The mirrored packs flattened (views): `upload` copies 1-D arrays."""
    return [host.reshape(-1) for host in hosts[: len(known.mirrored)]]
