"""Decode: one new token per row."""

from __future__ import annotations

from typing import Final

import numpy as np
from returns.result import Failure, Result, Success

from batchstate.base.errors import (
    ContextTooLong,
    DecodeError,
    OutOfKVTokens,
    PhaseError,
)
from batchstate.base.mirrored import DeviceOnly, Mirrored, frozen
from batchstate.columns.columns import C
from batchstate.pools.pools import Pools, expect_pools
from batchstate.records.phases import RUNNING_PHASES, BatchAndPools, Decoding, Running
from batchstate.records.rows import NUM_INTS, SEQ_LENS, Rows, build_rows, expect_current

__all__ = ["DecodeError", "decode", "grow"]


# Added to `Rows.ints` [4, num_reqs]: a column, one more token on the lengths' row, 0 on the others.
_ONE_MORE_TOKEN: Final = frozen(
    np.array([[1 if row == SEQ_LENS else 0] for row in range(NUM_INTS)], dtype=np.int64)
)


def decode(batch: Running[C], pools: Pools) -> Result[BatchAndPools[Decoding[C]], DecodeError]:
    """Make room for one more token per row: allocate its KV location, grow every length.

    Reads nothing from the device: lengths and page counts come from the
    host mirrors. With the prefix cache on, free pages that run short are
    evicted from the cache (unlocked pages, least recently used first).
    Writes the new locations into the request-to-token table (both sides)
    after the allocation has succeeded.

    Returns:
        `Success(BatchAndPools(Decoding, Pools))`; or `Failure(OutOfKVTokens)` or
        `Failure(ContextTooLong)`, with `batch` and `pools` unchanged.

    Raises:
        PhaseError: `batch` is `Idle` (or not a batch at all).
        BatchConflict: `batch` and `pools` live on different devices.
        StaleRecord: a row's slot does not own exactly that row's tokens in
            `pools` (one of the two is from an earlier step).
    """
    if not isinstance(batch, RUNNING_PHASES):
        raise PhaseError(f"decode takes Extended, Decoding or Filtered, got {type(batch).__name__}")
    expect_pools(pools)
    rows = batch.rows
    table = pools.table
    table.expect_on(rows.device)
    if rows.max_seq_len >= table.host.shape[1]:  # the table's width, without two property calls
        return Failure(_too_long(batch, pools.max_context_len))
    expect_current(rows, pools)
    grown = grow(rows, pools)
    if isinstance(grown, OutOfKVTokens):
        return Failure(grown)
    new_rows, out_cache_loc, after = grown
    return Success(BatchAndPools(Decoding.trusted(new_rows, out_cache_loc), after.commit()))


def grow(rows: Rows[C], pools: Pools) -> tuple[Rows[C], DeviceOnly, Pools] | OutOfKVTokens:
    """One more token per row of current `rows`: the grown rows, their KV locations, the pools.

    What `decode` and `decode_sampled` share; the pools are not committed.
    Writes the table after the allocation has succeeded.
    """
    slots = rows.req_pool_indices
    ints = rows.ints + _ONE_MORE_TOKEN  # a fresh array, its lengths one longer
    seq_lens = ints[SEQ_LENS]
    allocation = pools.take_next(slots.host, seq_lens)
    if isinstance(allocation, OutOfKVTokens):
        return allocation
    locs, after = allocation
    locs32 = locs.astype(np.int32)
    # One upload: the new lengths (both dtypes), the locations (both dtypes).
    grown, (out_cache_loc, table_locs) = build_rows(
        rows.device,
        rows.reqs,
        ints,
        slots,
        rows.seq_lens_sum + len(rows.reqs),
        rows.max_seq_len + 1 if rows.reqs else 0,
        rows.columns,  # unchanged by a decode
        (locs, locs32),
    )
    # The new token sits at position old seq_len of its row.
    after.table.write(slots, rows.seq_lens, Mirrored.trusted(frozen(locs32), table_locs))
    return grown, DeviceOnly(out_cache_loc), after


def _too_long(batch: Running[C], max_context_len: int) -> ContextTooLong:
    row = int(batch.rows.seq_lens.host.argmax())
    return ContextTooLong(
        batch.rows.reqs[row].rid, int(batch.rows.seq_lens.host[row]) + 1, max_context_len
    )
