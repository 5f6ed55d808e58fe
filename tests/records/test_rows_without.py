"""`Rows.without(kept, dropped, dropped_lens)` is `Rows.take(kept)`, whichever rows it drops.

`without` derives the sum and the longest row from the dropped rows; `take`
computes them from the kept ones. The splits only call it with a few rows
dropped and some kept; these cases also cover the ends: nothing dropped,
every row dropped, the longest row dropped or not.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchstate import Req, Rows
from batchstate.columns.columns import NO_COLUMNS

CPU = torch.device("cpu")
LENS = [4, 9, 2, 9, 1]


def _rows(lens: list[int]) -> Rows:
    reqs = [Req(10 + row, (row,) * length) for row, length in enumerate(lens)]
    return Rows.from_host(CPU, reqs, list(range(1, len(lens) + 1)), lens, NO_COLUMNS)


def _host(rows: Rows) -> tuple[object, ...]:
    return (
        rows.reqs,
        rows.rids.tolist(),
        rows.req_pool_indices.host.tolist(),
        rows.seq_lens.host.tolist(),
        rows.seq_lens.device.tolist(),
        rows.orig_seq_lens.device.tolist(),
        rows.seq_lens_sum,
        rows.max_seq_len,
    )


@pytest.mark.parametrize(
    "kept",
    [
        [0, 1, 2, 3, 4],  # nothing dropped
        [],  # every row dropped
        [0, 2, 4],  # both longest rows dropped
        [0, 1, 2, 4],  # one of the two longest rows dropped
        [1, 3],  # only short rows dropped
        [2],  # all but the next-to-shortest dropped
    ],
)
def test_without_is_take(kept: list[int]) -> None:
    rows = _rows(LENS)
    dropped = [row for row in range(len(LENS)) if row not in kept]
    index = np.array(kept, dtype=np.int64)
    result = rows.without(index, dropped, [LENS[row] for row in dropped])
    assert _host(result) == _host(rows.take(index))
    assert result.seq_lens_sum == sum(LENS[row] for row in kept)
    assert result.max_seq_len == max((LENS[row] for row in kept), default=0)


def test_without_dropping_every_row_leaves_no_longest_row() -> None:
    rows = _rows([3])
    empty = rows.without(np.array([], dtype=np.int64), [0], [3])
    assert (len(empty), empty.seq_lens_sum, empty.max_seq_len) == (0, 0, 0)
