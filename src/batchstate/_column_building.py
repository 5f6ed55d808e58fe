"""Building column sets: zero rows of a set, or new rows from per-row host values.

`build_columns` checks each value against its column's dtype exactly and
uploads every device side in one host-to-device copy; `empty_columns` is the
zero-row set an `Idle` batch carries. The fields come from the declaration
in `_columns`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt
import torch

from batchstate._column_values import exact_values
from batchstate._columns import NO_COLUMNS, C, NoColumns, _fields
from batchstate._errors import ColumnError
from batchstate._mirrored import DeviceOnly, Mirrored, frozen, upload

__all__ = ["build_columns", "empty_columns"]


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
