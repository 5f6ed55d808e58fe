"""Rows of a column set taken, joined and sliced, for every field alike.

Filter, split, merge and decode move columns through these functions only.
Taking and joining leave the new mirrored host sides `Pending`, so that they
join the transition's other host arrays in its one upload; slicing makes
views and copies nothing.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from batchstate._columns import C, Columns, NoColumns, _fields
from batchstate._errors import ColumnError
from batchstate._mirrored import DeviceOnly, HostArray, Mirrored, frozen, gather_rows

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
    mirrored, host, gathers = _kinds(type(columns))
    hosts = [getattr(columns, name).host.take(index) for name in mirrored]
    built: dict[str, object] = {name: frozen(getattr(columns, name).take(index)) for name in host}
    if gathers:
        hosts.append(index)  # the gather needs the positions on the device

    def finish(sides: Sequence[torch.Tensor]) -> Columns:
        pair = Mirrored._pair
        for name, host_side, side in zip(mirrored, hosts, sides, strict=False):
            built[name] = pair(frozen(host_side), side)
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
    mirrored, host, device = _kinds(type(first))
    hosts = [np.concatenate([getattr(part, name).host for part in parts]) for name in mirrored]
    built: dict[str, object] = {
        name: frozen(np.concatenate([getattr(part, name) for part in parts])) for name in host
    }
    for name in device:
        # An empty part (an `Idle` batch's) has no dtype of its own to give: leave it
        # out, so that `cat` keeps the rows' dtype instead of promoting to int64.
        values = [getattr(part, name).device for part in parts]
        tensors = [value for value in values if value.shape[0]] or values[:1]
        built[name] = DeviceOnly(tensors[0] if len(tensors) == 1 else torch.cat(tensors))

    def finish(sides: Sequence[torch.Tensor]) -> Columns:
        pair = Mirrored._pair
        for name, host_side, side in zip(mirrored, hosts, sides, strict=True):
            built[name] = pair(frozen(host_side), side)
        return type(first)(**built)

    return Pending(tuple(hosts), finish)


_Names = tuple[str, ...]


def _kinds(cls: type[Columns]) -> tuple[_Names, _Names, _Names]:
    # A set's field names by kind (mirrored, host, device), read once: joins run per step.
    known = _KINDS.get(cls)
    if known is None:
        fields = _fields(cls)
        mirrored = tuple(field.name for field in fields if field.kind == "mirrored")
        host = tuple(field.name for field in fields if field.kind == "host")
        device = tuple(field.name for field in fields if field.kind == "device")
        known = _KINDS[cls] = (mirrored, host, device)
    return known


_KINDS: dict[type[Columns], tuple[_Names, _Names, _Names]] = {}


def slice_columns(columns: C, start: int, stop: int) -> C:
    """Rows `[start, stop)` of every column, as views: no copy, no upload, no kernel."""
    if type(columns) is NoColumns:
        return columns
    mirrored, host, device = _kinds(type(columns))
    built: dict[str, object] = {}
    for name in mirrored:
        value = getattr(columns, name)
        if start == 0 and stop >= value.host.shape[0]:
            return columns  # every row: the set itself (a frozen value) is its own view
        built[name] = Mirrored._pair(value.host[start:stop], value.device[start:stop])
    for name in host:
        built[name] = getattr(columns, name)[start:stop]  # a view of a read-only array
    for name in device:
        built[name] = DeviceOnly(getattr(columns, name).device[start:stop])
    return type(columns)(**built)
