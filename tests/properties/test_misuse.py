"""Misuse a hurried engine author could make, refused or made harmless.

Each case is a break found by trying to defeat the guarantees from the
public API: a mutable column set, a column's dtype lost on the way through
an empty batch, a record's mirror that was a view of the pools' buffers.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch

from batchstate import (
    ColumnError,
    Columns,
    DeviceOnly,
    Mirrored,
    Req,
    extend,
    idle,
    make_pools,
    mix,
)

CPU = torch.device("cpu")


@attrs.define(eq=False)
class _Mutable(Columns):  # type: ignore[column-set]  # the run-time refusal
    adapter: Mirrored[np.int32]


@attrs.frozen(eq=False)
class _Flags(Columns):
    stop: DeviceOnly
    adapter: DeviceOnly


def _flags(stop: bool, adapter: int) -> _Flags:
    return _Flags(
        DeviceOnly(torch.tensor([stop])), DeviceOnly(torch.tensor([adapter], dtype=torch.int32))
    )


def test_a_mutable_column_set_is_refused_where_it_is_declared() -> None:
    """A mutable set would be one object shared by a transition's input and output."""
    with pytest.raises(ColumnError, match="must be a frozen attrs class"):
        idle(CPU, _Mutable)


@pytest.mark.parametrize("admit", ["mix", "extend"])
def test_device_only_columns_keep_their_dtype_through_an_empty_batch(admit: str) -> None:
    """Rows admitted into `idle()` keep their bool and int32 device columns: joining the empty
    batch's columns used to promote them to int64."""
    pools = make_pools(4, 32, 64, CPU)
    reqs = [Req(0, (1, 2, 3))]
    if admit == "mix":
        batch, _ = mix(idle(CPU, _Flags), reqs, 8, pools, (), _flags(True, 7)).unwrap()
        columns = batch.rows.columns
    else:
        extended, _ = extend(idle(CPU, _Flags), reqs, pools, _flags(True, 7)).unwrap()
        columns = extended.rows.columns
    assert columns.stop.device.dtype == torch.bool
    assert columns.adapter.device.dtype == torch.int32
    assert columns.stop.device.tolist() == [True] and columns.adapter.device.tolist() == [7]


@pytest.mark.parametrize("num_reqs", [1, 12])  # the few-rows path and the general one
def test_a_new_rows_slot_mirror_is_not_a_view_of_the_free_list(num_reqs: int) -> None:
    """Later values write the free list's buffer; a mirror viewing it would change under a
    frozen record, and making its base writable would open the free list too."""
    pools = make_pools(16, 32, 512, CPU)
    batch, after = extend(idle(CPU), [Req(i, (1, 2)) for i in range(num_reqs)], pools).unwrap()
    host = batch.rows.req_pool_indices.host
    assert not np.shares_memory(host, pools.free_slots)
    assert not np.shares_memory(host, after.free_slots)
    assert not host.flags.writeable
