"""Building column sets: zero rows of a set, or new rows from per-row host values.

`build_columns` checks each value against its column's dtype exactly, packs
the columns of one dtype into one array (a pack) and uploads every device
side in one host-to-device copy; `empty_columns` is the zero-row set an
`Idle` batch carries. The fields come from the declaration in
`columns.columns`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt
import torch

from batchstate.base.errors import ColumnError
from batchstate.base.mirrored import DeviceOnly, frozen, torch_dtype, upload
from batchstate.columns.columns import (
    NO_COLUMNS,
    C,
    NoColumns,
    Packed,
    _fields,
    for_upload,
    layout,
    packed_set,
)
from batchstate.columns.values import exact_values

__all__ = ["build_columns", "empty_columns"]


def empty_columns(cls: type[C], device: torch.device) -> C:
    """Zero rows of every column of `cls`, both sides."""
    if cls is NoColumns:
        return NO_COLUMNS  # type: ignore[return-value]  # C is NoColumns here
    known = layout(cls)
    hosts = tuple(frozen(np.empty((len(group.names), 0), group.dtype)) for group in known.groups)
    devices = tuple(
        torch.empty(0, dtype=torch_dtype(group.dtype), device=device) for group in known.mirrored
    )
    empty = {name: DeviceOnly.empty(torch.int64, device) for name in known.device}
    return packed_set(cls, known, Packed(hosts, devices, 0, 0), empty)


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
    exact = {
        field.name: exact_values(f"{cls.__name__}.{field.name}", values[field.name], field.dtype)
        for field in fields
    }
    known = layout(cls)
    # `np.array` of the columns copies: the set owns its packs, the caller's arrays stay theirs.
    hosts = tuple(
        frozen(np.array([exact[name] for name in group.names], group.dtype))
        for group in known.groups
    )
    sides = upload([*for_upload(hosts, known), *(exact[name] for name in known.device)], device)
    given = dict(zip(known.device, sides[len(known.mirrored) :], strict=True))
    return packed_set(
        cls,
        known,
        Packed.uploaded(hosts, sides, known),
        {name: DeviceOnly(side) for name, side in given.items()},
    )
