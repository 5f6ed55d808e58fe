"""Host lists become int64 arrays whatever integer type their elements have.

A caller may hand numpy scalars (`np.int32(3)`, from an int32 array, say)
where Python ints are expected: the rows still get int64 host columns.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from batchstate import Req, Rows
from batchstate.base.mirrored import host_int64
from batchstate.columns.columns import NO_COLUMNS

CPU = torch.device("cpu")


def test_host_int64_of_narrow_numpy_scalars_is_int64() -> None:
    cases: list[tuple[list[Any], list[int]]] = [
        ([np.int32(3), np.int32(5)], [3, 5]),
        ([np.uint8(7)], [7]),
        ([np.int16(-2), 4], [-2, 4]),
        ([], []),
    ]
    for values, expected in cases:
        array = host_int64(values)
        assert array.dtype == np.int64
        assert array.tolist() == expected
        assert not array.flags.writeable


def test_rows_from_numpy_int32_slots_and_lengths() -> None:
    slots = np.array([2, 1], dtype=np.int32)
    lens = np.array([3, 4], dtype=np.int32)
    rows = Rows.from_host(
        CPU,
        [Req(0, (1,)), Req(1, (2,))],
        list(slots),  # numpy scalars, on purpose
        list(lens),
        NO_COLUMNS,
    )
    assert rows.req_pool_indices.host.dtype == np.int64
    assert rows.req_pool_indices.host.tolist() == [2, 1]
    assert rows.seq_lens.host.tolist() == [3, 4]
    assert (rows.seq_lens_sum, rows.max_seq_len) == (7, 4)
