"""Release: give back the memory of requests that left the batch."""

from __future__ import annotations

from returns.result import Failure, Result

from batchstate._chunked import Chunked
from batchstate._columns import C, D
from batchstate._errors import PhaseError, ReleaseError, StillRunning
from batchstate._filter import Departed
from batchstate._mirrored import host_int64, overlap
from batchstate._phases import Batch, Decoding, Extended, Filtered, Idle
from batchstate._pools import Pools

__all__ = ["release"]


def release(
    left: Departed | Batch[C] | Chunked[C], running: Batch[D], pools: Pools
) -> Result[Pools, ReleaseError]:
    """Free the request slots and KV tokens of every row of `left`.

    Args:
        left: the rows that left: `split(batch, keep).left`, or a batch whose
            rows all leave (a retracted or abandoned one), or a `Chunked`
            request given up between chunks.
        running: the batch that goes on; none of `left`'s slots may be in it.
        pools: the pools that own `left`'s memory.

    Returns:
        `Success(Pools)` with the memory free; `Failure(StillRunning)` if a
        slot is still in `running`; `Failure(NotOwned)` if a slot was already
        released, or now holds another count of tokens (`left` is stale).
        `pools` is unchanged either way. Reads nothing from the device.

    Raises:
        PhaseError: `left` or `running` is not a batch (arguments swapped, say).
    """
    if not isinstance(left, Departed | Idle | Extended | Decoding | Filtered | Chunked):
        raise PhaseError(
            f"release takes Departed, Chunked or a batch as left, got {type(left).__name__}"
        )
    if not isinstance(running, Idle | Extended | Decoding | Filtered):
        raise PhaseError(f"release takes a batch as running, got {type(running).__name__}")
    if isinstance(left, Departed):
        slots, seq_lens = left.slots, left.seq_lens
    elif isinstance(left, Chunked):
        slots, seq_lens = host_int64([left.slot]), host_int64([left.cached])
    else:
        slots, seq_lens = left.rows.req_pool_indices.host, left.rows.seq_lens.host
    # Rows that stayed in the same split as `left` cannot share its slots.
    if not (isinstance(left, Departed) and left.stayed is running.rows):
        still = overlap(slots, running.rows.req_pool_indices.host)
        if still.shape[0]:
            return Failure(StillRunning(tuple(still.tolist())))
    return pools.free(slots, seq_lens)
