"""Request slots and KV pages (free, cached or in use), as one immutable value: `Pools`.

In this module, top to bottom: deriving the next value of a lineage and
committing an allocation's (pools are linear: a transition builds its result
as a new version that is not yet the newest, and commits it only once it has
succeeded, so a failed or abandoned transition leaves the pools it was given
the newest); the checks of what a caller hands the public allocate and free
methods; taking slots and pages, and giving them back; publishing what a
prefill computed to the prefix cache (and a hybrid model's anchors); and the
`Pools` class, whose methods are what transitions and callers use.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, NamedTuple, final

import attrs
import numpy as np
import numpy.typing as npt
from immutables import Map, MapMutation
from returns.result import Failure, Result, Success

from batchstate.base.errors import (
    NotOwned,
    OutOfKVTokens,
    OutOfReqSlots,
    PoolsArgumentError,
    StalePools,
)
from batchstate.base.mirrored import NO_INTS, HostArray, describe, frozen, host_int64, same
from batchstate.base.read_only import read_only_copies
from batchstate.cache.prefix_cache import PrefixCache, Tokens
from batchstate.cache.sharing import give_back, lanes, lock_matched, lock_prefixes
from batchstate.memory.free_list import FreeList
from batchstate.memory.hybrid_pools import HybridPools
from batchstate.memory.kinds import MemoryKinds
from batchstate.memory.token_table import TokenTable
from batchstate.pools.lineage import Stamp

if TYPE_CHECKING:
    from batchstate.cache.prefix_cache import PrefixCache
    from batchstate.memory.hybrid_pools import HybridPools

__all__ = ["Allocation", "ExtendRows", "Pools", "expect_pools"]


def _committed_allocation(
    allocation: Allocation | OutOfKVTokens,
) -> Result[Allocation, OutOfKVTokens]:
    """The allocation with its pools committed (the newest now), or the failure as it is."""
    if isinstance(allocation, OutOfKVTokens):
        return Failure(allocation)
    allocation.pools.commit()
    return Success(allocation)


# What a caller hands `Pools`' public allocate and free methods, checked before any change.
#
# The transitions call the allocators underneath these doors directly: they
# derive their arguments from records already checked against the pools, so
# they pay for none of this. A caller of the doors may pass anything, and an
# unchecked count, slot or length would hand a live request's slot or KV
# pages to another (a free list moved back over pages still in use). Every
# check here raises `PoolsArgumentError` naming the argument, before
# anything is taken or freed.


def _check_count(num_slots: object) -> int:
    """`num_slots` as an int, if it is a non-negative integer (not a bool)."""
    if isinstance(num_slots, bool | np.bool_):
        raise PoolsArgumentError("num_slots must be an integer, got a bool")
    try:
        count = operator.index(num_slots)  # type: ignore[arg-type]  # checked just below
    except TypeError:
        raise PoolsArgumentError(
            f"num_slots must be an integer, got {type(num_slots).__name__}"
        ) from None
    if count < 0:
        raise PoolsArgumentError(f"num_slots must be >= 0, got {count}")
    return count


def _check_tokens(pools: Pools, slots: object, old_lens: object, new_lens: object) -> None:
    """`allocate_tokens`' arguments: owned slots, at the length each owns, growing in the table."""
    checked = _owned(pools, slots)
    old = _host_array("old_lens", old_lens, checked.shape[0])
    new = _host_array("new_lens", new_lens, checked.shape[0])
    _expect_held(pools, checked, old, "old_lens")
    _expect_growth(pools, checked, old, new)


def _check_fresh(pools: Pools, slots: object, seq_lens: object) -> list[int]:
    """`allocate_fresh`'s arguments: owned slots holding nothing yet, lengths in the table.

    Returns the lengths as Python ints, as the allocator counts them.
    """
    checked = _owned(pools, slots)
    if isinstance(seq_lens, np.ndarray):
        lens = _host_array("seq_lens", seq_lens, checked.shape[0])
    else:
        lens = _ints("seq_lens", seq_lens, checked.shape[0])
    _expect_held(pools, checked, np.zeros_like(checked), "a fresh slot's length")
    _expect_growth(pools, checked, np.zeros_like(checked), lens, least=1)
    fresh: list[int] = lens.tolist()
    return fresh


def _check_next(pools: Pools, slots: object, new_lens: object) -> None:
    """`allocate_next`'s arguments: owned slots, each growing by exactly one token."""
    checked = _owned(pools, slots)
    new = _host_array("new_lens", new_lens, checked.shape[0])
    _expect_held(pools, checked, new - 1, "new_lens - 1")
    _expect_growth(pools, checked, new - 1, new)


