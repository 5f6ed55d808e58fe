"""Extend and decode through a prefix cache: reuse cached prefixes, evict to make room."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import numpy as np
from returns.result import Failure, Result, Success

from batchstate._cached_pools import CachedPools, CachedStep
from batchstate._columns import NO_COLUMNS, C, NoColumns
from batchstate._decode import DecodeError, decode
from batchstate._errors import AllocError, EmptyExtend, OutOfKVTokens, OutOfReqSlots
from batchstate._extend import (
    _expect_columns,
    _expect_idle,
    _expect_unique,
    _first_problem,
    _token_ids,
)
from batchstate._mirrored import DeviceOnly, Mirrored, frozen, host_int64
from batchstate._phases import Decoding, Extended, Idle, Running
from batchstate._pools import _lanes
from batchstate._rows import Req, build_rows

__all__ = ["decode_cached", "extend_cached"]


@overload
def extend_cached(
    batch: Idle[NoColumns], reqs: Sequence[Req], pools: CachedPools
) -> Result[CachedStep[Extended[NoColumns]], AllocError]: ...
@overload
def extend_cached(
    batch: Idle[C], reqs: Sequence[Req], pools: CachedPools, columns: C
) -> Result[CachedStep[Extended[C]], AllocError]: ...
def extend_cached(  # the overloads above are the API; Any stands for their column set here
    batch: Idle[Any], reqs: Sequence[Req], pools: CachedPools, columns: Any = NO_COLUMNS
) -> Result[CachedStep[Extended[Any]], AllocError]:
    """Admit requests, reading each one's longest cached prefix instead of computing it.

    Each request's prefix is the longest cached one, in whole pages, that
    leaves at least one token to compute (the forward must produce the
    next token). The row locks those pages and writes them into its table
    row; only the rest is allocated and computed. `Extended.prefix_lens`
    says how much was read from the cache. Requests of one extend that
    share a prefix not cached yet each compute it (the cache learns it when
    the first of them is released).

    When free pages run short, unlocked cached pages are evicted (least
    recently used leaf first) in the same transition; `OutOfKVTokens` only
    when that is not enough either. Checks in the order `extend` does.

    Returns:
        `Success(CachedStep(Extended, CachedPools))`, or a `Failure` naming
        what ran out or which request was bad; `pools` is unchanged either way.

    Raises:
        PhaseError: `batch` is not `Idle`.
        BatchConflict: two requests share a rid, or `batch` and `pools` live
            on different devices.
        ColumnError: as for `extend`: the admitted rows' `columns` are not
            the batch's set, or have the wrong length, dtype or device.
    """
    _expect_idle(batch, "extend_cached")
    inner = pools._pools
    inner.table.expect_on(batch.device)
    _expect_columns(batch, columns, len(reqs))
    if not reqs:
        return Failure(EmptyExtend())
    _expect_unique([req.rid for req in reqs], "rid")
    problem = _first_problem(reqs, [0] * len(reqs), inner.max_context_len)
    if problem is not None:
        return Failure(problem)  # type: ignore[arg-type]  # no Resumed: never NotOwned
    if len(reqs) > inner.num_free_slots:
        return Failure(OutOfReqSlots(len(reqs), inner.num_free_slots))
    page_size, cache = inner.page_size, pools.cache
    prefix_lens: list[int] = []
    prefix_pages = []
    for req in reqs:
        # Leave the last token to compute: the forward samples after it.
        usable = (len(req.input_ids) - 1) // page_size * page_size
        length, pages = cache.match(req.input_ids[:usable])
        if length:
            cache = cache._lock(req.input_ids, length)
        prefix_lens.append(length)
        prefix_pages.append(pages)
    seq_lens = [len(req.input_ids) for req in reqs]
    needed = sum(-(-(n - p) // page_size) for n, p in zip(seq_lens, prefix_lens, strict=True))
    shortage = needed - len(inner.page_list)
    room = CachedPools._trusted(inner, cache, pools.prefix_lens)
    if shortage > 0:
        evicted = room._evicting(shortage)
        if isinstance(evicted, OutOfKVTokens):
            return Failure(OutOfKVTokens(needed, evicted.available_pages, page_size))
        room = evicted
    allocated = room._pools._allocate_slots(len(reqs))
    assert not isinstance(allocated, OutOfReqSlots), "slots were counted above"
    slots, with_slots = allocated
    prefix_host, seq_lens_host = host_int64(prefix_lens), host_int64(seq_lens)
    allocation = with_slots._allocate_tokens(slots, prefix_host, seq_lens_host)
    assert not isinstance(allocation, OutOfKVTokens), "pages were counted and evicted above"
    locs, after = allocation
    # The table cells of every row: its cached pages' locations, then its new ones.
    lanes = _lanes(page_size)
    cells_locs = []
    start = 0
    for row, length in enumerate(seq_lens):
        computed = length - prefix_lens[row]
        cached = (prefix_pages[row][:, None] * page_size + lanes).ravel()
        cells_locs += [cached, locs[start : start + computed]]
        start += computed
    locs32 = np.concatenate(cells_locs).astype(np.int32)
    token_slots = np.repeat(slots, seq_lens_host)
    positions = np.arange(locs32.shape[0]) - np.repeat(
        np.cumsum(seq_lens_host) - seq_lens, seq_lens
    )
    rows, (input_ids, out_cache_loc, *cells) = build_rows(
        batch.device,
        tuple(reqs),
        host_int64([req.rid for req in reqs]),
        slots,
        seq_lens_host,
        sum(seq_lens),
        max(seq_lens),
        columns,
        (_token_ids(reqs, prefix_lens), locs, token_slots, positions, locs32),
    )
    extend_lens = tuple(n - p for n, p in zip(seq_lens, prefix_lens, strict=True))
    extended = Extended._trusted(
        rows,
        DeviceOnly(input_ids),
        DeviceOnly(out_cache_loc),
        tuple(prefix_lens),
        extend_lens,
        sum(extend_lens),
    )
    slot_prefix = room.prefix_lens.copy()
    slot_prefix[slots] = prefix_host
    # NOTE: the table write comes last: a failure before it leaves the table as it was.
    after.table.write(
        Mirrored._pair(frozen(token_slots), cells[0]),
        Mirrored._pair(frozen(positions), cells[1]),
        Mirrored._pair(frozen(locs32), cells[2]),
    )
    return Success(
        CachedStep(extended, CachedPools._trusted(after, room.cache, frozen(slot_prefix)))
    )


def decode_cached(
    batch: Running[C], pools: CachedPools
) -> Result[CachedStep[Decoding[C]], DecodeError]:
    """`decode`, evicting unlocked cached pages first when free pages run short.

    Computes what `decode` computes; reads nothing from the device (the
    cache and its eviction are host data).

    Returns:
        `Success(CachedStep(Decoding, CachedPools))`; `Failure(OutOfKVTokens)`
        only when free and evictable pages together fall short, or
        `Failure(ContextTooLong)`; `batch` and `pools` unchanged either way.

    Raises:
        PhaseError, BatchConflict, StaleRecord: as `decode`.
    """
    result = decode(batch, pools._pools)
    step = result.value_or(None)
    if step is not None:
        return Success(
            CachedStep(step.batch, CachedPools._trusted(step.pools, pools.cache, pools.prefix_lens))
        )
    failure = result.failure()
    if not isinstance(failure, OutOfKVTokens):
        return Failure(failure)
    room = pools._evicting(failure.requested_pages - failure.available_pages)
    if isinstance(room, OutOfKVTokens):
        return Failure(room)
    batch_after, after = decode(batch, room._pools).unwrap()
    return Success(
        CachedStep(batch_after, CachedPools._trusted(after, room.cache, room.prefix_lens))
    )
