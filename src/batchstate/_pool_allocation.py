"""Taking request slots and KV pages from `Pools`: host arithmetic only, nothing committed.

Each function returns the new pools (not yet committed: the transition
that calls it commits its result) or a failure value; the pools given
stay unchanged. Pages are counted from host lengths, and free pages
falling short evicts unlocked cached pages, least recently used first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, NamedTuple

import numpy as np

from batchstate._errors import OutOfKVTokens, OutOfReqSlots
from batchstate._mirrored import NO_INTS, HostArray, frozen, host_int64
from batchstate._pool_versions import next_version
from batchstate._sharing import lanes

if TYPE_CHECKING:
    from batchstate._hybrid_pools import HybridPools
    from batchstate._pools import Pools
    from batchstate._prefix_cache import PrefixCache

__all__ = ["Allocation", "reissue", "take_fresh", "take_next", "take_slots", "take_tokens"]


class Allocation(NamedTuple):
    """KV token locations for new positions, and the pools that no longer hold them."""

    locs: HostArray  # int64 [num_tokens], in row order, positions ascending
    pools: Pools


def take_slots(pools: Pools, num_slots: int) -> tuple[HostArray, Pools] | OutOfReqSlots:
    """`num_slots` free request slots at one new generation, owning no tokens yet."""
    if num_slots > pools.num_free_slots:
        return OutOfReqSlots(num_slots, pools.num_free_slots)
    memory = pools.memory
    if memory.states and num_slots > memory.free_states():  # a state slot per request
        available = memory.free_or_evictable_states()  # anchors' states may be evicted
        if num_slots > available:
            return OutOfReqSlots(num_slots, available)
    slots, rest = pools.slot_list.take(num_slots)
    slot_gens = pools.slot_gens.copy()
    slot_gens[slots] = pools.next_gen  # one generation per allocation call
    # A copy: the rows keep these as their mirror, and a view would tie that mirror to
    # the free list's buffer, which later values write.
    return frozen(slots.copy()), next_version(
        pools,
        slot_list=rest,
        slot_gens=frozen(slot_gens),
        next_gen=pools.next_gen + 1,
        memory=_admitted(pools, memory, slots),
    )


def _admitted(pools: Pools, memory: HybridPools, slots: HostArray) -> HybridPools | None:
    # A state slot per new row, and with the cache on each row pending until it grows:
    # a release before then keeps no anchor of memory its forward or transfer never wrote.
    if not memory.kinds.is_hybrid:
        return None
    taken = memory.take_slots(slots)
    return taken.admit(slots) if pools.cache.enabled else taken


def reissue(pools: Pools, slots: HostArray) -> tuple[HostArray, Pools]:
    """Owned `slots` at one new generation (returned per slot): every older holder is stale.

    For a record consumed by a transition that keeps its slots (a synced
    verify window): the record it returns holds the new generation, and the
    consumed one, at the old, is refused by every transition and `release`.
    """
    slot_gens = pools.slot_gens.copy()
    slot_gens[slots] = pools.next_gen
    gens = frozen(np.full(slots.shape[0], pools.next_gen, dtype=np.int64))
    return gens, next_version(pools, slot_gens=frozen(slot_gens), next_gen=pools.next_gen + 1)


def take_tokens(
    pools: Pools,
    slots: HostArray,
    old_lens: HostArray,
    new_lens: HostArray,
    reads_from: HostArray | None = None,
) -> Allocation | OutOfKVTokens:
    """Locations for positions `[old_lens[i], new_lens[i])` of each slot `slots[i]`.

    `reads_from`: the first position each row's forward queries, where it
    is not `old_lens`: before it (a verify window queries its decode token
    again), or `new_lens` for rows no forward computes here (`prebuilt`);
    window pages are held only from what that position reads on.
    """
    page_size = pools.page_size
    num_tokens = new_lens - old_lens
    pages_before = (old_lens + page_size - 1) // page_size
    new_pages_per_row = (new_lens + page_size - 1) // page_size - pages_before
    num_new_pages = int(new_pages_per_row.sum())
    taken = _take_pages(pools, slots, new_lens, num_new_pages, reads_from)
    if isinstance(taken, OutOfKVTokens):
        return taken
    new_pages, after = taken
    if page_size == 1:
        return Allocation(new_pages, after)  # one page per token, in row order
    rows = np.repeat(np.arange(slots.shape[0]), num_tokens)
    first_token = np.cumsum(num_tokens) - num_tokens
    positions = old_lens[rows] + np.arange(rows.shape[0]) - first_token[rows]
    page_of_req = positions // page_size
    is_new = page_of_req >= pages_before[rows]
    # The page already holding a position, from the host table; the cell is
    # stale where `is_new`, and `np.where` drops it there.
    existing = pools.table.host[slots[rows], page_of_req * page_size].astype(np.int64)
    page = existing // page_size
    if num_new_pages:
        first_new = (np.cumsum(new_pages_per_row) - new_pages_per_row)[rows]
        new_index = (first_new + page_of_req - pages_before[rows]).clip(0, num_new_pages - 1)
        page = np.where(is_new, new_pages[new_index], page)
    return Allocation(page * page_size + positions % page_size, after)


def take_fresh(
    pools: Pools, slots: HostArray, seq_lens: Sequence[int], *, transferred: bool = False
) -> Allocation | OutOfKVTokens:
    """Locations for positions `[0, seq_lens[i])` of each newly owned slot (the extend path).

    Pages are counted in Python and each row's locations are its whole
    pages laid out in order. `transferred`: no forward computes the rows
    here (`prebuilt`), so window pages are taken for each window's tail only.
    """
    page_size = pools.page_size
    pages_per_row = [-(-length // page_size) for length in seq_lens]
    lengths = host_int64(seq_lens)
    taken = _take_pages(pools, slots, lengths, sum(pages_per_row), lengths if transferred else None)
    if isinstance(taken, OutOfKVTokens):
        return taken
    new_pages, after = taken
    if page_size == 1:
        return Allocation(new_pages, after)
    tokens = (new_pages[:, None] * page_size + lanes(page_size)).ravel()
    first_page = 0
    runs = []
    for length, num_pages in zip(seq_lens, pages_per_row, strict=True):
        runs.append(tokens[first_page * page_size : first_page * page_size + length])
        first_page += num_pages
    return Allocation(runs[0] if len(runs) == 1 else np.concatenate(runs), after)


def take_next(pools: Pools, slots: HostArray, new_lens: HostArray) -> Allocation | OutOfKVTokens:
    """One more token for each slot, at position `new_lens[i] - 1` (the decode path).

    The same as `take_tokens(pools, slots, new_lens - 1, new_lens)` in fewer
    host ops: a row needs a page only where its new position starts one.
    """
    page_size = pools.page_size
    if page_size == 1:
        taken = _take_pages(pools, slots, new_lens, slots.shape[0])
        return taken if isinstance(taken, OutOfKVTokens) else Allocation(*taken)
    positions = new_lens - 1
    starts = np.flatnonzero(positions % page_size == 0)  # rows whose token opens a page
    taken = _take_pages(pools, slots, new_lens, starts.shape[0])
    if isinstance(taken, OutOfKVTokens):
        return taken
    new_pages, after = taken
    # Every other row continues right after its previous token (a row opening
    # a page reads a stale cell here, then gets its new page below).
    locs = pools.table.host[slots, positions - 1] + _ONE  # int64: _ONE is int64
    locs[starts] = new_pages * page_size
    return Allocation(locs, after)


def _take_pages(
    pools: Pools,
    slots: HostArray,
    new_lens: HostArray,
    num_pages: int,
    reads_from: HostArray | None = None,
) -> tuple[HostArray, Pools] | OutOfKVTokens:
    # The first `num_pages` free pages, evicting cached ones when free pages fall
    # short, and pools where `slots` own `new_lens` tokens.
    page_list, cache = pools.page_list, pools.cache
    if pools.retired.shape[0]:
        # A later transition: the forward that wrote the retired pages runs before its own.
        page_list = page_list.give(pools.retired)
    shortage = num_pages - len(page_list)
    if shortage > 0:
        if shortage > cache.num_evictable:
            available = len(page_list) + cache.num_evictable
            return OutOfKVTokens(num_pages, available, pools.page_size)
        cache, evicted = cache._evict(shortage)
        page_list = page_list.give(np.array(evicted, dtype=np.int64))
    memory = None
    if pools.memory.kinds.is_hybrid:
        hybrid = _hybrid_taken(pools, cache, slots, new_lens, reads_from)
        if isinstance(hybrid, OutOfKVTokens):
            return hybrid
        memory = hybrid
    pages, rest = page_list.take(num_pages)
    slot_tokens = pools.slot_tokens.copy()
    slot_tokens[slots] = new_lens
    return pages, next_version(
        pools,
        page_list=rest,
        retired=NO_INTS,
        slot_tokens=frozen(slot_tokens),
        cache=cache,
        memory=memory,
    )


def _hybrid_taken(
    pools: Pools,
    cache: PrefixCache,
    slots: HostArray,
    new_lens: HostArray,
    reads_from: HostArray | None,
) -> HybridPools | OutOfKVTokens:
    # The window pages rows grown to `new_lens` take and give back, after settling the
    # copies rows that grow again had pending and dropping anchors whose full-attention
    # prefix `cache` (after its evictions) no longer holds.
    memory = pools.memory
    old_lens = pools.slot_tokens[slots]
    if memory.cached.pending:  # a row that held tokens ran its forward: its copies are done
        memory = memory.settle(slots[old_lens > 0].tolist())
    if cache is not pools.cache and memory.cached.anchors:
        memory = memory.drop_uncached(lambda prefix: cache._cached(prefix)[0] == len(prefix))
    if not memory.windows:  # the window layers' pages: taken, and out-of-window ones freed
        return memory
    first_read = old_lens if reads_from is None else reads_from
    return memory.grow(slots, old_lens, new_lens, first_read, pools.page_size)


_ONE: Final = np.int64(1)