def _check_free(slots: object, seq_lens: object, tokens: object, gens: object) -> None:
    """`free`'s arguments' types and shapes; ownership is `owned_tokens`' to check."""
    checked = _host_array("slots", slots)
    if seq_lens is not None:
        _host_array("seq_lens", seq_lens, checked.shape[0])
    if gens is not None:
        _host_array("gens", gens, checked.shape[0])
    if tokens is not None and (not isinstance(tokens, Sequence) or len(tokens) != checked.shape[0]):
        raise PoolsArgumentError(
            f"tokens must be a sequence of one token sequence per slot"
            f" ({checked.shape[0]}), got {type(tokens).__name__}"
        )


def _check_shrink(slots: object, new_lens: object) -> None:
    """`shrink`'s arguments' types and shapes; ownership and range are checked there."""
    checked = _host_array("slots", slots)
    _host_array("new_lens", new_lens, checked.shape[0])


def _owned(pools: Pools, slots: object) -> HostArray:
    # `slots` as a host array, if each is a distinct slot the pools hold (at any length).
    checked = _host_array("slots", slots)
    values = checked.tolist()
    out_of_range = [slot for slot in values if not 1 <= slot <= pools.max_reqs]
    if out_of_range:
        raise PoolsArgumentError(
            f"slots {out_of_range} are out of range: request slots are 1..{pools.max_reqs}"
        )
    free = [slot for slot in values if not pools.slot_gens[slot]]
    if free:
        raise PoolsArgumentError(f"slots {free} are free: allocate_slots hands out slots first")
    if len(set(values)) != len(values):
        raise PoolsArgumentError(f"slots {values} repeat a slot")
    return checked


def _expect_held(pools: Pools, slots: HostArray, lens: HostArray, what: str) -> None:
    held = pools.slot_tokens[slots]
    wrong = (held != lens).nonzero()[0].tolist()
    if wrong:
        at = wrong[0]
        raise PoolsArgumentError(
            f"slot {int(slots[at])} owns {int(held[at])} tokens, {what} says {int(lens[at])}:"
            f" positions below what a slot owns are another row's KV"
        )


def _expect_growth(
    pools: Pools, slots: HostArray, old: HostArray, new: HostArray, least: int = 0
) -> None:
    short = (new < old + least).nonzero()[0].tolist()
    if short:
        at = short[0]
        raise PoolsArgumentError(
            f"slot {int(slots[at])} would go from {int(old[at])} to {int(new[at])} tokens:"
            f" an allocation grows a slot (free or shrink give tokens back)"
        )
    too_long = (new > pools.max_context_len).nonzero()[0].tolist()
    if too_long:
        at = too_long[0]
        raise PoolsArgumentError(
            f"slot {int(slots[at])} would own {int(new[at])} tokens, the table holds"
            f" {pools.max_context_len}"
        )


def _host_array(name: str, value: object, length: int | None = None) -> HostArray:
    # A 1-D int64 numpy array of `length` (any, if None).
    if not isinstance(value, np.ndarray) or value.dtype != np.int64 or value.ndim != 1:
        got = (
            f"{value.dtype} {list(value.shape)}"
            if isinstance(value, np.ndarray)
            else type(value).__name__
        )
        raise PoolsArgumentError(f"{name} must be a 1-D int64 numpy array, got {got}")
    if length is not None and value.shape[0] != length:
        raise PoolsArgumentError(f"{name} has {value.shape[0]} values, slots has {length}")
    return value


