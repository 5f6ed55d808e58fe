"""Evicting ahead of allocation: an engine's evictions mirrored leaf by leaf, for its
shadows, and an engine's own eager eviction, for drive mode.

batchstate's transitions evict only as allocation needs pages, least recently used
first (`Pools.allocate_*`, the transitions). An engine's cache evicts others (SGLang's
radix tree: its clock, its node boundaries, a page per request more than the shortage;
vLLM's block pool: the head of its free queue, whole blocks), and a shadow
(`batchstate.sglang`, `batchstate.vllm`) must take the same ones before replaying a
call, or every later allocation lands on other pages. No transition evicts a named
prefix, so these functions use the prefix cache's own tree operations
(`PrefixCache.nodes`, `lock`, `unlock`, `evict`) and `Pools.next_version`, and no
shadow does.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from batchstate.cache import PrefixCache
from batchstate.pools.pools import Pools


def unlocked_leaves(pools: Pools) -> list[tuple[tuple[int, ...], int]]:
    """The cached leaves eviction may take: each one's tokens from the root and where
    its own tokens (the node's, below its parent) start."""
    cache = pools.cache
    leaves = cache.leaves
    nodes = cache.nodes()
    return [(prefix, len(prefix) - len(node.tokens)) for prefix, node in nodes if prefix in leaves]


def evict_leaves(pools: Pools, leaves: Sequence[tuple[tuple[int, ...], int]]) -> Pools:
    """`pools` with each cached leaf (tokens from the root, tokens kept) evicted down to its
    first `keep` tokens, in order; one that is not an unlocked leaf by its turn is skipped.
    On hybrid pools the anchors ending in evicted pages are dropped with them.
    Returns `pools` itself when nothing was evicted, else its next version."""
    cache, evicted = pools.cache, list[int]()
    for leaf, keep in leaves:
        if leaf not in cache.leaves:
            continue
        if keep:  # split the leaf where the engine's node ends: a lock walk splits there
            marks = cache.leaves
            cache = attrs.evolve(cache.lock(leaf, keep).unlock(leaf, keep), leaves=marks)
        # Oldest first: a leaf marked older than every other is the one evicted.
        marked = {k: -1 if k == leaf else v for k, v in cache.leaves.items()}
        cache, pages = attrs.evolve(cache, leaves=marked).evict(1)
        evicted += pages
    return _without(pools, cache, evicted)


def evict_least_recent(pools: Pools, num_pages: int) -> Pools:
    """`pools` with unlocked cached leaves evicted, least recently used first (whole
    leaves, as allocation evicts them), until at least `num_pages` pages are freed or
    nothing is evictable: what an engine that evicts ahead of its allocation takes
    (SGLang before a decode and after a retraction). Returns `pools` itself when
    nothing was evicted, else its next version."""
    cache, evicted = pools.cache.evict(num_pages)
    return _without(pools, cache, evicted)


def _without(pools: Pools, cache: PrefixCache, evicted: list[int]) -> Pools:
    # `pools` after `cache` gave up the `evicted` pages: free again.
    if not evicted:
        return pools
    freed = pools.page_list.give(np.array(evicted, dtype=np.int64))
    memory = pools.memory
    if memory.cached.anchors:  # anchors ending in evicted pages go with them, as on allocation
        memory = memory.drop_uncached(lambda prefix: cache.cached_prefix(prefix)[0] == len(prefix))
    return pools.next_version(page_list=freed, cache=cache, memory=memory).commit()
