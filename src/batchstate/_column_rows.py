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
