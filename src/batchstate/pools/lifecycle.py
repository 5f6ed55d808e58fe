"""Pools' start and end: `make_pools` hands out empty pools, `flush` empties the cache."""

from __future__ import annotations

import numpy as np
import torch

from batchstate.base.mirrored import NO_INTS, frozen
from batchstate.cache.prefix_cache import PrefixCache
from batchstate.memory.free_list import FreeList
from batchstate.memory.hybrid_pools import hybrid_pools
from batchstate.memory.kinds import (
    FULL_ATTENTION,
    MemoryKinds,
    check_kinds,
    reads_cached_prefixes,
)
from batchstate.memory.token_table import TokenTable
from batchstate.pools.lineage import Stamp
from batchstate.pools.pools import _NO_PREFIXES, Pools, expect_pools

__all__ = ["flush", "make_pools"]


def make_pools(
    max_reqs: int,
    max_context_len: int,
    num_kv_tokens: int,
    device: torch.device,
    page_size: int = 1,
    *,
    prefix_cache: bool = False,
    memory: MemoryKinds = FULL_ATTENTION,
) -> Pools:
    """Empty pools: every slot and page free, and an empty prefix cache (on or off).

    Args:
        max_reqs: request slots; the table gets one more row, row 0, for padding.
        max_context_len: the table's width, the longest a request may grow.
        num_kv_tokens: usable KV token slots, a multiple of `page_size`; one
            more page, page 0, is reserved for padding.
        device: where the table's device side lives.
        page_size: tokens per page, >= 1.
        prefix_cache: whether finished prefills and released rows leave their
            whole pages cached for later requests with the same prefix.
        memory: the memory kinds of a hybrid model's other layers (sliding
            window pages, recurrent state slots; docs/hybrid.md). The
            default, full attention only, makes the pools of a plain model.

    Raises:
        ValueError: a size is not positive, or `num_kv_tokens % page_size`.
        MemoryKindError: `memory` describes memory these pools cannot hold
            (a window of 0 or past `max_context_len`, a state that does not
            fit). With the prefix cache on, hybrid pools read a cached prefix
            up to an anchor that keeps its window tail and state (docs/hybrid.md).

    >>> pools = make_pools(4, 32, 64, torch.device("cpu"), page_size=16)
    >>> pools.num_free_slots, pools.num_free_tokens, pools.kv_cache_size
    (4, 64, 80)
    """
    sizes = {"max_reqs": max_reqs, "max_context_len": max_context_len, "page_size": page_size}
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if num_kv_tokens < 0 or num_kv_tokens % page_size:
        raise ValueError(
            f"num_kv_tokens must be a non-negative multiple of page_size={page_size},"
            f" got {num_kv_tokens}"
        )
    check_kinds(memory, max_context_len, page_size)
    num_pages = num_kv_tokens // page_size
    stamp = Stamp()
    table = TokenTable.zeros(
        max_reqs,
        max_context_len,
        device,
        page_size=page_size,
        num_pages=num_pages,
        first_gen=stamp.first_gen,
    )
    return Pools(
        table,
        page_size,
        num_pages,
        FreeList.of(np.arange(1, max_reqs + 1, dtype=np.int64)),
        FreeList.of(np.arange(1, num_pages + 1, dtype=np.int64)),
        NO_INTS,
        0,
        frozen(np.zeros(max_reqs + 1, dtype=np.int64)),
        PrefixCache.empty(page_size, enabled=prefix_cache, reuses=reads_cached_prefixes(memory)),
        _NO_PREFIXES,
        frozen(np.zeros(max_reqs + 1, dtype=np.int64)),
        stamp.first_gen,
        hybrid_pools(memory, page_size, max_reqs, max_context_len),
        stamp,
        stamp.current,  # version 0: the newest
    )


def flush(pools: Pools) -> Pools:
    """Evict every cached page no row reads: at shutdown, every page is free after it.

    Retired pages (duplicates given back at a prefill's end) join the free
    list too: `flush` comes after the last forward. Pages that live rows
    read (their cached prefixes) stay cached. On hybrid pools every anchor
    no new row resumes from goes too, its window pages and state slot
    freed. With the cache off, `pools` itself. Host work only.

    >>> pools = flush(make_pools(4, 32, 64, torch.device("cpu"), prefix_cache=True))
    >>> pools.num_free_tokens, pools.cache.num_pages
    (64, 0)
    """
    expect_pools(pools)
    cache = pools.cache
    anchors = pools.memory.cached.anchors.values()
    unlocked = any(not anchor.locks for anchor in anchors)
    if not cache.num_evictable and not pools.retired.shape[0] and not unlocked:
        return pools
    cache, evicted = cache.evict(cache.num_evictable)
    # After the last forward: retired pages are written already, so they are free too.
    freed = np.concatenate((pools.retired, np.array(evicted, dtype=np.int64)))
    # Locked anchors stay: a new row's copies from them have not run yet.
    memory = pools.memory.drop_uncached(lambda _: False) if unlocked else None
    return pools.next_version(
        page_list=pools.page_list.give(freed), retired=NO_INTS, cache=cache, memory=memory
    ).commit()
