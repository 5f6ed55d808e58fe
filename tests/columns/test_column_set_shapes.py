"""Taking and joining rows carries every column right, whatever mix of kinds a set declares.

The device gather of `DeviceOnly` columns uses positions uploaded after the
mirrored columns' host sides: sets with none, one or several mirrored
columns beside a device-only one place them differently in that upload.
"""

from __future__ import annotations

from typing import Any, Final

import attrs
import numpy as np
import pytest
import torch

from batchstate import DeviceOnly, Mirrored, Req, Rows
from batchstate.columns.building import build_columns
from batchstate.columns.columns import Columns

CPU = torch.device("cpu")


@attrs.frozen(eq=False)
class _DeviceOnlyColumn(Columns):
    state: DeviceOnly


@attrs.frozen(eq=False)
class _TwoMirroredAndDevice(Columns):
    adapter: Mirrored[np.int32]
    temperature: Mirrored[np.float32]
    state: DeviceOnly


@attrs.frozen(eq=False)
class _ThreeMirroredAndDevice(Columns):
    adapter: Mirrored[np.int32]
    temperature: Mirrored[np.float32]
    top_k: Mirrored[np.int64]
    state: DeviceOnly


VALUES: Final[dict[str, list[float]]] = {
    "adapter": [5, 6, 7, 8],
    "temperature": [0.5, 1.0, 1.5, 2.0],
    "top_k": [1, 2, 3, 4],
    "state": [40, 41, 42, 43],
}


def _rows(cls: type[Any]) -> Rows[Any]:
    names = [field.name for field in attrs.fields(cls)]
    columns = build_columns(cls, {name: VALUES[name] for name in names}, CPU)
    reqs = [Req(row, (row,)) for row in range(4)]
    return Rows.from_host(CPU, reqs, [1, 2, 3, 4], [1, 2, 3, 4], columns)


def _column_values(columns: Any) -> dict[str, list[object]]:
    values: dict[str, list[object]] = {}
    for field in attrs.fields(type(columns)):
        value = getattr(columns, field.name)
        if isinstance(value, Mirrored):
            assert value.host.tolist() == value.device.tolist()
            values[field.name] = value.host.tolist()
        else:
            values[field.name] = value.device.tolist()
    return values


@pytest.mark.parametrize("cls", [_DeviceOnlyColumn, _TwoMirroredAndDevice, _ThreeMirroredAndDevice])
def test_take_and_cat_carry_every_column(cls: type[Any]) -> None:
    rows = _rows(cls)
    taken = rows.take(np.array([0, 2, 3]))
    names = [field.name for field in attrs.fields(cls)]
    expected = {name: [VALUES[name][row] for row in (0, 2, 3)] for name in names}
    assert _column_values(taken.columns) == expected
    joined = taken.cat(rows.take(np.array([1])))
    assert _column_values(joined.columns) == {
        name: [VALUES[name][row] for row in (0, 2, 3, 1)] for name in names
    }
