"""PrefixCache updates deep in the tree, eviction of a parent left bare, recency of a lock."""

from __future__ import annotations

import numpy as np
import pytest

from batchstate import PrefixCache


def _cache(*prompts: tuple[int, ...]) -> PrefixCache:
    """Pages of one token; token `t` at position `i` of a prompt cached in page `10 * i + t`."""
    cache = PrefixCache.empty(1)
    for tokens in prompts:
        cache, _ = cache._insert(tokens, [10 * i + t for i, t in enumerate(tokens)])
    return cache


def test_a_miss_matches_no_tokens_and_an_empty_int64_array_of_pages() -> None:
    length, pages = PrefixCache.empty(1).match((1, 2, 3))
    assert length == 0 and pages.dtype == np.int64 and pages.shape == (0,)
    length, pages = _cache((1, 2)).match((3,))
    assert length == 0 and pages.dtype == np.int64 and pages.shape == (0,)


def test_len_counts_the_nodes_of_the_tree() -> None:
    assert len(_cache()) == 0
    assert len(_cache((1, 2, 3))) == 1
    assert len(_cache((1, 2, 3), (1, 2, 4))) == 3  # (1, 2) and its two children


def test_a_lock_three_nodes_deep_locks_every_node_on_its_path() -> None:
    cache = _cache((1, 2, 3), (1, 2, 4), (1, 5))  # (1) -> (2) -> (3), (4); (1) -> (5)
    assert {prefix: node.tokens for prefix, node in cache.nodes()} == {
        (1,): (1,),
        (1, 2): (2,),
        (1, 5): (5,),
        (1, 2, 3): (3,),
        (1, 2, 4): (4,),
    }
    locked = cache.lock((1, 2, 3), 3)
    locks = {prefix: node.locks for prefix, node in locked.nodes()}
    assert locks == {(1,): 1, (1, 5): 0, (1, 2): 1, (1, 2, 4): 0, (1, 2, 3): 1}
    assert locked.num_locked == 3
    unlocked = locked.unlock((1, 2, 3), 3)
    assert {node.locks for _, node in unlocked.nodes()} == {0} and unlocked.num_locked == 0


def test_a_parent_left_without_children_is_evicted_in_the_same_call() -> None:
    cache = _cache((1, 2), (1, 3))  # (1) -> (2), (3)
    evicted, pages = cache.evict(3)
    assert sorted(pages) == [1, 12, 13]
    assert evicted.num_pages == 0 and len(evicted) == 0


def test_a_locked_prefix_counts_as_used_when_evicting() -> None:
    cache = _cache((1,), (2,))  # (1) cached first: the least recently used
    assert cache.evict(1)[1] == [1]
    read = cache.lock((1,), 1).unlock((1,), 1)  # a row read (1) since
    assert read.evict(1)[1] == [2]


def test_evicted_pages_add_up_across_evictions_and_older_values_keep_their_count() -> None:
    cache = _cache((1, 2), (3,), (4,))  # four pages, three leaves
    once, first = cache.evict(1)
    twice, second = once.evict(2)
    assert (len(first), len(second)) == (2, 2)  # whole leaves: (1) -> (2) goes in one
    assert (cache.num_evicted, once.num_evicted, twice.num_evicted) == (0, 2, 4)
    assert twice.num_pages == 0 and len(twice) == 0


def test_a_disabled_cache_matches_nothing_and_prints_so() -> None:
    off = PrefixCache.empty(4, enabled=False)
    length, pages = off.match(tuple(range(12)))
    assert length == 0 and pages.dtype == np.int64 and pages.shape == (0,)
    assert (off.num_pages, off.num_evictable, off.num_tokens) == (0, 0, 0)
    assert repr(off) == "PrefixCache(disabled, page_size=4)"
    assert repr(PrefixCache.empty(4)) == "PrefixCache(pages=0, locked=0, page_size=4)"


def _shape(cache: PrefixCache) -> dict[tuple[int, ...], tuple[tuple[int, ...], int, int]]:
    # Every node by its prefix: its pages, locks and recency (the eviction order's key).
    return {prefix: (node.pages, node.locks, node.used) for prefix, node in cache.nodes()}


@pytest.mark.parametrize("page_size", [1, 2])
@pytest.mark.parametrize("read", [0, 1, 2])
def test_publishing_a_row_is_insert_lock_and_unlock_in_one_walk(page_size: int, read: int) -> None:
    # A row reading `read` cached pages of (1, 2, ...) computed four pages more.
    cache = PrefixCache.empty(page_size)
    prompts: tuple[tuple[int, ...], ...] = ((1, 2, 3, 4), (1, 2, 7, 8, 9, 9), (5, 6))
    for prompt in prompts:
        cache, _ = cache._insert(prompt, list(range(100, 100 + len(prompt) // page_size)))
    start = read * page_size
    tokens = (1, 2, 3, 4)[:start] + tuple(range(20, 20 + 4 * page_size))
    if start:
        cache = cache.lock(tokens, start)
    pages = list(range(200, 204))
    one_walk = cache.publish(tokens, start, pages)
    stepwise, present = cache._insert(tokens, [0] * read + pages)
    stepwise = stepwise.lock(tokens, len(tokens))
    if start:
        stepwise = stepwise.unlock(tokens, start)
    assert present == start and one_walk is not None
    assert _shape(one_walk) == _shape(stepwise)
    assert (one_walk.clock, one_walk.num_pages, one_walk.num_locked) == (
        stepwise.clock,
        stepwise.num_pages,
        stepwise.num_locked,
    )
    assert one_walk.leaves == one_walk._unlocked_leaves() == stepwise.leaves


def test_publishing_past_a_page_another_row_cached_changes_nothing() -> None:
    cache = _cache((1, 2, 3))
    locked = cache.lock((1, 2, 3), 1)
    assert locked.publish((1, 2, 4), 1, [24, 34]) is None  # (1, 2) is cached already
