"""Every host array a record or a pool value exposes is read-only: writing one raises.

A host mirror written in place would leave its device side behind, and a
pool's bookkeeping written in place would change values that earlier
records still rely on. numpy refuses both writes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchstate import Req, decode, extend, idle, make_pools, split, verify
from tests.builders import Probe, make_probe

CPU = torch.device("cpu")


def _exposed() -> dict[str, np.ndarray]:
    pools = make_pools(8, 64, 256, CPU, page_size=4)
    reqs = [Req(rid, (1, 2, 3)) for rid in range(3)]
    batch, pools = extend(idle(CPU, Probe), reqs, pools, make_probe([0, 1, 2])).unwrap()
    decoded, pools = decode(batch, pools).unwrap()
    kept, left = split(decoded, [0, 2])
    window, pools = verify(decoded, [1, 0, 2], pools).unwrap()
    rows = kept.rows
    return {
        "rows.rids": rows.rids,
        "rows.req_pool_indices.host": rows.req_pool_indices.host,
        "rows.seq_lens.host": rows.seq_lens.host,
        "rows.columns.weight.host": rows.columns.weight.host,
        "rows.columns.budget": rows.columns.budget,
        "departed.slots": left.slots,
        "departed.seq_lens": left.seq_lens,
        "verifying.rids": window.rids,
        "verifying.draft_lens": window.draft_lens,
        "pools.slot_tokens": pools.slot_tokens,
        "pools.free_slots": pools.free_slots,
        "pools.free_pages": pools.free_pages,
        "pools.table.host": pools.table.host,
    }


@pytest.mark.parametrize("name", sorted(_exposed()))
def test_writing_an_exposed_host_array_raises(name: str) -> None:
    """Each host array reached through the public API refuses a write, and keeps its values."""
    array = _exposed()[name]
    before = array.copy()
    with pytest.raises(ValueError, match="read-only"):
        array[(0,) * array.ndim] = 7
    assert np.array_equal(array, before)


@pytest.mark.parametrize("name", ["pools.table.host", "pools.free_slots", "pools.free_pages"])
def test_the_shared_buffers_cannot_be_made_writable_again(name: str) -> None:
    """The table's cells and the free lists are written by later transitions: their views
    refuse `flags.writeable = True` too, so no caller can write cells another value reads."""
    array = _exposed()[name]
    with pytest.raises(ValueError, match="cannot set WRITEABLE flag"):
        array.flags.writeable = True
