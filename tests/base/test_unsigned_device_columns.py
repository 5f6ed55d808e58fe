"""Device-only columns of unsigned types are gathered like any other (torch has no uint gather)."""

from __future__ import annotations

import attrs
import pytest
import torch

from batchstate import Columns, DeviceOnly, Req, extend, idle, merge, split
from tests.builders import make_test_pools


@attrs.frozen(eq=False)
class Flags(Columns):
    mask: DeviceOnly


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64])
def test_a_split_gathers_an_unsigned_device_column_row_for_row(dtype: torch.dtype) -> None:
    pools = make_test_pools()
    reqs = [Req(rid, (1, 2)) for rid in range(4)]
    values = torch.tensor([7, 0, 2**7 + 1, 5], dtype=dtype)
    batch, pools = extend(idle("cpu", Flags), reqs, pools, Flags(DeviceOnly(values))).unwrap()
    kept, _ = split(merge(idle("cpu", Flags), batch), [0, 2, 3])
    mask = kept.rows.columns.mask.device
    assert mask.dtype == dtype
    assert mask.tolist() == [7, 2**7 + 1, 5]
