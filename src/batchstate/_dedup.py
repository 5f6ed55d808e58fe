"""A prefill's or a chunk's end: publish each row's whole pages, or read the cache's copy.

With the cache on, each extend row's whole pages go into the cache and its
lock moves onto them. Where the cache holds the row's tokens already (an
earlier row of the same step published them, or an earlier step did), the
row's own pages for them are duplicates: its lock moves onto the cached
pages, its table cells there are rewritten to them (the KV is the same),
and its own pages are retired: the forward in flight still writes them,
nothing reads them, and the next allocation frees them.

The new cells join the transition's table write (one scatter, one upload),
so nothing here touches the device; the table is read on the host only,
at cells earlier transitions wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt

from batchstate._mirrored import HostArray, frozen
from batchstate._pool_versions import next_version
from batchstate._prefix_cache import PrefixCache, Tokens

if TYPE_CHECKING:
    from batchstate._pools import Pools

__all__ = ["Cells", "ExtendRows", "publish_computed"]

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


def publish_computed(
    pools: Pools,
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
    earlier forward are appended. Without `retire` (`prebuilt`: no forward
    computes the pages, a KV transfer fills them through the table after
    this) such a row keeps its own pages private until release instead.
    """
    if not pools.cache.enabled:
        return pools, cells
    prefixes = pools.prefixes.mutate()  # changes a few entries, copies none of the rest
    for slot, prefix in reading:
        if prefix:
            prefixes[slot] = prefix
    cache, table, page_size = pools.cache, pools.table.host, pools.page_size
    locs32 = cells[2]
    retired: list[HostArray] = []
    extra: list[Cells] = []
    for slot, tokens, start, first in zip(*rows, strict=True):
        full = len(tokens) // page_size * page_size
        old = prefixes.get(slot, ())
        if full <= len(old):
            continue
        ids = tuple(tokens[:full])
        row = _RowLocs(table[slot], locs32, start, first)
        # Most rows find nothing cached past their prefix: the walk that publishes their
        # pages finds that out (None: the cache holds the next page, another row's).
        own_pages = row.at(np.arange(len(old), full, page_size)) // page_size
        published = cache._publish(ids, len(old), own_pages.tolist())
        if published is not None:
            cache = published
            prefixes[slot] = ids
            continue
        if not retire:
            continue  # cached past its prefix already: its own copy stays private
        cached, pages = cache._cached(ids)  # full-attention pages: hybrid rows dedup too
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
            published = cache._publish(ids, cached, rest.tolist())
            assert published is not None, "the match stopped at `cached`: no page past it is cached"
            cache = published
            prefixes[slot] = ids
    if not retired:
        return next_version(pools, cache=cache, prefixes=prefixes.finish()), cells
    freed = np.concatenate(retired)
    after = next_version(
        pools,
        cache=cache,
        prefixes=prefixes.finish(),
        retired=frozen(np.concatenate((pools.retired, freed))),
        num_retired=pools.num_retired + freed.shape[0],
    )
    return after, _joined((cells[0], cells[1], locs32), extra)


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


def _read_cached(cache: PrefixCache, old: Tokens, prefix: Tokens) -> PrefixCache:
    # The row reads `prefix` (cached, longer than `old`) from the cache: its lock moves there.
    cache = cache._lock(prefix, len(prefix))
    return cache._unlock(old, len(old)) if old else cache


def _joined(cells: Cells, extra: Sequence[Cells]) -> Cells:
    if not extra:
        return cells
    return (
        np.concatenate((cells[0], *(part[0] for part in extra))),
        np.concatenate((cells[1], *(part[1] for part in extra))),
        np.concatenate((cells[2], *(part[2] for part in extra))),
    )
