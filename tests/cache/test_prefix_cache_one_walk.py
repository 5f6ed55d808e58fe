"""PrefixCache's one-walk updates give the value of the stepwise ones they replace."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from batchstate import PrefixCache

Tokens = tuple[int, ...]


def _shape(cache: PrefixCache) -> dict[Tokens, tuple[tuple[int, ...], int, int]]:
    # Every node by its prefix: its pages, locks and recency (the eviction order's key).
    return {prefix: (node.pages, node.locks, node.used) for prefix, node in cache.nodes()}


def _value(cache: PrefixCache) -> tuple[object, ...]:
    return (
        _shape(cache),
        cache.leaves,
        cache.clock,
        cache.num_pages,
        cache.num_locked,
        cache.num_evicted,
    )


def _pages(page_size: int, most: int) -> st.SearchStrategy[Tokens]:
    # Whole pages of tokens from a small alphabet, so that prompts share prefixes.
    tokens = st.lists(st.integers(1, 3), min_size=page_size, max_size=most * page_size)
    return tokens.map(lambda drawn: tuple(drawn[: len(drawn) // page_size * page_size]))


@st.composite
def _caches(draw: st.DrawFn) -> tuple[PrefixCache, list[Tokens]]:
    # A cache of a few prompts, some of them read (locked) by rows, in a drawn order.
    page_size = draw(st.sampled_from([1, 2]))
    cache, page = PrefixCache.empty(page_size), 1
    prompts = [draw(_pages(page_size, 4)) for _ in range(draw(st.integers(1, 6)))]
    reads: list[Tokens] = []
    for prompt in prompts:
        cache, _ = cache._insert(prompt, range(page, page + len(prompt) // page_size))
        page += len(prompt) // page_size
        if draw(st.booleans()):
            length = draw(st.integers(1, len(prompt) // page_size)) * page_size
            cache = cache.lock(prompt, length)
            reads.append(prompt[:length])
    return cache, reads


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_release_is_unlock_then_insert_in_one_walk(data: st.DataObject) -> None:
    cache, reads = data.draw(_caches())
    page_size = cache.page_size
    read = data.draw(st.sampled_from(reads)) if reads else ()
    tokens = read + (data.draw(_pages(page_size, 3)) if data.draw(st.booleans()) else ())
    pages = list(range(500, 500 + len(tokens) // page_size))
    released, present = cache._release(read, tokens, np.array(pages, dtype=np.int64))
    stepwise = cache.unlock(read, len(read)) if read else cache
    stepwise, present_stepwise = stepwise._insert(tokens, pages)
    assert present == present_stepwise
    assert _value(released) == _value(stepwise)
    assert released.leaves == released._unlocked_leaves()
    assert {type(page) for _, node in released.nodes() for page in node.pages} <= {int}
