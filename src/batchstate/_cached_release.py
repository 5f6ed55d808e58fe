"""Release into the prefix cache: finished rows' full pages become cached, not free."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from returns.result import Failure, Result, Success

from batchstate._cached_pools import CachedPools
from batchstate._columns import C, D
from batchstate._errors import PhaseError, ReleaseError, StillRunning
from batchstate._filter import Departed
from batchstate._mirrored import frozen, overlap
from batchstate._phases import Batch, Decoding, Extended, Filtered, Idle
from batchstate._pools import Pools

__all__ = ["release_cached"]


def release_cached(
    left: Departed | Batch[C],
    running: Batch[D],
    pools: CachedPools,
    tokens: Sequence[Sequence[int]] | None = None,
) -> Result[CachedPools, ReleaseError]:
    """Give back the slots of every row of `left`, caching their KV instead of freeing it.

    Each row's tokens, in whole pages, go into the cache at the row's pages
    (and stop being read by it: its cached prefix is unlocked). Pages whose
    tokens the cache already holds (another row computed the same prefix),
    and a partly filled last page, are freed.

    Args:
        left: the rows that left, as for `release`.
        running: the batch that goes on; none of `left`'s slots may be in it.
        pools: the cached pools that own `left`'s memory.
        tokens: per row of `left`, the tokens whose KV its slot holds, from
            position 0: the prompt followed by generated tokens. Only its
            first `seq_len` tokens count. Default: each row's `input_ids`.

    Returns:
        `Success(CachedPools)`; `Failure(StillRunning)` or `Failure(NotOwned)`
        as `release`; `pools` is unchanged either way. Reads nothing from
        the device.

    Raises:
        PhaseError: `left` or `running` is not a batch.
        ValueError: `tokens` has another number of rows, or a row's tokens
            do not start with its `input_ids`.
    """
    if not isinstance(left, Departed | Idle | Extended | Decoding | Filtered):
        raise PhaseError(f"release_cached takes Departed or a batch, got {type(left).__name__}")
    if not isinstance(running, Idle | Extended | Decoding | Filtered):
        raise PhaseError(f"release_cached takes a batch as running, got {type(running).__name__}")
    if isinstance(left, Departed):
        reqs, slots, seq_lens = left.reqs, left.slots, left.seq_lens
    else:
        rows = left.rows
        reqs, slots, seq_lens = rows.reqs, rows.req_pool_indices.host, rows.seq_lens.host
    row_tokens = [req.input_ids for req in reqs] if tokens is None else [tuple(t) for t in tokens]
    if len(row_tokens) != len(reqs):
        raise ValueError(f"tokens for {len(row_tokens)} rows, {len(reqs)} rows left")
    for req, ids in zip(reqs, row_tokens, strict=True):
        if ids[: len(req.input_ids)] != req.input_ids:
            raise ValueError(f"request {req.rid}: its tokens do not start with its input_ids")
    still = overlap(slots, running.rows.req_pool_indices.host)
    if still.shape[0]:
        return Failure(StillRunning(tuple(still.tolist())))
    inner = pools._pools
    owned = inner._owned_tokens(slots, seq_lens.tolist())
    if not isinstance(owned, list):
        return Failure(owned)
    page_size, table, cache = inner.page_size, inner.table.host, pools.cache
    freed = []
    for req, ids, (slot, seq_len) in zip(reqs, row_tokens, owned, strict=True):
        pages = table[slot, :seq_len:page_size].astype(np.int64) // page_size
        prefix = int(pools.prefix_lens[slot])
        if prefix:
            cache = cache._unlock(req.input_ids, prefix)
        full = min(len(ids), seq_len) // page_size * page_size
        cache, present = cache._insert(ids[:full], pages[: full // page_size].tolist())
        # Pages the cache holds already past the row's own prefix: computed twice, free one.
        freed += [pages[prefix // page_size : present // page_size], pages[full // page_size :]]
    slot_tokens = inner.slot_tokens.copy()
    slot_tokens[slots] = 0
    prefix_lens = pools.prefix_lens.copy()
    prefix_lens[slots] = 0
    after = Pools(
        inner.table,
        page_size,
        inner.num_pages,
        inner.slot_list.give(slots),
        inner.page_list.give(np.concatenate(freed) if freed else slots[:0]),
        frozen(slot_tokens),
    )
    return Success(CachedPools._trusted(after, cache, frozen(prefix_lens)))
