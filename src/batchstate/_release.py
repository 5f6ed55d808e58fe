"""Release: give back the memory of requests that left the batch."""

from __future__ import annotations

import torch
from returns.result import Failure, Result

from batchstate._errors import ReleaseError, StillRunning
from batchstate._phases import Batch
from batchstate._pools import Pools

__all__ = ["release"]


def release(left: Batch, running: Batch, pools: Pools) -> Result[Pools, ReleaseError]:
    """Free the request slots and KV tokens of every row of `left`.

    Args:
        left: the rows that left (usually `filter_batch` of the finished rows).
        running: the batch that goes on; none of `left`'s slots may be in it.
        pools: the pools that own `left`'s memory.

    Returns:
        `Success(Pools)` with the memory free; `Failure(StillRunning)` if a
        slot is still in `running`; `Failure(NotOwned)` if a slot was already
        released. `pools` is unchanged either way. Reads nothing from the device.
    """
    slots = left.rows.req_pool_indices.host
    still = slots[torch.isin(slots, running.rows.req_pool_indices.host)]
    if still.shape[0]:
        return Failure(StillRunning(tuple(still.tolist())))
    return pools.free(slots)
