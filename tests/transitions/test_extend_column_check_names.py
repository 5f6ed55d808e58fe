"""extend refuses admitted rows' columns of the wrong shape, naming them as its argument."""

from __future__ import annotations

import re

import attrs
import numpy as np
import pytest
import torch

from batchstate import ColumnError, Mirrored, Req, extend, idle, make_pools
from batchstate.columns.building import build_columns
from batchstate.columns.columns import Columns

CPU = torch.device("cpu")


@attrs.frozen(eq=False)
class _Adapter(Columns):
    adapter: Mirrored[np.int32]


def test_a_column_of_the_wrong_length_is_named_from_the_argument() -> None:
    pools = make_pools(4, 32, 64, CPU)
    columns = build_columns(_Adapter, {"adapter": [1]}, CPU)  # one row for two requests
    message = "columns._Adapter.adapter.host: expected a read-only int32 array [2]"
    with pytest.raises(ColumnError, match=f"^{re.escape(message)}"):
        extend(idle(CPU, _Adapter), [Req(0, (1,)), Req(1, (2,))], pools, columns)
