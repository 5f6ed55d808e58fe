"""An empty batch's device-only columns are int64, so joining rows to it keeps their dtype."""

from __future__ import annotations

import attrs
import numpy as np
import torch

from batchstate import DeviceOnly, Mirrored, Req, Rows
from batchstate.columns.building import build_columns, empty_columns
from batchstate.columns.columns import Columns

CPU = torch.device("cpu")


@attrs.frozen(eq=False)
class _Tagged(Columns):
    tag: Mirrored[np.int32]
    state: DeviceOnly


def test_empty_device_only_columns_are_int64() -> None:
    empty = empty_columns(_Tagged, CPU)
    assert empty.state.device.dtype == torch.int64
    assert empty.tag.device.dtype == torch.int32


def test_rows_joined_to_an_empty_batch_keep_their_device_only_dtype() -> None:
    columns = build_columns(_Tagged, {"tag": [1, 2], "state": [7, 8]}, CPU)
    rows = Rows.from_host(CPU, [Req(0, (1,)), Req(1, (2,))], [1, 2], [1, 1], columns)
    joined = Rows.empty(CPU, _Tagged).cat(rows)
    assert joined.columns.state.device.dtype == torch.int64
    assert joined.columns.state.device.tolist() == [7, 8]