def _ints(name: str, value: object, length: int) -> HostArray:
    # Python ints (no bools, no floats) as an int64 array of `length`.
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise PoolsArgumentError(f"{name} must be a sequence of ints, got {type(value).__name__}")
    if len(value) != length:
        raise PoolsArgumentError(f"{name} has {len(value)} values, slots has {length}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int | np.integer):
            raise PoolsArgumentError(f"{name} must be ints, got {type(item).__name__}")
    try:
        return np.array(value, dtype=np.int64).reshape(length)
    except OverflowError:
        raise PoolsArgumentError(f"{name} must fit in int64, got {list(value)}") from None


# Taking request slots and KV pages from `Pools`: host arithmetic only, nothing committed.
#
# Each function returns the new pools (not yet committed: the transition
# that calls it commits its result) or a failure value; the pools given
# stay unchanged. Pages are counted from host lengths, and free pages
# falling short evicts unlocked cached pages, least recently used first.


class Allocation(NamedTuple):
    """KV token locations for new positions, and the pools that no longer hold them."""

    locs: HostArray  # int64 [num_tokens], in row order, positions ascending
    pools: Pools


def _admitted(pools: Pools, memory: HybridPools, slots: HostArray) -> HybridPools | None:
    # A state slot per new row, and with the cache on each row pending until it grows:
    # a release before then keeps no anchor of memory its forward or transfer never wrote.
    if not memory.kinds.is_hybrid:
        return None
    taken = memory.take_slots(slots)
    return taken.admit(slots) if pools.cache.enabled else taken


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
        cache, evicted = cache.evict(shortage)
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
    return pages, pools.next_version(
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
        memory = memory.drop_uncached(lambda prefix: cache.cached_prefix(prefix)[0] == len(prefix))
    if not memory.windows:  # the window layers' pages: taken, and out-of-window ones freed
        return memory
    first_read = old_lens if reads_from is None else reads_from
    return memory.grow(slots, old_lens, new_lens, first_read, pools.page_size)


_ONE: Final = np.int64(1)


def _give_back_shared(
    pools: Pools, slots: HostArray, owned: list[tuple[int, int]], tokens: Sequence[Tokens] | None
) -> Pools:
    # `give_back_slots` with the cache on: each slot's whole pages go into the cache. On
    # hybrid pools a row that ends on a page boundary keeps its window tail and state there
    # as an anchor; every other window page and state goes back free.
    prefixes = pools.prefixes.mutate()
    kept = _finished_tails(pools, owned, tokens)
    cache, freed = give_back(pools.cache, pools.table.host, prefixes, owned, tokens)
    return pools.next_version(
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


def _zeroed(per_slot: HostArray, slots: HostArray) -> HostArray:
    # A per-slot array with `slots` free again (0 tokens, generation 0).
    cleared = per_slot.copy()
    cleared[slots] = 0
    return frozen(cleared)


# Up to this many slots freed at once, reading each one's row beats index tensors.
_MAX_ROW_READS: Final = 8


# A prefill's or a chunk's end: publish each row's whole pages, or read the cache's copy.
#
# With the cache on, each extend row's whole pages go into the cache and its
# lock moves onto them. Where the cache holds the row's tokens already (an
# earlier row of the same step published them, or an earlier step did), the
# row's own pages for them are duplicates: its lock moves onto the cached
# pages, its table cells there are rewritten to them (the KV is the same),
# and its own pages are retired: the forward in flight still writes them,
# nothing reads them, and the next allocation frees them.
#
# The new cells join the transition's table write (one scatter, one upload),
# so nothing here touches the device; the table is read on the host only,
# at cells earlier transitions wrote.


Cells = tuple[HostArray, HostArray, npt.NDArray[np.int32]]  # slot, position, location


class ExtendRows(NamedTuple):
    """The rows a transition computes prompt tokens for, in the order of their cells.

    Row `i` computes positions `[computed_from[i], seq_len)` of slot `slots[i]`,
    whose cells come `first_cell[i]` onwards among the transition's cells;
    `tokens[i]` are its tokens with KV once the forward ran.
    """

    slots: Sequence[int]
    tokens: Sequence[Tokens]
    computed_from: Sequence[int]
    first_cell: Sequence[int]


class _RowLocs(NamedTuple):
    # One row's own locations: earlier forwards' from its table row, this forward's
    # from the transition's cells (`locs32[first:]` holds positions `start` onwards).
    table_row: npt.NDArray[np.int32]
    locs32: npt.NDArray[np.int32]
    start: int
    first: int

    def at(self, positions: HostArray) -> HostArray:
        # `positions` ascend (every caller passes a range): where all are on one side of
        # `start`, one gather gives what the two `where`s below would.
        if positions.shape[0] and positions[0] >= self.start:
            return self.locs32[positions + (self.first - self.start)].astype(np.int64)
        if positions.shape[0] and positions[-1] < self.start:
            return self.table_row[positions].astype(np.int64)
        earlier = positions < self.start
        cell = (self.first + positions - self.start).clip(min=self.first)
        ours = np.where(earlier, self.table_row[positions.clip(max=max(self.start - 1, 0))], 0)
        return np.where(earlier, ours, self.locs32[cell]).astype(np.int64)


def _publishing_order(
    rows: ExtendRows, prefixes: MapMutation[int, Tokens]
) -> list[tuple[int, Tokens, int, int]]:
    # Rows holding cells an earlier forward wrote past their cached prefix (continuing
    # chunks: `start` past it) first, the most held first, so that a later row moving its
    # cells below `start` onto a page published here finds an earlier forward's KV at those
    # positions; then every other row (a new one starts at its prefix), in order.
    every = list(zip(*rows, strict=True))
    held = [row[2] > len(prefixes.get(row[0], ())) for row in every]
    if not any(held):
        return every
    holding = sorted(
        (row for row, holds in zip(every, held, strict=True) if holds), key=lambda row: -row[2]
    )  # stable: equal starts keep their order
    return holding + [row for row, holds in zip(every, held, strict=True) if not holds]


def _read_cached(cache: PrefixCache, old: Tokens, prefix: Tokens) -> PrefixCache:
    # The row reads `prefix` (cached, longer than `old`) from the cache: its lock moves there.
    cache = cache.lock(prefix, len(prefix))
    return cache.unlock(old, len(old)) if old else cache


def _joined(cells: Cells, extra: Sequence[Cells]) -> Cells:
    if not extra:
        return cells
    return (
        np.concatenate((cells[0], *(part[0] for part in extra))),
        np.concatenate((cells[1], *(part[1] for part in extra))),
        np.concatenate((cells[2], *(part[2] for part in extra))),
    )


def _read(token_lists: Sequence[Tokens], lengths: Sequence[int]) -> list[Tokens]:
    # The cached prefixes new rows read (the anchors they resume from), rows reading none left out.
    return [
        tuple(tokens[:length])
        for tokens, length in zip(token_lists, lengths, strict=True)
        if length
    ]


# Request slots and KV pages (free, cached or in use), as an immutable value.


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

    Two kinds of method change them. The checked ones (`allocate_slots`,
    `allocate_tokens`, `allocate_fresh`, `allocate_next`, `free`, `shrink`)
    validate every argument, commit their result and return a `Result`: they
    are for callers outside the transitions. The trusted ones (`take_*`,
    `lock_*`, `publish_*`, `resume_rows`, `shrink_slots`, `give_back_slots`,
    `next_version`) are the steps transitions are built from: the calling
    transition has checked their arguments, and commits (`commit`) only the
    pools it returns on success.

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
    stamp: Stamp  # shared by the lineage: which version is the newest
    _version: int  # this value's version

    @property
    def is_newest(self) -> bool:
        """Whether this is its lineage's newest committed value (transitions accept only it)."""
        return self.stamp.current == self._version

    def _expect_newest(self) -> None:
        if self.stamp.current != self._version:
            raise StalePools(
                "these pools are stale: a later value was derived from them by a successful"
                " transition; pass the newest pools (the one the last transition returned)"
            )

    def commit(self) -> Pools:
        """Make these pools their lineage's newest value, and return them.

        A transition calls it once, on the pools it returns on success: every
        earlier value of the lineage is stale from then on.
        """
        self.stamp.current = self._version
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
        `pools.slot_gens[slots]` of the pools returned. Each of these methods
        checks its arguments against these pools first (a bad one raises
        `PoolsArgumentError` naming it); transitions skip those checks: they
        derive their arguments from records already checked.
        """
        self._expect_newest()
        allocated = self.take_slots(_check_count(num_slots))
        if isinstance(allocated, OutOfReqSlots):
            return Failure(allocated)
        allocated[1].commit()
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
        _check_tokens(self, slots, old_lens, new_lens)
        allocation = self.take_tokens(slots, old_lens, new_lens)
        return _committed_allocation(allocation)

    def allocate_fresh(
        self, slots: HostArray, seq_lens: Sequence[int]
    ) -> Result[Allocation, OutOfKVTokens]:
        """Locations for positions `[0, seq_lens[i])` of each newly owned slot `slots[i]`.

        The extend fast path: pages are counted in Python and each row's
        locations are its whole pages laid out in order. `slots` must be
        owned and hold no tokens yet; each length is in `[1, max_context_len]`.
        """
        self._expect_newest()
        allocation = self.take_fresh(slots, _check_fresh(self, slots, seq_lens))
        return _committed_allocation(allocation)

    def allocate_next(
        self, slots: HostArray, new_lens: HostArray
    ) -> Result[Allocation, OutOfKVTokens]:
        """One more token for each slot, at position `new_lens[i] - 1` (the decode fast path).

        The same as `allocate_tokens(slots, new_lens - 1, new_lens)` in fewer
        host ops: a row needs a page only where its new position starts one.
        Each slot must be owned and hold `new_lens[i] - 1` tokens.
        """
        self._expect_newest()
        _check_next(self, slots, new_lens)
        allocation = self.take_next(slots, new_lens)
        return _committed_allocation(allocation)

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
        _check_free(slots, seq_lens, tokens, gens)
        freed = self.give_back_slots(slots, seq_lens, tokens, gens)
        return freed if isinstance(freed, Failure) else Success(freed.unwrap().commit())

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
        _check_shrink(slots, new_lens)
        shrunk = self.shrink_slots(slots, new_lens)
        return shrunk if isinstance(shrunk, Failure) else Success(shrunk.unwrap().commit())

    def take_slots(self, num_slots: int) -> tuple[HostArray, Pools] | OutOfReqSlots:
        """`num_slots` free request slots at one new generation, owning no tokens yet."""
        if num_slots > self.num_free_slots:
            return OutOfReqSlots(num_slots, self.num_free_slots)
        memory = self.memory
        if memory.states and num_slots > memory.free_states():  # a state slot per request
            available = memory.free_or_evictable_states()  # anchors' states may be evicted
            if num_slots > available:
                return OutOfReqSlots(num_slots, available)
        slots, rest = self.slot_list.take(num_slots)
        slot_gens = self.slot_gens.copy()
        slot_gens[slots] = self.next_gen  # one generation per allocation call
        # A copy: the rows keep these as their mirror, and a view would tie that mirror to
        # the free list's buffer, which later values write.
        return frozen(slots.copy()), self.next_version(
            slot_list=rest,
            slot_gens=frozen(slot_gens),
            next_gen=self.next_gen + 1,
            memory=_admitted(self, memory, slots),
        )

    def take_tokens(
        self,
        slots: HostArray,
        old_lens: HostArray,
        new_lens: HostArray,
        reads_from: HostArray | None = None,
    ) -> Allocation | OutOfKVTokens:
        """Locations for positions `[old_lens[i], new_lens[i])` of each slot `slots[i]`.

        `reads_from`: the first position each row's forward queries, where it
        is not `old_lens`: before it (a verify window queries its decode token
        again), or `new_lens` for rows no forward computes here (`admit_prefilled`);
        window pages are held only from what that position reads on.
        """
        page_size = self.page_size
        num_tokens = new_lens - old_lens
        pages_before = (old_lens + page_size - 1) // page_size
        new_pages_per_row = (new_lens + page_size - 1) // page_size - pages_before
        num_new_pages = int(new_pages_per_row.sum())
        taken = _take_pages(self, slots, new_lens, num_new_pages, reads_from)
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
        existing = self.table.host[slots[rows], page_of_req * page_size].astype(np.int64)
        page = existing // page_size
        if num_new_pages:
            first_new = (np.cumsum(new_pages_per_row) - new_pages_per_row)[rows]
            new_index = (first_new + page_of_req - pages_before[rows]).clip(0, num_new_pages - 1)
            page = np.where(is_new, new_pages[new_index], page)
        return Allocation(page * page_size + positions % page_size, after)

    def take_fresh(
        self, slots: HostArray, seq_lens: Sequence[int], *, transferred: bool = False
    ) -> Allocation | OutOfKVTokens:
        """Locations for positions `[0, seq_lens[i])` of each newly owned slot (the extend path).

        Pages are counted in Python and each row's locations are its whole
        pages laid out in order. `transferred`: no forward computes the rows
        here (`admit_prefilled`), so window pages are taken for each window's tail only.
        """
        page_size = self.page_size
        pages_per_row = [-(-length // page_size) for length in seq_lens]
        lengths = host_int64(seq_lens)
        taken = _take_pages(
            self, slots, lengths, sum(pages_per_row), lengths if transferred else None
        )
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

    def take_next(self, slots: HostArray, new_lens: HostArray) -> Allocation | OutOfKVTokens:
        """One more token for each slot, at position `new_lens[i] - 1` (the decode path).

        The same as `take_tokens(pools, slots, new_lens - 1, new_lens)` in fewer
        host ops: a row needs a page only where its new position starts one.
        """
        page_size = self.page_size
        if page_size == 1:
            taken = _take_pages(self, slots, new_lens, slots.shape[0])
            return taken if isinstance(taken, OutOfKVTokens) else Allocation(*taken)
        positions = new_lens - 1
        starts = np.flatnonzero(positions % page_size == 0)  # rows whose token opens a page
        taken = _take_pages(self, slots, new_lens, starts.shape[0])
        if isinstance(taken, OutOfKVTokens):
            return taken
        new_pages, after = taken
        # Every other row continues right after its previous token (a row opening
        # a page reads a stale cell here, then gets its new page below).
        locs = self.table.host[slots, positions - 1] + _ONE  # int64: _ONE is int64
        locs[starts] = new_pages * page_size
        return Allocation(locs, after)

    def reissue(self, slots: HostArray) -> tuple[HostArray, Pools]:
        """Owned `slots` at one new generation (returned per slot): every older holder is stale.

        For a record consumed by a transition that keeps its slots (a synced
        verify window): the record it returns holds the new generation, and the
        consumed one, at the old, is refused by every transition and `release`.
        """
        slot_gens = self.slot_gens.copy()
        slot_gens[slots] = self.next_gen
        gens = frozen(np.full(slots.shape[0], self.next_gen, dtype=np.int64))
        return gens, self.next_version(slot_gens=frozen(slot_gens), next_gen=self.next_gen + 1)

    def shrink_slots(self, slots: HostArray, new_lens: HostArray) -> Result[Pools, NotOwned]:
        """`Pools.shrink` without the commit: see there."""
        owned = self.owned_tokens(slots, None)
        if isinstance(owned, NotOwned):
            return Failure(owned)
        held = self.slot_tokens[slots]
        floor = np.array([max(len(self.prefixes.get(slot, ())), 1) for slot, _ in owned])
        bad = (new_lens < floor) | (new_lens > held)
        if bad.any():
            at = int(bad.argmax())
            raise PoolsArgumentError(
                f"slot {int(slots[at])} owns {int(held[at])} tokens"
                f" ({int(floor[at])} of them needed: its cached prefix, or one),"
                f" cannot shrink to {int(new_lens[at])}"
            )
        page_size = self.page_size
        kept_pages = (new_lens + page_size - 1) // page_size
        num_freed = (held + page_size - 1) // page_size - kept_pages
        rows = np.repeat(np.arange(slots.shape[0]), num_freed)
        first_freed = np.cumsum(num_freed) - num_freed
        page_index = kept_pages[rows] + np.arange(rows.shape[0]) - first_freed[rows]
        pages = self.table.host[slots[rows], page_index * page_size].astype(np.int64) // page_size
        slot_tokens = self.slot_tokens.copy()
        slot_tokens[slots] = new_lens
        memory = self.memory.shrink(slots, held, new_lens) if self.memory.windows else None
        return Success(
            self.next_version(
                page_list=self.page_list.give(pages),
                slot_tokens=frozen(slot_tokens),
                memory=memory,
            )
        )

    def lock_cached_prefixes(
        self, token_lists: Sequence[Tokens]
    ) -> tuple[Pools, list[int], list[HostArray]]:
        """Each prompt's longest cached prefix that leaves a token to compute, locked.

        On hybrid pools, its longest usable one (`usable_prefix`), its anchor held.

        Returns the pools whose cache holds the locks, the prefix lengths and their pages.
        """
        if not self.cache.enabled:
            return self, [0] * len(token_lists), [NO_INTS] * len(token_lists)
        if self.memory.kinds.is_hybrid:  # cut back to what the cache keeps beside the pages
            matches = [self.usable_prefix(tokens) for tokens in token_lists]
            lengths = [length for length, _ in matches]
            cache = lock_matched(self.cache, token_lists, lengths)
            locked = self.next_version(cache=cache).hold_anchors(token_lists, lengths)
            return locked, lengths, [pages for _, pages in matches]
        cache, lengths, pages = lock_prefixes(self.cache, token_lists)
        return self.next_version(cache=cache), lengths, pages

    def lock_matched_prefixes(self, token_lists: Sequence[Tokens], lengths: Sequence[int]) -> Pools:
        """`lock_cached_prefixes` for prompts matched already on this cache.

        By `match_prefix`, or on hybrid pools by `usable_prefix`: the anchors
        the matches end at are held too.
        """
        if not any(lengths):
            return self
        locked = self.next_version(cache=lock_matched(self.cache, token_lists, lengths))
        return locked.hold_anchors(token_lists, lengths)

    def touch_prefix(self, tokens: Sequence[int], length: int) -> Pools:
        """The cached prefix `tokens[:length]` (whole pages) matched by an engine that
        reads nothing: its pages become the most recently used for eviction, and so does
        the rest of a cached run the match ends inside, as SGLang's radix tree's match
        leaves its nodes. Locks and pages do not change.

        Raises `PoolsArgumentError`, and changes nothing, when `length` is not a whole
        number of pages the cache holds of `tokens`.
        """
        prefix = tuple(tokens)
        page = self.page_size
        if length < 0 or length % page or self.cache.cached_prefix(prefix[:length])[0] < length:
            raise PoolsArgumentError(
                f"touch_prefix: the first {length} tokens are not whole pages the cache holds"
            )
        if not length:
            return self
        return self.next_version(cache=self.cache.touch(prefix, length))

    def unlock_matched_prefixes(
        self, token_lists: Sequence[Tokens], lengths: Sequence[int]
    ) -> Pools:
        """`lock_matched_prefixes` given back: one reader of each prompt's first
        `lengths[i]` cached tokens leaves before taking a slot (an admission not run).

        Raises `PoolsArgumentError`, and changes nothing, on hybrid pools (their
        anchors' holds go back with a row's release) or when a prefix is not cached
        and locked.
        """
        if self.memory.kinds.is_hybrid:
            raise PoolsArgumentError(
                "unlock_matched_prefixes: hybrid pools give anchors back with a row's release"
            )
        cache = self.cache
        for tokens, length in zip(token_lists, lengths, strict=True):
            if not length:
                continue
            prefix = tuple(tokens)
            if cache.readers(prefix, length) < 1:
                raise PoolsArgumentError(
                    f"unlock_matched_prefixes: the first {length} tokens of a prompt are not "
                    "a cached prefix that a row has locked"
                )
            cache = cache.unlock(prefix, length)
        return self if cache is self.cache else self.next_version(cache=cache)

    def publish_computed(
        self,
        reading: Sequence[tuple[int, Tokens]],
        rows: ExtendRows,
        cells: Cells,
        *,
        retire: bool,
    ) -> tuple[Pools, Cells]:
        """Record what new rows read, then publish each row's whole pages (or read the cache's).

        `reading` holds (slot, cached prefix) of each new row that reads one
        (locked already). `cells` are the transition's table cells, not written
        yet; returns the pools and the cells to write instead: a duplicate's
        cells point at the cache's pages, and cells of positions computed by an
        earlier forward are appended. Without `retire` (`admit_prefilled`: no forward
        computes the pages, a KV transfer fills them through the table after
        this) such a row keeps its own pages private until release instead.

        Rows that hold cells an earlier forward wrote past their cached prefix
        (a continuing chunk's) publish first, the one holding the most first;
        then the others, in order. So a row whose cells below its start move
        onto the cache's pages finds there, at those positions, KV an earlier
        forward wrote: no cell this forward reads as a prefix is one it writes,
        whatever order a kernel reads and writes in (docs/design.md, "The
        forward's contract").
        """
        if not self.cache.enabled:
            return self, cells
        prefixes = self.prefixes.mutate()  # changes a few entries, copies none of the rest
        for slot, prefix in reading:
            if prefix:
                prefixes[slot] = prefix
        cache, table, page_size = self.cache, self.table.host, self.page_size
        locs32 = cells[2]
        retired: list[HostArray] = []
        extra: list[Cells] = []
        for slot, tokens, start, first in _publishing_order(rows, prefixes):
            full = len(tokens) // page_size * page_size
            old = prefixes.get(slot, ())
            if full <= len(old):
                continue
            ids = tuple(tokens[:full])
            row = _RowLocs(table[slot], locs32, start, first)
            # Most rows find nothing cached past their prefix: the walk that publishes their
            # pages finds that out (None: the cache holds the next page, another row's).
            own_pages = row.at(np.arange(len(old), full, page_size)) // page_size
            published = cache.publish(ids, len(old), own_pages.tolist())
            if published is not None:
                cache = published
                prefixes[slot] = ids
                continue
            if not retire:
                continue  # cached past its prefix already: its own copy stays private
            cached, pages = cache.cached_prefix(ids)  # full-attention pages: hybrid rows dedup too
            cache = _read_cached(cache, old, ids[:cached])
            prefixes[slot] = ids[:cached]
            positions = np.arange(len(old), cached)
            retired.append(row.at(positions[::page_size]) // page_size)
            shared = pages[positions // page_size] * page_size + positions % page_size
            later = positions >= start
            if later.any():
                if locs32 is cells[2]:
                    locs32 = locs32.copy()  # the caller's stays as it was
                locs32[first + positions[later] - start] = shared[later]
            if not later.all():
                before = positions[~later]
                extra.append(
                    (
                        np.full(before.shape[0], slot, dtype=np.int64),
                        before,
                        shared[~later].astype(np.int32),
                    )
                )
            if cached < full:
                rest = own_pages[(cached - len(old)) // page_size :]
                published = cache.publish(ids, cached, rest.tolist())
                assert published is not None, (
                    "the match stopped at `cached`: no page past it is cached"
                )
                cache = published
                prefixes[slot] = ids
        if not retired:
            return self.next_version(cache=cache, prefixes=prefixes.finish()), cells
        freed = np.concatenate(retired)
        after = self.next_version(
            cache=cache,
            prefixes=prefixes.finish(),
            retired=frozen(np.concatenate((self.retired, freed))),
            num_retired=self.num_retired + freed.shape[0],
        )
        return after, _joined((cells[0], cells[1], locs32), extra)

    def publish_tails(
        self,
        slots: Sequence[int],
        token_lists: Sequence[Tokens],
        computed_from: Sequence[int],
    ) -> Pools:
        """An anchor at each extend row's last page boundary its forward computes, room allowing.

        `token_lists[i]`: the tokens the row in `slots[i]` holds KV for once the
        forward ran (cached already, whole pages); `computed_from[i]`: the first
        position it computes. The forward copies the row's window tail into
        the anchor's window pages and checkpoints its state after the boundary.
        """
        memory = self.memory
        if not memory.kinds.is_hybrid or not self.cache.enabled:
            return self
        page_size = self.page_size
        for slot, tokens, start in zip(slots, token_lists, computed_from, strict=True):
            end = len(tokens) // page_size * page_size
            if end <= start:
                continue  # no boundary in this forward: an earlier one published it
            prefix = tuple(tokens[:end])
            if prefix not in memory.cached.anchors:
                memory = memory.publish(slot, prefix)
        return self if memory is self.memory else self.next_version(memory=memory)

    def resume_rows(
        self, slots: Sequence[int], token_lists: Sequence[Tokens], lengths: Sequence[int]
    ) -> Pools:
        """New rows (their slots just taken) that read `lengths[i]` cached tokens resume there.

        Each such row's window start moves to its anchor's tail, and the anchor
        (held since the match) stays locked until the row's forward copied its
        tail and state.
        """
        rows = [(slot, len_) for slot, len_ in zip(slots, lengths, strict=True) if len_]
        if not rows or not self.memory.kinds.is_hybrid:
            return self
        reading = [slot for slot, _ in rows]
        memory = self.memory.resume(reading, _read(token_lists, lengths), self.page_size)
        return self.next_version(memory=memory)

    def usable_prefix(self, tokens: Sequence[int], cap: int | None = None) -> tuple[int, HostArray]:
        """A prompt's longest cached prefix it may read, leaving a token to compute: length, pages.

        At most `cap` tokens, whole pages, if given. On hybrid pools the
        full-attention match is cut back to the longest anchor at or before
        it: a prefix whose window tail or state the cache does not keep is
        never read (docs/hybrid.md).
        """
        cache = self.cache
        ids = tuple(tokens)
        page_size = cache.page_size
        usable = (len(ids) - 1) // page_size * page_size
        if cap is not None:
            usable = min(usable, cap // page_size * page_size)
        if not self.memory.kinds.is_hybrid:
            return cache.match(ids[:usable])
        matched, pages = cache.cached_prefix(ids[:usable])
        anchors = self.memory.cached
        length = anchors.longest(ids, matched) if matched and anchors.anchors else 0
        return length, pages[: length // cache.page_size]

    def next_version(  # one keyword per field a transition may replace
        self,
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
        return type(self)(
            self.table,
            self.page_size,
            self.num_pages,
            self.slot_list if slot_list is None else slot_list,
            self.page_list if page_list is None else page_list,
            self.retired if retired is None else retired,
            self.num_retired if num_retired is None else num_retired,
            self.slot_tokens if slot_tokens is None else slot_tokens,
            self.cache if cache is None else cache,
            self.prefixes if prefixes is None else prefixes,
            self.slot_gens if slot_gens is None else slot_gens,
            self.next_gen if next_gen is None else next_gen,
            self.memory if memory is None else memory,
            self.stamp,
            self.stamp.issue(),
        )

    def hold_anchors(self, token_lists: Sequence[Tokens], lengths: Sequence[int]) -> Pools:
        """The anchors new rows matched (`lengths[i]` tokens of `token_lists[i]`), locked.

        Before the rows take their slots: taking state slots may evict anchors,
        never one a row of the same transition resumes from.
        """
        if not self.memory.kinds.is_hybrid or not any(lengths):
            return self
        return self.next_version(memory=self.memory.hold(_read(token_lists, lengths)))

    def give_back_slots(
        self,
        slots: HostArray,
        seq_lens: HostArray | None,
        tokens: Sequence[Tokens] | None,
        gens: HostArray | None,
    ) -> Result[Pools, NotOwned]:
        """`Pools.free` without the commit: see there."""
        owned = self.owned_tokens(slots, None if seq_lens is None else seq_lens.tolist(), gens)
        if isinstance(owned, NotOwned):
            return Failure(owned)
        if not owned:
            return Success(self)  # nothing to give back
        if self.cache.enabled:
            return Success(_give_back_shared(self, slots, owned, tokens))
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
        return Success(
            self.next_version(
                slot_list=self.slot_list.give(slots),
                page_list=self.page_list.give(pages),
                slot_tokens=_zeroed(self.slot_tokens, slots),
                slot_gens=_zeroed(self.slot_gens, slots),
                memory=_hybrid_given_back(self, slots),
            )
        )

    def owned_tokens(
        self, slots: HostArray, expected: list[int] | None, gens: HostArray | None = None
    ) -> list[tuple[int, int]] | NotOwned:
        """(slot, tokens it owns) for each of `slots`, or `NotOwned` naming the others.

        A slot is not owned if it is out of range, free, repeated, owns other
        than `expected` tokens, or is at another generation than `gens`. Few
        slots leave at a time: they are checked in Python.
        """
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
