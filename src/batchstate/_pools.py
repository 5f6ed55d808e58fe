"""Request slots and KV pages (free, cached or in use), as an immutable value."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, final

import attrs
from immutables import Map
from returns.result import Failure, Result, Success

from batchstate._copies import read_only_copies
from batchstate._errors import NotOwned, OutOfKVTokens, OutOfReqSlots, StalePools
from batchstate._free_list import FreeList
from batchstate._hybrid_pools import HybridPools
from batchstate._lineage import Stamp
from batchstate._memory_kinds import MemoryKinds
from batchstate._mirrored import HostArray, describe
from batchstate._pool_allocation import Allocation, take_fresh, take_next, take_slots, take_tokens
from batchstate._pool_arguments import (
    check_count,
    check_free,
    check_fresh,
    check_next,
    check_shrink,
    check_tokens,
)
from batchstate._pool_release import give_back_slots, shrink_slots
from batchstate._pool_scans import cached_prefix_lens, page_ref_counts
from batchstate._pool_versions import committed_allocation
from batchstate._prefix_cache import PrefixCache, Tokens
from batchstate._token_table import TokenTable

__all__ = ["Allocation", "Pools", "expect_pools"]


@read_only_copies
@final
@attrs.frozen(eq=False, repr=False)
class Pools:
    """Request slots and KV pages, free, cached or in use, as a value.

    Allocating or freeing returns new `Pools`; a failed or abandoned
    transition leaks nothing. Everything here is on the host: counting
    free memory never reads the device.

    A slot with tokens is owned (`slot_tokens`); its pages are
    `table[slot, 0:slot_tokens[slot]:page_size] // page_size`. With the
    prefix cache on (`make_pools(..., prefix_cache=True)`) a KV page is in
    exactly one state:

    - **free**: in the free list;
    - **cached**: held by `cache`, read by no live row (evictable);
    - **in use**: private to one row (past its cached prefix), or held by
      the cache and read (locked) by one or more rows;
    - **retired**: a row's copy of pages the cache already held, given back
      at the end of its prefill (`retired`): the forward in flight writes
      it, no row reads it, and the next allocation frees it.

    A page's reference count is the rows that read it plus one while the
    cache holds it (`ref_counts`). Allocation evicts unlocked cached pages,
    least recently used first, when free pages run short. With the cache
    off it never matches nor holds a page: every page is free or private.

    Each slot allocation gets a new generation (`slot_gens`), which every
    record holding the slot carries: a holder from before the slot was
    released and handed out again is refused, whatever its lengths.

    A hybrid model's pools (`make_pools(..., memory=...)`) also hold, in
    `memory`, window pages (given back as rows grow past their window) and
    a state slot per owned request slot, each allocated and freed by the
    same calls as the slots and pages above (docs/hybrid.md).

    NOTE: pools are linear, and that is enforced: every value of one
    lineage (one `make_pools`) shares the table and free-list buffers, and
    a version stamp beside them. A successful transition commits its
    result, which makes every earlier value stale: handing a stale value to
    a transition, to a public allocate or free method, or to `check_pools`
    or `find_leaks` raises `StalePools` before anything is read or written.
    A failed transition commits nothing: the pools it was given stay the
    newest. Reading a stale value's fields is allowed, but its `table` is
    the shared one, written by later values.
    """

    table: TokenTable
    page_size: int
    num_pages: int  # usable pages; page 0 is padding and never handed out
    slot_list: FreeList  # free request slots, handed out from the front
    page_list: FreeList  # free KV pages, handed out from the front
    # read-only int64: duplicate pages given back at a prefill's end; the forward in
    # flight writes them, no row reads them; the next allocation moves them to `page_list`.
    retired: HostArray
    num_retired: int  # pages retired since the pools were made: a running total, for reports
    slot_tokens: HostArray  # read-only int64 [max_reqs + 1], slot -> KV tokens it owns
    cache: PrefixCache  # disabled: never matches, never holds a page
    # slot -> the cached prefix its row reads (whole pages), for slots that read one.
    prefixes: Map[int, Tokens]  # persistent: a change copies no other entry
    # read-only int64 [max_reqs + 1], slot -> the generation its owner holds it at (0: free)
    slot_gens: HostArray
    next_gen: int  # the generation the next slot allocation gets, >= 1
    # Window pages and state slots of a hybrid model (`make_pools(..., memory=...)`);
    # empty for full attention, which pays one truthiness test per allocation for it.
    memory: HybridPools
    _stamp: Stamp  # shared by the lineage: which version is the newest
    _version: int  # this value's version

    @property
    def is_newest(self) -> bool:
        """Whether this is its lineage's newest committed value (transitions accept only it)."""
        return self._stamp.current == self._version

    def _expect_newest(self) -> None:
        if self._stamp.current != self._version:
            raise StalePools(
                "these pools are stale: a later value was derived from them by a successful"
                " transition; pass the newest pools (the one the last transition returned)"
            )

    def _commit(self) -> Pools:
        # A transition succeeded with these pools as its result: they are the newest now.
        self._stamp.current = self._version
        return self

    @property
    def free_slots(self) -> HostArray:
        """Free request slots, read-only int64 `[num_free_slots]`, in hand-out order."""
        return self.slot_list.ids

    @property
    def free_pages(self) -> HostArray:
        """Free KV pages, read-only int64 `[num_free_pages]`, in hand-out order."""
        return self.page_list.ids

    @property
    def memory_kinds(self) -> MemoryKinds:
        """The memory kinds the pools were made with (`FULL_ATTENTION` when none)."""
        return self.memory.kinds

    @property
    def max_reqs(self) -> int:
        return int(self.slot_tokens.shape[0]) - 1

    @property
    def max_context_len(self) -> int:
        return self.table.max_context_len

    @property
    def num_free_slots(self) -> int:
        return len(self.slot_list)

    @property
    def num_free_tokens(self) -> int:
        """KV tokens in free pages (retired ones included), not counting what eviction could add."""
        return (len(self.page_list) + len(self.retired)) * self.page_size

    @property
    def num_available_tokens(self) -> int:
        """KV tokens an allocation may take: free (and retired) pages plus evictable cached ones."""
        return (len(self.page_list) + len(self.retired) + self.cache.num_evictable) * self.page_size

    @property
    def prefix_lens(self) -> HostArray:
        """Read-only int64 `[max_reqs + 1]`: tokens each slot's row reads from the cache."""
        return cached_prefix_lens(self)

    def ref_counts(self) -> HostArray:
        """Read-only int64 `[num_pages + 1]`: rows reading each page, plus one if cached.

        0 for a free page, 1 for a private page or an evictable cached one.
        Host work over every slot's row and the cache: for checks, not per step.
        """
        return page_ref_counts(self)

    @property
    def kv_cache_size(self) -> int:
        """Rows a KV cache needs for every location this pool hands out (padding included)."""
        return (self.num_pages + 1) * self.page_size

    def allocate_slots(self, num_slots: int) -> Result[tuple[HostArray, Pools], OutOfReqSlots]:
        """Take `num_slots` free request slots (read-only int64), owning no tokens yet.

        Like every public method that allocates or frees, it refuses stale
        pools (`StalePools`) and commits its result. The slots' generation is
        `pools.slot_gens[slots]` of the pools returned. Each of these methods
        checks its arguments against these pools first (a bad one raises
        `PoolsArgumentError` naming it); transitions skip those checks: they
        derive their arguments from records already checked.
        """
        self._expect_newest()
        allocated = take_slots(self, check_count(num_slots))
        if isinstance(allocated, OutOfReqSlots):
            return Failure(allocated)
        allocated[1]._commit()
        return Success(allocated)

    def allocate_tokens(
        self, slots: HostArray, old_lens: HostArray, new_lens: HostArray
    ) -> Result[Allocation, OutOfKVTokens]:
        """Locations for positions `[old_lens[i], new_lens[i])` of each slot `slots[i]`.

        Pages are counted from host lengths: a row needs a new page at each
        position that starts one. Partly filled last pages are filled first.
        Does not write the table: the caller does, once all allocations of
        its transition have succeeded. `slots` must be owned and hold
        `old_lens` tokens each; `new_lens >= old_lens`, within the table.
        """
        self._expect_newest()
        check_tokens(self, slots, old_lens, new_lens)
        allocation = take_tokens(self, slots, old_lens, new_lens)
        return committed_allocation(allocation)

    def allocate_fresh(
        self, slots: HostArray, seq_lens: Sequence[int]
    ) -> Result[Allocation, OutOfKVTokens]:
        """Locations for positions `[0, seq_lens[i])` of each newly owned slot `slots[i]`.

        The extend fast path: pages are counted in Python and each row's
        locations are its whole pages laid out in order. `slots` must be
        owned and hold no tokens yet; each length is in `[1, max_context_len]`.
        """
        self._expect_newest()
        allocation = take_fresh(self, slots, check_fresh(self, slots, seq_lens))
        return committed_allocation(allocation)

    def allocate_next(
        self, slots: HostArray, new_lens: HostArray
    ) -> Result[Allocation, OutOfKVTokens]:
        """One more token for each slot, at position `new_lens[i] - 1` (the decode fast path).

        The same as `allocate_tokens(slots, new_lens - 1, new_lens)` in fewer
        host ops: a row needs a page only where its new position starts one.
        Each slot must be owned and hold `new_lens[i] - 1` tokens.
        """
        self._expect_newest()
        check_next(self, slots, new_lens)
        allocation = take_next(self, slots, new_lens)
        return committed_allocation(allocation)

    def free(
        self,
        slots: HostArray,
        seq_lens: HostArray | None = None,
        tokens: Sequence[Tokens] | None = None,
        *,
        gens: HostArray | None = None,
    ) -> Result[Pools, NotOwned]:
        """Give back request slots and every KV page they own, caching what the cache takes.

        With the cache on, each slot's tokens (`tokens`) go into the cache in
        whole pages at the slot's pages, and the slot stops reading its
        cached prefix. On hybrid pools a slot whose tokens end on a page
        boundary keeps its window tail and state (after those tokens) in
        the cache as an anchor (docs/hybrid.md). Pages whose tokens the cache holds already (another
        row computed them too), and a partly filled last page, are freed.
        With the cache off every page is freed.

        Args:
            slots: int64 `[num_slots]`, distinct owned request slots.
            seq_lens: int64 `[num_slots]`, the tokens the caller's rows
                hold in those slots, if known: a slot holding a different
                count belongs to someone else now (the rows are stale).
            tokens: per slot, the tokens whose KV it holds from position 0
                (only its first `slot_tokens` count); each must start with
                the slot's cached prefix. Default: cache nothing new.
            gens: int64 `[num_slots]`, the generation the caller holds each
                slot at, if known: a slot at another generation was released
                and handed out again (the caller is stale). `release` always
                passes them.

        Returns:
            `Success(Pools)`; `Failure(NotOwned)` naming the slots that are
            out of range, free, repeated, held at another length or at
            another generation. `self` is unchanged either way.

        Raises:
            PoolsArgumentError: an argument of the wrong type, dtype or length.
            StalePools: `self` is not the newest pools.
        """
        self._expect_newest()
        check_free(slots, seq_lens, tokens, gens)
        freed = give_back_slots(self, slots, seq_lens, tokens, gens)
        return freed if isinstance(freed, Failure) else Success(freed.unwrap()._commit())

    def shrink(self, slots: HostArray, new_lens: HostArray) -> Result[Pools, NotOwned]:
        """Keep the first `new_lens[i]` tokens of each slot `slots[i]`, free the pages past them.

        For KV reserved up front and then not used (unaccepted speculative
        drafts). A page holding any kept token stays owned. Does not write
        the table: cells past a slot's new length are unused.

        Args:
            slots: int64 `[num_slots]`, distinct owned request slots.
            new_lens: int64 `[num_slots]`, in `[1, tokens the slot owns]`,
                and no shorter than the slot's cached prefix.

        Returns:
            `Success(Pools)`; `Failure(NotOwned)` if a slot is not owned (or
            repeats). `self` is unchanged either way.

        Raises:
            PoolsArgumentError: an argument of the wrong type, dtype or length,
                or a new length below 1 (or the cached prefix) or above what
                the slot owns.
            StalePools: `self` is not the newest pools.
        """
        self._expect_newest()
        check_shrink(slots, new_lens)
        shrunk = shrink_slots(self, slots, new_lens)
        return shrunk if isinstance(shrunk, Failure) else Success(shrunk.unwrap()._commit())

    def __repr__(self) -> str:
        cached = (
            f" cached_pages={self.cache.num_pages} ({self.cache.num_locked} in use),"
            if self.cache.enabled
            else ""
        )
        hybrid = f" memory={self.memory!r}," if self.memory.kinds.is_hybrid else ""
        return (
            f"Pools(free_slots={self.num_free_slots}/{self.max_reqs},{hybrid}"
            f" free_pages={len(self.page_list)}/{self.num_pages},{cached}"
            f" page_size={self.page_size}, table={describe('TokenTable', self.table.device)})"
        )


def expect_pools(pools: object) -> None:
    """Raise unless `pools` is the newest `Pools` of its lineage.

    Raises:
        TypeError: `pools` is not a `Pools` (arguments swapped, say).
        StalePools: a later value was derived from `pools` and committed.
    """
    if not isinstance(pools, Pools):
        raise TypeError(f"expected Pools, got {type(pools).__name__}")
    pools._expect_newest()


_NO_PREFIXES: Final[Map[int, Tokens]] = Map()
