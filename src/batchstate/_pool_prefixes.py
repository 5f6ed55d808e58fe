"""The pools' side of prefix sharing: lock the prefixes rows read.

With the cache off each function returns the pools given: nothing is
matched or locked. On hybrid pools a prompt's prefix is the one
`usable_prefix` gives (the match cut back to the longest anchor), and
the anchor it ends at is held with it. The results are not committed: the
transition that calls them commits its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from batchstate._hybrid_reuse import hold_anchors, usable_prefix
from batchstate._mirrored import NO_INTS, HostArray
from batchstate._pool_versions import next_version
from batchstate._prefix_cache import Tokens
from batchstate._sharing import lock_matched, lock_prefixes

if TYPE_CHECKING:
    from batchstate._pools import Pools

__all__ = ["lock_cached_prefixes", "lock_matched_prefixes"]


def lock_cached_prefixes(
    pools: Pools, token_lists: Sequence[Tokens]
) -> tuple[Pools, list[int], list[HostArray]]:
    """Each prompt's longest cached prefix that leaves a token to compute, locked.

    On hybrid pools, its longest usable one (`usable_prefix`), its anchor held.

    Returns the pools whose cache holds the locks, the prefix lengths and their pages.
    """
    if not pools.cache.enabled:
        return pools, [0] * len(token_lists), [NO_INTS] * len(token_lists)
    if pools.memory.kinds.is_hybrid:  # cut back to what the cache keeps beside the pages
        matches = [usable_prefix(pools, tokens) for tokens in token_lists]
        lengths = [length for length, _ in matches]
        cache = lock_matched(pools.cache, token_lists, lengths)
        locked = hold_anchors(next_version(pools, cache=cache), token_lists, lengths)
        return locked, lengths, [pages for _, pages in matches]
    cache, lengths, pages = lock_prefixes(pools.cache, token_lists)
    return next_version(pools, cache=cache), lengths, pages


def lock_matched_prefixes(
    pools: Pools, token_lists: Sequence[Tokens], lengths: Sequence[int]
) -> Pools:
    """`lock_cached_prefixes` for prompts matched already on this cache.

    By `match_prefix`, or on hybrid pools by `usable_prefix`: the anchors
    the matches end at are held too.
    """
    if not any(lengths):
        return pools
    locked = next_version(pools, cache=lock_matched(pools.cache, token_lists, lengths))
    return hold_anchors(locked, token_lists, lengths)
