"""The pools' side of prefix sharing: lock the prefixes rows read, publish what they computed.

With the cache off each function returns the pools given: nothing is
matched, locked or published. The results are not committed: the
transition that calls them commits its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from batchstate._mirrored import NO_INTS, HostArray
from batchstate._prefix_cache import Tokens
from batchstate._sharing import lock_matched, lock_prefixes, publish

if TYPE_CHECKING:
    from batchstate._pools import Pools

__all__ = ["lock_cached_prefixes", "lock_matched_prefixes", "publish_rows"]


def lock_cached_prefixes(
    pools: Pools, token_lists: Sequence[Tokens]
) -> tuple[Pools, list[int], list[HostArray]]:
    """Each prompt's longest cached prefix that leaves a token to compute, locked.

    Returns the pools whose cache holds the locks, the prefix lengths and their pages.
    """
    if not pools.cache.enabled:
        return pools, [0] * len(token_lists), [NO_INTS] * len(token_lists)
    cache, lengths, pages = lock_prefixes(pools.cache, token_lists)
    return pools._evolve(cache=cache), lengths, pages


def lock_matched_prefixes(
    pools: Pools, token_lists: Sequence[Tokens], lengths: Sequence[int]
) -> Pools:
    """`lock_cached_prefixes` for prompts matched already (`match_prefix` on this cache)."""
    if not any(lengths):
        return pools
    return pools._evolve(cache=lock_matched(pools.cache, token_lists, lengths))


def publish_rows(  # noqa: PLR0917  # the rows that read, then the rows that publish
    pools: Pools,
    reading: Sequence[int],
    read_lens: Sequence[int],
    read_tokens: Sequence[Tokens],
    slots: Sequence[int],
    token_lists: Sequence[Tokens],
) -> Pools:
    """Record what new rows read from the cache, then publish each row's whole pages.

    Newly owned `reading` slots read their first `read_lens` tokens (locked
    already) from the cache; then each row's tokens with KV in its slot
    (whole pages) go into the cache, and the row reads them from there: a
    prefill or a chunk just ended. A row whose tokens another row cached
    first keeps its pages private until release.
    """
    if not pools.cache.enabled:
        return pools
    prefixes = pools.prefixes.mutate()  # changes a few entries, copies none of the rest
    for slot, length, tokens in zip(reading, read_lens, read_tokens, strict=True):
        if length:
            prefixes[slot] = tuple(tokens[:length])
    cache = publish(pools.cache, pools.table.host, prefixes, slots, token_lists)
    return pools._evolve(cache=cache, prefixes=prefixes.finish())
