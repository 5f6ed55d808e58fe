"""Giving request slots and KV pages back to `Pools`: checked against ownership, nothing committed.

Each function checks that the slots are owned (in range, held, distinct,
at the caller's length and generation) before it changes anything, and
returns new pools the caller commits, or `Failure(NotOwned)` naming the
slots that are not the caller's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import numpy as np
from returns.result import Failure, Result, Success

from batchstate._errors import NotOwned, PoolsArgumentError
from batchstate._mirrored import HostArray, frozen, same
from batchstate._pool_versions import next_version
from batchstate._prefix_cache import Tokens
from batchstate._sharing import give_back

if TYPE_CHECKING:
    from batchstate._hybrid_pools import HybridPools
    from batchstate._pools import Pools

__all__ = ["give_back_slots", "owned_tokens", "shrink_slots"]


def give_back_slots(
    pools: Pools,
    slots: HostArray,
    seq_lens: HostArray | None,
    tokens: Sequence[Tokens] | None,
    gens: HostArray | None,
) -> Result[Pools, NotOwned]:
    """`Pools.free` without the commit: see there."""
    owned = owned_tokens(pools, slots, None if seq_lens is None else seq_lens.tolist(), gens)
    if isinstance(owned, NotOwned):
        return Failure(owned)
    if not owned:
        return Success(pools)  # nothing to give back
    if pools.cache.enabled:
        return Success(_give_back_shared(pools, slots, owned, tokens))
    page_size, table = pools.page_size, pools.table.host
    if len(owned) <= _MAX_ROW_READS:
        # A few requests finishing, the common case: one strided row read each.
        # int32 table cells: the free list's buffer converts as it copies them.
        rows = [table[slot, :tokens:page_size] for slot, tokens in owned]
        pages = rows[0] if len(rows) == 1 else np.concatenate(rows)
    else:
        num_pages = (pools.slot_tokens[slots] + page_size - 1) // page_size
        rows_of_pages = np.repeat(np.arange(slots.shape[0]), num_pages)
        first_page = np.cumsum(num_pages) - num_pages
        columns = (np.arange(rows_of_pages.shape[0]) - first_page[rows_of_pages]) * page_size
        pages = table[slots[rows_of_pages], columns]
    if page_size > 1:
        pages = pages // page_size
    return Success(
        next_version(
            pools,
            slot_list=pools.slot_list.give(slots),
            page_list=pools.page_list.give(pages),
            slot_tokens=_zeroed(pools.slot_tokens, slots),
            slot_gens=_zeroed(pools.slot_gens, slots),
            memory=_hybrid_given_back(pools, slots),
        )
    )


def _give_back_shared(
    pools: Pools, slots: HostArray, owned: list[tuple[int, int]], tokens: Sequence[Tokens] | None
) -> Pools:
    # `give_back_slots` with the cache on: each slot's whole pages go into the cache. On
    # hybrid pools a row that ends on a page boundary keeps its window tail and state there
    # as an anchor; every other window page and state goes back free.
    prefixes = pools.prefixes.mutate()
    kept = _finished_tails(pools, owned, tokens)
    cache, freed = give_back(pools.cache, pools.table.host, prefixes, owned, tokens)
    return next_version(
        pools,
        slot_list=pools.slot_list.give(slots),
        page_list=pools.page_list.give(freed),
        slot_tokens=_zeroed(pools.slot_tokens, slots),
        slot_gens=_zeroed(pools.slot_gens, slots),
        cache=cache,
        prefixes=prefixes.finish(),
        memory=_hybrid_given_back(pools, slots, kept),
    )


def _finished_tails(
    pools: Pools, owned: list[tuple[int, int]], tokens: Sequence[Tokens] | None
) -> list[tuple[int, Tokens]]:
    # (slot, its tokens) of released rows whose tokens end on a page boundary where no
    # anchor is: their state is after exactly those tokens, their window tail is theirs.
    # Only rows that grew since their admission: a row still pending (a prebuilt row
    # before its transfer, a resumed row before its copies) never had them written.
    if not pools.memory.kinds.is_hybrid or tokens is None or len(tokens) != len(owned):
        return []
    page_size, cached = pools.page_size, pools.memory.cached
    anchors, pending = cached.anchors, cached.pending
    kept: list[tuple[int, Tokens]] = []
    ends: set[Tokens] = set()
    for (slot, num_tokens), ids in zip(owned, tokens, strict=True):
        if num_tokens % page_size or len(ids) < num_tokens or slot in pending:
            continue
        prefix = tuple(ids[:num_tokens])
        if prefix not in anchors and prefix not in ends:
            kept.append((slot, prefix))
            ends.add(prefix)
    return kept


def _hybrid_given_back(
    pools: Pools, slots: HostArray, kept: Sequence[tuple[int, Tokens]] = ()
) -> HybridPools | None:
    # The window pages and states `slots` hold, freed (but for `kept` rows' tails and
    # states, which become anchors); None (unchanged) for full attention.
    if not pools.memory.kinds.is_hybrid:
        return None
    return pools.memory.give_back(slots, pools.slot_tokens[slots], kept)


def shrink_slots(pools: Pools, slots: HostArray, new_lens: HostArray) -> Result[Pools, NotOwned]:
    """`Pools.shrink` without the commit: see there."""
    owned = owned_tokens(pools, slots, None)
    if isinstance(owned, NotOwned):
        return Failure(owned)
    held = pools.slot_tokens[slots]
    floor = np.array([max(len(pools.prefixes.get(slot, ())), 1) for slot, _ in owned])
    bad = (new_lens < floor) | (new_lens > held)
    if bad.any():
        at = int(bad.argmax())
        raise PoolsArgumentError(
            f"slot {int(slots[at])} owns {int(held[at])} tokens"
            f" ({int(floor[at])} of them needed: its cached prefix, or one),"
            f" cannot shrink to {int(new_lens[at])}"
        )
    page_size = pools.page_size
    kept_pages = (new_lens + page_size - 1) // page_size
    num_freed = (held + page_size - 1) // page_size - kept_pages
    rows = np.repeat(np.arange(slots.shape[0]), num_freed)
    first_freed = np.cumsum(num_freed) - num_freed
    page_index = kept_pages[rows] + np.arange(rows.shape[0]) - first_freed[rows]
    pages = pools.table.host[slots[rows], page_index * page_size].astype(np.int64) // page_size
    slot_tokens = pools.slot_tokens.copy()
    slot_tokens[slots] = new_lens
    memory = pools.memory.shrink(slots, held, new_lens) if pools.memory.windows else None
    return Success(
        next_version(
            pools,
            page_list=pools.page_list.give(pages),
            slot_tokens=frozen(slot_tokens),
            memory=memory,
        )
    )


def owned_tokens(
    pools: Pools, slots: HostArray, expected: list[int] | None, gens: HostArray | None = None
) -> list[tuple[int, int]] | NotOwned:
    """(slot, tokens it owns) for each of `slots`, or `NotOwned` naming the others.

    A slot is not owned if it is out of range, free, repeated, owns other
    than `expected` tokens, or is at another generation than `gens`. Few
    slots leave at a time: they are checked in Python.
    """
    values = slots.tolist()
    if not values:
        return []
    unowned = [slot for slot in values if not 1 <= slot <= pools.max_reqs]
    if not unowned:
        owned = list(zip(values, pools.slot_tokens[slots].tolist(), strict=True))
        held = pools.slot_gens[slots]
        unowned = [slot for slot, gen in zip(values, held.tolist(), strict=True) if not gen]
        if gens is not None and not unowned and not same(held, gens):
            unowned = [slot for slot, g, h in zip(values, gens, held, strict=True) if g != h]
        if expected is not None and not unowned:
            pairs = zip(owned, expected, strict=True)
            unowned = [slot for (slot, tokens), length in pairs if tokens != length]
        if not unowned:
            if len(set(values)) == len(values):
                return owned
            unowned = values  # the same slot twice in one call
    return NotOwned(tuple(unowned))


def _zeroed(per_slot: HostArray, slots: HostArray) -> HostArray:
    # A per-slot array with `slots` free again (0 tokens, generation 0).
    cleared = per_slot.copy()
    cleared[slots] = 0
    return frozen(cleared)


# Up to this many slots freed at once, reading each one's row beats index tensors.
_MAX_ROW_READS: Final = 8
