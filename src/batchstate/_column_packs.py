"""How a column set's values are stored: its columns of one dtype packed into one array.

A set the library builds (`build_columns`, `empty_columns`, and every take,
join and slice of one) holds one read-only host array of shape `[columns,
rows]` per kind and dtype, and for mirrored columns one device tensor,
that array uploaded flat (a column's rows contiguous on both sides).
Taking, joining and uploading a set then costs one numpy op and one array
in the transition's upload per dtype, not one per column, and no torch op:
the flat device tensor is kept as `upload` returns it (a torch slice or
view of a CPU tensor costs 0.8-0.9 µs, `narrow` 1.5, a numpy row view
0.07 and a 2-D slice 0.15: `timeit`, best of 7 x 200,000, on 2 shared
cores at load average ~3; more under heavier load).

Each column is still read by name, typed as declared: a `Mirrored` whose
two sides are views of its row in the packs, or a read-only host view. The
view is made when the column is first read and then kept on the set, so a
transition whose result no one reads by name (most of them: a scheduler
reads its sampling columns once a step, if at all) makes none.

A set built by hand (`Sampling(temperature=..., ...)`) has no packs: its
columns are stacked on the host when a transition first takes or joins it
(they are copied, not changed), and the result is packed. `DeviceOnly`
columns are never packed: they declare no dtype, and the host does not know
their values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import attrs
import numpy as np
import numpy.typing as npt
import torch

from batchstate._columns import C, Columns, _fields
from batchstate._mirrored import DeviceOnly, Mirrored
from batchstate._record_setters import new_record, put_field

__all__ = [
    "Layout",
    "Packed",
    "column_view",
    "for_upload",
    "host_packs",
    "layout",
    "packed_of",
    "packed_set",
]

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
        return Mirrored._pair(host, flat)  # a pack of one column, all its rows: no torch op
    start = row * packed.stride + packed.start
    return Mirrored._pair(host, flat[start : start + rows])


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
