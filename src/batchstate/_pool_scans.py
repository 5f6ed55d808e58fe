"""Who reads what, found by a scan of every slot: per-page reference counts, per-slot prefixes.

Host work over every slot's row of the table and over the cache: for checks
and reports, not per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from batchstate._mirrored import HostArray, frozen

if TYPE_CHECKING:
    from batchstate._pools import Pools

__all__ = ["cached_prefix_lens", "page_ref_counts"]


def cached_prefix_lens(pools: Pools) -> HostArray:
    """Read-only int64 `[max_reqs + 1]`: tokens each slot's row reads from the cache."""
    lens = np.zeros_like(pools.slot_tokens)
    for slot, tokens in pools.prefixes.items():
        lens[slot] = len(tokens)
    return frozen(lens)


def page_ref_counts(pools: Pools) -> HostArray:
    """Read-only int64 `[num_pages + 1]`: rows reading each page, plus one if cached."""
    counts = np.zeros(pools.num_pages + 1, dtype=np.int64)
    for page, locks in pools.cache.entries().values():
        counts[page] += 1 + locks
    page_size, table = pools.page_size, pools.table.host
    for slot in pools.slot_tokens.nonzero()[0].tolist():
        start = len(pools.prefixes.get(slot, ()))
        private = table[slot, start : int(pools.slot_tokens[slot]) : page_size] // page_size
        counts[private.astype(np.int64)] += 1
    return frozen(counts)
