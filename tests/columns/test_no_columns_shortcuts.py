"""The column helpers build nothing when there is nothing to build.

A batch with no column set of its own pays nothing for it: every helper
hands back the one shared `NoColumns`. Joining a single part hands back
that part.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from batchstate import Mirrored
from batchstate.columns.building import build_columns, empty_columns
from batchstate.columns.columns import NO_COLUMNS, Columns, NoColumns
from batchstate.columns.rows import cat_pending, join_pending, slice_columns, take_pending

CPU = torch.device("cpu")


def test_every_column_helper_returns_the_shared_no_columns() -> None:
    assert slice_columns(NO_COLUMNS, 0, 1) is NO_COLUMNS
    assert slice_columns(NO_COLUMNS, 1, 3) is NO_COLUMNS
    assert take_pending(NO_COLUMNS, np.array([0, 2])) is NO_COLUMNS
    assert cat_pending(NO_COLUMNS, NO_COLUMNS) is NO_COLUMNS
    assert join_pending((NO_COLUMNS, NO_COLUMNS, NO_COLUMNS)) is NO_COLUMNS
    assert empty_columns(NoColumns, CPU) is NO_COLUMNS


@attrs.frozen(eq=False)
class _Weights(Columns):
    weight: Mirrored[np.float32]


def test_joining_one_column_set_returns_it() -> None:
    weights = build_columns(_Weights, {"weight": [0.5, 2.0]}, CPU)
    assert join_pending((weights,)) is weights
