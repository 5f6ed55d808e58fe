"""Request slots and KV pages (free, cached or in use), as an immutable value."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, NamedTuple, final

import attrs
import numpy as np
from immutables import Map
from returns.result import Failure, Result, Success

from batchstate._copies import read_only_copies
from batchstate._errors import NotOwned, OutOfKVTokens, OutOfReqSlots, StalePools
from batchstate._free_list import FreeList
from batchstate._mirrored import NO_INTS, HostArray, describe, frozen, host_int64, same
from batchstate._prefix_cache import PrefixCache, Tokens
from batchstate._sharing import give_back, lanes, lock_matched, lock_prefixes, publish
from batchstate._token_table import TokenTable

__all__ = ["Allocation", "Pools", "expect_pools"]


@final
class _Stamp:
    # The version stamp every `Pools` of one lineage shares (from one `make_pools`),
    # beside the table and free-list buffers they share: the newest committed value's
    # version. Versions are issued once each, so no two values ever carry the same one.
    __slots__ = ("current", "issued")

    def __init__(self) -> None:
        self.current = 0
        self.issued = 0

    def issue(self) -> int:
        self.issued += 1
        return self.issued


class Allocation(NamedTuple):
    """KV token locations for new positions, and the pools that no longer hold them."""

    locs: HostArray  # int64 [num_tokens], in row order, positions ascending
    pools: Pools


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
      the cache and read (locked) by one or more rows.

    A page's reference count is the rows that read it plus one while the
    cache holds it (`ref_counts`). Allocation evicts unlocked cached pages,
    least recently used first, when free pages run short. With the cache
    off it never matches nor holds a page: every page is free or private.

    Each slot allocation gets a new generation (`slot_gens`), which every
    record holding the slot carries: a holder from before the slot was
    released and handed out again is refused, whatever its lengths.

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
    slot_tokens: HostArray  # read-only int64 [max_reqs + 1], slot -> KV tokens it owns
    cache: PrefixCache  # disabled: never matches, never holds a page
    # slot -> the cached prefix its row reads (whole pages), for slots that read one.
    prefixes: Map[int, Tokens]  # persistent: a change copies no other entry
    # read-only int64 [max_reqs + 1], slot -> the generation its owner holds it at (0: free)
    slot_gens: HostArray
    next_gen: int  # the generation the next slot allocation gets, >= 1
    _stamp: _Stamp  # shared by the lineage: which version is the newest
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
        """KV tokens in free pages, not counting what eviction could add."""
        return len(self.page_list) * self.page_size

    @property
    def num_available_tokens(self) -> int:
        """KV tokens an allocation may take: free pages plus evictable cached ones."""
        return (len(self.page_list) + self.cache.num_evictable) * self.page_size

    @property
    def prefix_lens(self) -> HostArray:
        """Read-only int64 `[max_reqs + 1]`: tokens each slot's row reads from the cache."""
        lens = np.zeros_like(self.slot_tokens)
        for slot, tokens in self.prefixes.items():
            lens[slot] = len(tokens)
        return frozen(lens)

    def ref_counts(self) -> HostArray:
        """Read-only int64 `[num_pages + 1]`: rows reading each page, plus one if cached.

        0 for a free page, 1 for a private page or an evictable cached one.
        Host work over every slot's row and the cache: for checks, not per step.
        """
        counts = np.zeros(self.num_pages + 1, dtype=np.int64)
        for page, locks in self.cache.entries().values():
            counts[page] += 1 + locks
        page_size, table = self.page_size, self.table.host
        for slot in self.slot_tokens.nonzero()[0].tolist():
            start = len(self.prefixes.get(slot, ()))
            private = table[slot, start : int(self.slot_tokens[slot]) : page_size] // page_size
            counts[private.astype(np.int64)] += 1
        return frozen(counts)

    @property
    def kv_cache_size(self) -> int:
        """Rows a KV cache needs for every location this pool hands out (padding included)."""
        return (self.num_pages + 1) * self.page_size

    def allocate_slots(self, num_slots: int) -> Result[tuple[HostArray, Pools], OutOfReqSlots]:
        """Take `num_slots` free request slots (read-only int64), owning no tokens yet.

        Like every public method that allocates or frees, it refuses stale
        pools (`StalePools`) and commits its result. The slots' generation is
        `pools.slot_gens[slots]` of the pools returned.
        """
        self._expect_newest()
        allocated = self._allocate_slots(num_slots)
        if isinstance(allocated, OutOfReqSlots):
            return Failure(allocated)
        allocated[1]._commit()
        return Success(allocated)

    def _allocate_slots(self, num_slots: int) -> tuple[HostArray, Pools] | OutOfReqSlots:
        # `allocate_slots` without the Result wrapper, for the transitions' hot paths.
        if num_slots > self.num_free_slots:
            return OutOfReqSlots(num_slots, self.num_free_slots)
        slots, rest = self.slot_list.take(num_slots)
        slot_gens = self.slot_gens.copy()
        slot_gens[slots] = self.next_gen  # one generation per allocation call
        # A copy: the rows keep these as their mirror, and a view would tie that mirror to
        # the free list's buffer, which later values write.
        return frozen(slots.copy()), self._evolve(
            slot_list=rest, slot_gens=frozen(slot_gens), next_gen=self.next_gen + 1
        )

    def allocate_tokens(
        self, slots: HostArray, old_lens: HostArray, new_lens: HostArray
    ) -> Result[Allocation, OutOfKVTokens]:
        """Locations for positions `[old_lens[i], new_lens[i])` of each slot `slots[i]`.

        Pages are counted from host lengths: a row needs a new page at each
        position that starts one. Partly filled last pages are filled first.
        Does not write the table: the caller does, once all allocations of
        its transition have succeeded.
        """
        self._expect_newest()
        allocation = self._allocate_tokens(slots, old_lens, new_lens)
        return _committed(allocation)

    def _allocate_tokens(
        self, slots: HostArray, old_lens: HostArray, new_lens: HostArray
    ) -> Allocation | OutOfKVTokens:
        # `allocate_tokens` without the Result wrapper, for the transitions' hot paths.
        page_size = self.page_size
        num_tokens = new_lens - old_lens
        pages_before = (old_lens + page_size - 1) // page_size
        new_pages_per_row = (new_lens + page_size - 1) // page_size - pages_before
        num_new_pages = int(new_pages_per_row.sum())
        taken = self._take_pages(slots, new_lens, num_new_pages)
        if isinstance(taken, OutOfKVTokens):
            return taken
        new_pages, pools = taken
        if page_size == 1:
            return Allocation(new_pages, pools)  # one page per token, in row order
        rows = np.repeat(np.arange(slots.shape[0]), num_tokens)
        first_token = np.cumsum(num_tokens) - num_tokens
        positions = old_lens[rows] + np.arange(rows.shape[0]) - first_token[rows]
        page_of_req = positions // page_size
        is_new = page_of_req >= pages_before[rows]
        # The page already holding a position, from the host table; the cell is
        # stale where `is_new`, and `np.where` drops it there.
        existing = self.table.host[slots[rows], page_of_req * page_size].astype(np.int64)
        page = existing // page_size
        if num_new_pages:
            first_new = (np.cumsum(new_pages_per_row) - new_pages_per_row)[rows]
            new_index = (first_new + page_of_req - pages_before[rows]).clip(0, num_new_pages - 1)
            page = np.where(is_new, new_pages[new_index], page)
        return Allocation(page * page_size + positions % page_size, pools)

    def allocate_fresh(
        self, slots: HostArray, seq_lens: Sequence[int]
    ) -> Result[Allocation, OutOfKVTokens]:
        """Locations for positions `[0, seq_lens[i])` of each newly owned slot `slots[i]`.

        The extend fast path: pages are counted in Python and each row's
        locations are its whole pages laid out in order.
        """
        self._expect_newest()
        allocation = self._allocate_fresh(slots, seq_lens)
        return _committed(allocation)

    def _allocate_fresh(
        self, slots: HostArray, seq_lens: Sequence[int]
    ) -> Allocation | OutOfKVTokens:
        # `allocate_fresh` without the Result wrapper, for the transitions' hot paths.
        page_size = self.page_size
        pages_per_row = [-(-length // page_size) for length in seq_lens]
        taken = self._take_pages(slots, host_int64(seq_lens), sum(pages_per_row))
        if isinstance(taken, OutOfKVTokens):
            return taken
        new_pages, pools = taken
        if page_size == 1:
            return Allocation(new_pages, pools)
        tokens = (new_pages[:, None] * page_size + lanes(page_size)).ravel()
        first_page = 0
        runs = []
        for length, num_pages in zip(seq_lens, pages_per_row, strict=True):
            runs.append(tokens[first_page * page_size : first_page * page_size + length])
            first_page += num_pages
        return Allocation(runs[0] if len(runs) == 1 else np.concatenate(runs), pools)

    def allocate_next(
        self, slots: HostArray, new_lens: HostArray
    ) -> Result[Allocation, OutOfKVTokens]:
        """One more token for each slot, at position `new_lens[i] - 1` (the decode fast path).

        The same as `allocate_tokens(slots, new_lens - 1, new_lens)` in fewer
        host ops: a row needs a page only where its new position starts one.
        """
        self._expect_newest()
        allocation = self._allocate_next(slots, new_lens)
        return _committed(allocation)

    def _allocate_next(self, slots: HostArray, new_lens: HostArray) -> Allocation | OutOfKVTokens:
        # `allocate_next` without the Result wrapper, for the transitions' hot paths.
        page_size = self.page_size
        if page_size == 1:
            taken = self._take_pages(slots, new_lens, slots.shape[0])
            return taken if isinstance(taken, OutOfKVTokens) else Allocation(*taken)
        positions = new_lens - 1
        starts = np.flatnonzero(positions % page_size == 0)  # rows whose token opens a page
        taken = self._take_pages(slots, new_lens, starts.shape[0])
        if isinstance(taken, OutOfKVTokens):
            return taken
        new_pages, pools = taken
        # Every other row continues right after its previous token (a row opening
        # a page reads a stale cell here, then gets its new page below).
        locs = self.table.host[slots, positions - 1] + _ONE  # int64: _ONE is int64
        locs[starts] = new_pages * page_size
        return Allocation(locs, pools)

    def _take_pages(
        self, slots: HostArray, new_lens: HostArray, num_pages: int
    ) -> tuple[HostArray, Pools] | OutOfKVTokens:
        # The first `num_pages` free pages, evicting cached ones when free pages fall
        # short, and pools where `slots` own `new_lens` tokens.
        page_list, cache = self.page_list, self.cache
        shortage = num_pages - len(page_list)
        if shortage > 0:
            if shortage > cache.num_evictable:
                available = len(page_list) + cache.num_evictable
                return OutOfKVTokens(num_pages, available, self.page_size)
            cache, evicted = cache._evict(shortage)
            page_list = page_list.give(np.array(evicted, dtype=np.int64))
        pages, rest = page_list.take(num_pages)
        slot_tokens = self.slot_tokens.copy()
        slot_tokens[slots] = new_lens
        slot_tokens = frozen(slot_tokens)
        return pages, self._evolve(page_list=rest, slot_tokens=slot_tokens, cache=cache)

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
        cached prefix. Pages whose tokens the cache holds already (another
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
            StalePools: `self` is not the newest pools.
        """
        self._expect_newest()
        freed = self._free(slots, seq_lens, tokens, gens)
        return freed if isinstance(freed, Failure) else Success(freed.unwrap()._commit())

    def _free(
        self,
        slots: HostArray,
        seq_lens: HostArray | None,
        tokens: Sequence[Tokens] | None,
        gens: HostArray | None,
    ) -> Result[Pools, NotOwned]:
        owned = self._owned_tokens(slots, None if seq_lens is None else seq_lens.tolist(), gens)
        if isinstance(owned, NotOwned):
            return Failure(owned)
        if not owned:
            return Success(self)  # nothing to give back
        if self.cache.enabled:
            return Success(self._give_back_shared(slots, owned, tokens))
        page_size, table = self.page_size, self.table.host
        if len(owned) <= _MAX_ROW_READS:
            # A few requests finishing, the common case: one strided row read each.
            # int32 table cells: the free list's buffer converts as it copies them.
            rows = [table[slot, :tokens:page_size] for slot, tokens in owned]
            pages = rows[0] if len(rows) == 1 else np.concatenate(rows)
        else:
            num_pages = (self.slot_tokens[slots] + page_size - 1) // page_size
            rows_of_pages = np.repeat(np.arange(slots.shape[0]), num_pages)
            first_page = np.cumsum(num_pages) - num_pages
            columns = (np.arange(rows_of_pages.shape[0]) - first_page[rows_of_pages]) * page_size
            pages = table[slots[rows_of_pages], columns]
        if page_size > 1:
            pages = pages // page_size
        slot_tokens = self.slot_tokens.copy()
        slot_tokens[slots] = 0
        return Success(
            self._evolve(
                slot_list=self.slot_list.give(slots),
                page_list=self.page_list.give(pages),
                slot_tokens=frozen(slot_tokens),
                slot_gens=_cleared(self.slot_gens, slots),
            )
        )

    def _give_back_shared(
        self, slots: HostArray, owned: list[tuple[int, int]], tokens: Sequence[Tokens] | None
    ) -> Pools:
        # `free` with the cache on: each slot's whole pages go into the cache.
        prefixes = self.prefixes.mutate()
        cache, freed = give_back(self.cache, self.table.host, prefixes, owned, tokens)
        slot_tokens = self.slot_tokens.copy()
        slot_tokens[slots] = 0
        return self._evolve(
            slot_list=self.slot_list.give(slots),
            page_list=self.page_list.give(freed),
            slot_tokens=frozen(slot_tokens),
            slot_gens=_cleared(self.slot_gens, slots),
            cache=cache,
            prefixes=prefixes.finish(),
        )

    def _locked(self, token_lists: Sequence[Tokens]) -> tuple[Pools, list[int], list[HostArray]]:
        # Each prompt's longest cached prefix that leaves a token to compute, locked:
        # the pools whose cache holds the locks, the prefix lengths and their pages.
        if not self.cache.enabled:
            return self, [0] * len(token_lists), [NO_INTS] * len(token_lists)
        cache, lengths, pages = lock_prefixes(self.cache, token_lists)
        return self._evolve(cache=cache), lengths, pages

    def _lock_matched(self, token_lists: Sequence[Tokens], lengths: Sequence[int]) -> Pools:
        # `_locked` for prompts matched already (`match_prefix` on this cache).
        if not any(lengths):
            return self
        return self._evolve(cache=lock_matched(self.cache, token_lists, lengths))

    def _published(  # the rows that read, then the rows that publish
        self,
        reading: Sequence[int],
        read_lens: Sequence[int],
        read_tokens: Sequence[Tokens],
        slots: Sequence[int],
        token_lists: Sequence[Tokens],
    ) -> Pools:
        # Newly owned `reading` slots read their first `read_lens` tokens (locked already)
        # from the cache; then each row's tokens with KV in its slot (whole pages) go into
        # the cache, and the row reads them from there: a prefill or a chunk just ended. A
        # row whose tokens another row cached first keeps its pages private until release.
        if not self.cache.enabled:
            return self
        prefixes = self.prefixes.mutate()  # changes a few entries, copies none of the rest
        for slot, length, tokens in zip(reading, read_lens, read_tokens, strict=True):
            if length:
                prefixes[slot] = tuple(tokens[:length])
        cache = publish(self.cache, self.table.host, prefixes, slots, token_lists)
        return self._evolve(cache=cache, prefixes=prefixes.finish())

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
            ValueError: a new length below 1 (or the cached prefix) or above
                what the slot owns.
            StalePools: `self` is not the newest pools.
        """
        self._expect_newest()
        shrunk = self._shrink(slots, new_lens)
        return shrunk if isinstance(shrunk, Failure) else Success(shrunk.unwrap()._commit())

    def _shrink(self, slots: HostArray, new_lens: HostArray) -> Result[Pools, NotOwned]:
        owned = self._owned_tokens(slots, None)
        if isinstance(owned, NotOwned):
            return Failure(owned)
        owned_tokens = self.slot_tokens[slots]
        floor = np.array([max(len(self.prefixes.get(slot, ())), 1) for slot, _ in owned])
        bad = (new_lens < floor) | (new_lens > owned_tokens)
        if bad.any():
            at = int(bad.argmax())
            raise ValueError(
                f"slot {int(slots[at])} owns {int(owned_tokens[at])} tokens"
                f" ({int(floor[at])} of them needed: its cached prefix, or one),"
                f" cannot shrink to {int(new_lens[at])}"
            )
        page_size = self.page_size
        kept_pages = (new_lens + page_size - 1) // page_size
        num_freed = (owned_tokens + page_size - 1) // page_size - kept_pages
        rows = np.repeat(np.arange(slots.shape[0]), num_freed)
        first_freed = np.cumsum(num_freed) - num_freed
        page_index = kept_pages[rows] + np.arange(rows.shape[0]) - first_freed[rows]
        pages = self.table.host[slots[rows], page_index * page_size].astype(np.int64) // page_size
        slot_tokens = self.slot_tokens.copy()
        slot_tokens[slots] = new_lens
        return Success(
            self._evolve(page_list=self.page_list.give(pages), slot_tokens=frozen(slot_tokens))
        )

    def _owned_tokens(
        self, slots: HostArray, expected: list[int] | None, gens: HostArray | None = None
    ) -> list[tuple[int, int]] | NotOwned:
        # (slot, tokens it owns) for each of `slots`; NotOwned if one is out of
        # range, free, repeated, owns other than `expected` tokens, or is at
        # another generation than `gens`. Few slots leave at a time: check them
        # in Python.
        values = slots.tolist()
        if not values:
            return []
        unowned = [slot for slot in values if not 1 <= slot <= self.max_reqs]
        if not unowned:
            owned = list(zip(values, self.slot_tokens[slots].tolist(), strict=True))
            held = self.slot_gens[slots]
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

    def _evolve(
        self,
        *,
        slot_list: FreeList | None = None,
        page_list: FreeList | None = None,
        slot_tokens: HostArray | None = None,
        cache: PrefixCache | None = None,
        prefixes: Map[int, Tokens] | None = None,
        slot_gens: HostArray | None = None,
        next_gen: int | None = None,
    ) -> Pools:
        # A copy with some fields replaced, at a new version not yet committed (the
        # transition commits its result); attrs.evolve costs four times as much.
        return Pools(
            self.table,
            self.page_size,
            self.num_pages,
            self.slot_list if slot_list is None else slot_list,
            self.page_list if page_list is None else page_list,
            self.slot_tokens if slot_tokens is None else slot_tokens,
            self.cache if cache is None else cache,
            self.prefixes if prefixes is None else prefixes,
            self.slot_gens if slot_gens is None else slot_gens,
            self.next_gen if next_gen is None else next_gen,
            self._stamp,
            self._stamp.issue(),
        )

    def __repr__(self) -> str:
        cached = (
            f" cached_pages={self.cache.num_pages} ({self.cache.num_locked} in use),"
            if self.cache.enabled
            else ""
        )
        return (
            f"Pools(free_slots={self.num_free_slots}/{self.max_reqs},"
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


def _committed(allocation: Allocation | OutOfKVTokens) -> Result[Allocation, OutOfKVTokens]:
    if isinstance(allocation, OutOfKVTokens):
        return Failure(allocation)
    allocation.pools._commit()
    return Success(allocation)


def _cleared(slot_gens: HostArray, slots: HostArray) -> HostArray:
    # The generations with `slots` free again (0).
    cleared = slot_gens.copy()
    cleared[slots] = 0
    return frozen(cleared)


_ONE: Final = np.int64(1)
_NO_PREFIXES: Final[Map[int, Tokens]] = Map()
# Up to this many slots freed at once, reading each one's row beats index tensors.
_MAX_ROW_READS: Final = 8
