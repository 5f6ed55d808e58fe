"""Deriving the next `Pools` value of a lineage, and committing an allocation's.

Pools are linear: a transition builds its result as a new version that is
not yet the newest, and commits it only once it has succeeded, so a failed
or abandoned transition leaves the pools it was given the newest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from immutables import Map
from returns.result import Failure, Result, Success

from batchstate._errors import OutOfKVTokens
from batchstate._free_list import FreeList
from batchstate._hybrid_pools import HybridPools
from batchstate._mirrored import HostArray
from batchstate._prefix_cache import PrefixCache, Tokens

if TYPE_CHECKING:
    from batchstate._pool_allocation import Allocation
    from batchstate._pools import Pools

__all__ = ["committed_allocation", "next_version"]


def next_version(  # one keyword per field a transition may replace
    pools: Pools,
    *,
    slot_list: FreeList | None = None,
    page_list: FreeList | None = None,
    retired: HostArray | None = None,
    num_retired: int | None = None,
    slot_tokens: HostArray | None = None,
    cache: PrefixCache | None = None,
    prefixes: Map[int, Tokens] | None = None,
    slot_gens: HostArray | None = None,
    next_gen: int | None = None,
    memory: HybridPools | None = None,
) -> Pools:
    """A copy of `pools` with some fields replaced, at a new version not yet committed.

    The transition commits its result; attrs.evolve costs four times as much.
    """
    return type(pools)(
        pools.table,
        pools.page_size,
        pools.num_pages,
        pools.slot_list if slot_list is None else slot_list,
        pools.page_list if page_list is None else page_list,
        pools.retired if retired is None else retired,
        pools.num_retired if num_retired is None else num_retired,
        pools.slot_tokens if slot_tokens is None else slot_tokens,
        pools.cache if cache is None else cache,
        pools.prefixes if prefixes is None else prefixes,
        pools.slot_gens if slot_gens is None else slot_gens,
        pools.next_gen if next_gen is None else next_gen,
        pools.memory if memory is None else memory,
        pools._stamp,
        pools._stamp.issue(),
    )


def committed_allocation(
    allocation: Allocation | OutOfKVTokens,
) -> Result[Allocation, OutOfKVTokens]:
    """The allocation with its pools committed (the newest now), or the failure as it is."""
    if isinstance(allocation, OutOfKVTokens):
        return Failure(allocation)
    allocation.pools._commit()
    return Success(allocation)
