"""Pools with a prefix cache: KV pages free, cached, or in use by one or more rows."""

from __future__ import annotations

from typing import Generic, NamedTuple, TypeVar, final

import attrs
import numpy as np

from batchstate._errors import BatchConflict, OutOfKVTokens
from batchstate._mirrored import HostArray, frozen
from batchstate._pools import Pools
from batchstate._prefix_cache import PrefixCache
from batchstate._token_table import TokenTable

__all__ = ["CachedPools", "CachedStep", "cached_pools"]


@final
@attrs.frozen(eq=False, repr=False)
class CachedPools:
    """Request slots and KV pages shared through a `PrefixCache`, as one value.

    A KV page is in exactly one state:

    - **free**: in the free list;
    - **cached**: held by the cache, read by no live row (evictable);
    - **in use**: private to one row (past its cached prefix), or held by
      the cache and read by `locks` rows (its cached prefix).

    A page's reference count is the rows that read it, plus one while the
    cache holds it (`ref_counts`). The pools inside are private: releasing
    a row through plain `release` would free pages the cache shares, so
    only the cached transitions (`extend_cached`, `decode_cached`,
    `release_cached`) change this value. Linear, like `Pools`.

    Raises:
        BatchConflict: built by hand from a cache of other pools.
    """

    _pools: Pools
    cache: PrefixCache
    prefix_lens: HostArray  # read-only int64 [max_reqs + 1], slot -> tokens it reads from the cache

    def __attrs_post_init__(self) -> None:
        if self.cache.owner is not self._pools.table:
            raise BatchConflict("the prefix cache belongs to other pools (another token table)")
        if self.cache.page_size != self._pools.page_size:
            raise BatchConflict(
                f"the prefix cache has pages of {self.cache.page_size},"
                f" the pools of {self._pools.page_size}"
            )
        if self.prefix_lens.shape != self._pools.slot_tokens.shape:
            raise BatchConflict(
                f"prefix_lens has {self.prefix_lens.shape[0]} slots,"
                f" the pools {self._pools.slot_tokens.shape[0]}"
            )

    @classmethod
    def _trusted(cls, pools: Pools, cache: PrefixCache, prefix_lens: HostArray) -> CachedPools:
        # NOTE: skips the checks: only for values a cached transition derived.
        value = object.__new__(cls)
        object.__setattr__(value, "_pools", pools)
        object.__setattr__(value, "cache", cache)
        object.__setattr__(value, "prefix_lens", prefix_lens)
        return value

    @property
    def table(self) -> TokenTable:
        """The request-to-token table the model reads (cached prefixes included)."""
        return self._pools.table

    @property
    def page_size(self) -> int:
        return self._pools.page_size

    @property
    def num_pages(self) -> int:
        return self._pools.num_pages

    @property
    def max_reqs(self) -> int:
        return self._pools.max_reqs

    @property
    def max_context_len(self) -> int:
        return self._pools.max_context_len

    @property
    def kv_cache_size(self) -> int:
        """Rows a KV cache needs for every location these pools hand out."""
        return self._pools.kv_cache_size

    @property
    def slot_tokens(self) -> HostArray:
        """Read-only int64 `[max_reqs + 1]`: KV tokens each slot's row holds (prefix included)."""
        return self._pools.slot_tokens

    @property
    def free_slots(self) -> HostArray:
        return self._pools.free_slots

    @property
    def free_pages(self) -> HostArray:
        return self._pools.free_pages

    @property
    def num_free_slots(self) -> int:
        return self._pools.num_free_slots

    @property
    def num_free_tokens(self) -> int:
        """KV tokens in free pages, not counting what eviction could add."""
        return self._pools.num_free_tokens

    @property
    def num_available_tokens(self) -> int:
        """KV tokens an allocation may take: free pages plus evictable cached ones."""
        return (len(self._pools.page_list) + self.cache.num_evictable) * self.page_size

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
            start = int(self.prefix_lens[slot])
            private = table[slot, start : int(self.slot_tokens[slot]) : page_size] // page_size
            counts[private.astype(np.int64)] += 1
        return frozen(counts)

    def _evicting(self, shortage: int) -> CachedPools | OutOfKVTokens:
        # At least `shortage` more free pages, evicted from the cache; or what ran out.
        if shortage > self.cache.num_evictable:
            free = len(self._pools.page_list)
            return OutOfKVTokens(free + shortage, free + self.cache.num_evictable, self.page_size)
        cache, evicted = self.cache._evict(shortage)
        pools = self._pools
        pools = Pools(
            pools.table,
            pools.page_size,
            pools.num_pages,
            pools.slot_list,
            pools.page_list.give(np.array(evicted, dtype=np.int64)),
            pools.slot_tokens,
        )
        return CachedPools._trusted(pools, cache, self.prefix_lens)

    def __repr__(self) -> str:
        pools = self._pools
        return (
            f"CachedPools(free_slots={pools.num_free_slots}/{pools.max_reqs},"
            f" free_pages={len(pools.page_list)}, cached_pages={self.cache.num_pages}"
            f" ({self.cache.num_locked} in use)/{pools.num_pages}, page_size={pools.page_size})"
        )


_Phase_co = TypeVar("_Phase_co", covariant=True)  # a phase record: Extended or Decoding


class CachedStep(NamedTuple, Generic[_Phase_co]):
    """What a cached transition returns: the new record and the cached pools it left."""

    batch: _Phase_co
    pools: CachedPools


def cached_pools(pools: Pools) -> CachedPools:
    """`pools` with an empty prefix cache: from now on, thread the `CachedPools` through.

    Slots already owned keep their pages, private to their rows. Take `pools`
    as consumed: releasing through it after this would free pages the
    cached pools still count.

    >>> import torch
    >>> from batchstate import make_pools
    >>> cached_pools(make_pools(4, 32, 64, torch.device("cpu"), page_size=16))
    CachedPools(free_slots=4/4, free_pages=4, cached_pages=0 (0 in use)/4, page_size=16)
    """
    return CachedPools(
        pools,
        PrefixCache._empty(pools.page_size, pools.table),
        frozen(np.zeros_like(pools.slot_tokens)),
    )
