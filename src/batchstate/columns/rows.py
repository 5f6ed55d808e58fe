"""Rows of a column set taken, joined and sliced, for every field alike.

Filter, split, merge and decode move columns through these functions only.
They work on a set's packs (one array per dtype, `columns.columns`), so each
costs one numpy op per dtype, not per column. Taking and joining leave the
new mirrored host packs `Pending`, so that they join the transition's other
host arrays in its one upload; slicing makes views and copies nothing.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from batchstate.base.errors import ColumnError
from batchstate.base.mirrored import DeviceOnly, HostArray, Mirrored, frozen, gather_rows
from batchstate.columns.columns import (
    C,
    Columns,
    Layout,
    NoColumns,
    Packed,
    for_upload,
    host_packs,
    layout,
    packed_of,
    packed_set,
)

__all__ = ["Pending", "cat_pending", "join_pending", "slice_columns", "take_pending"]


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
    cls = type(columns)
    known = layout(cls)
    hosts = tuple([frozen(pack.take(index, axis=1)) for pack in host_packs(columns, known)])
    uploads = for_upload(hosts, known)
    if known.device:
        uploads.append(index)  # the gather needs the positions on the device

    def finish(sides: Sequence[torch.Tensor]) -> Columns:
        gathered: dict[str, DeviceOnly] = {}
        if known.device:
            positions = sides[-1]
            for name in known.device:
                gathered[name] = DeviceOnly(gather_rows(getattr(columns, name).device, positions))
        return packed_set(cls, known, Packed.uploaded(hosts, sides, known), gathered)

    return Pending(tuple(uploads), finish)


def cat_pending(first: C, second: C) -> C | Pending:
    """Every column's rows of `first` followed by `second`'s, host sides left for the upload."""
    return join_pending((first, second))


def join_pending(parts: Sequence[C]) -> C | Pending:
    """Every column's rows of each part in turn, host sides left for the upload.

    Mirrored and host-only columns are joined on the host, one concatenation
    per pack; `DeviceOnly` ones with one `cat` on the device each.
    """
    first = parts[0]
    if type(first) is NoColumns or len(parts) == 1:
        return first
    cls = type(first)
    for part in parts[1:]:
        if type(part) is not cls:
            raise ColumnError(f"cannot join {type(part).__name__} columns to {cls.__name__} ones")
    known = layout(cls)
    packs = [host_packs(part, known) for part in parts]
    # zip(*packs): each pack's arrays across the parts, in turn.
    hosts = tuple([frozen(np.concatenate(pack, axis=1)) for pack in zip(*packs, strict=True)])
    joined: dict[str, DeviceOnly] = {}
    for name in known.device:
        # An empty part (an `Idle` batch's) has no dtype of its own to give: leave it
        # out, so that `cat` keeps the rows' dtype instead of promoting to int64.
        values = [getattr(part, name).device for part in parts]
        tensors = [value for value in values if value.shape[0]] or values[:1]
        joined[name] = DeviceOnly(tensors[0] if len(tensors) == 1 else torch.cat(tensors))

    def finish(sides: Sequence[torch.Tensor]) -> Columns:
        return packed_set(cls, known, Packed.uploaded(hosts, sides, known), joined)

    return Pending(tuple(for_upload(hosts, known)), finish)


def slice_columns(columns: C, start: int, stop: int) -> C:
    """Rows `[start, stop)` of every column, as views: no copy, no upload, no kernel."""
    if type(columns) is NoColumns:
        return columns
    cls = type(columns)
    known = layout(cls)
    packed = packed_of(columns)
    if start == 0 and stop >= _num_rows(columns, known, packed):
        return columns  # every row: the set itself (a frozen value) is its own view
    sliced = {name: DeviceOnly(getattr(columns, name).device[start:stop]) for name in known.device}
    if packed is not None:
        hosts = tuple(host[:, start:stop] for host in packed.hosts)
        moved = Packed(hosts, packed.devices, packed.start + start, packed.stride)
        return packed_set(cls, known, moved, sliced)
    # A set built by hand: each column sliced as it was given.
    views: dict[str, object] = dict(sliced)
    for group in known.mirrored:
        for name in group.names:
            value = getattr(columns, name)
            views[name] = Mirrored.trusted(value.host[start:stop], value.device[start:stop])
    for group in known.host:
        for name in group.names:
            views[name] = getattr(columns, name)[start:stop]  # a view of a read-only array
    return cls(**views)


def _num_rows(columns: Columns, known: Layout, packed: Packed | None) -> int:
    if packed is not None and packed.hosts:
        return int(packed.hosts[0].shape[1])  # read from the packs: no column view made
    names = (*known.places, *known.device)
    return len(getattr(columns, names[0])) if names else 0
