"""check_pools with the cache on names what is broken: the tree, a prefix, locks, pages, rows.

Each test breaks one thing in small pools with the prefix cache on and reads
the whole message. The pools: 4 slots, pages of 4 tokens, 16 pages. Two
released requests left a tree of three pages: page 1 holds tokens 10..13,
its children page 2 (14..17) and page 5 (20..23). Request 3 (11 tokens) sits
in slot 3 and reads pages 1 and 2 as its cached prefix (8 tokens); its last
page, 7, is partly filled, so its prefill did not publish it: it is private.
"""

from __future__ import annotations

import copy
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from immutables import Map

from batchstate import (
    Extended,
    FreeList,
    Mirrored,
    Pools,
    PrefixCache,
    Req,
    check_pools,
    extend,
    filter_batch,
    idle,
    make_pools,
    release,
)
from batchstate.base.mirrored import host_int64
from tests.strategies import raises_exactly

CPU = torch.device("cpu")
HEAD = tuple(range(10, 18))  # two pages of 4 tokens


def _shared(max_reqs: int = 4, max_context_len: int = 32, page_size: int = 4) -> Pools:
    return make_pools(max_reqs, max_context_len, 64, CPU, page_size, prefix_cache=True)


def _running(head: tuple[int, ...] = HEAD) -> tuple[Extended, Pools, Pools]:
    """Request 3's record, the pools it runs in, and the pools from before it came."""
    reqs = [Req(1, (*head, 1)), Req(2, (*head[:4], 20, 21, 22, 23, 1))]
    first, pools = extend(idle(CPU), reqs, _shared()).unwrap()
    before = release(first, idle(CPU), pools).unwrap()
    # Pools are linear: the pools from before are a copy, a lineage of their own.
    batch, pools = extend(idle(CPU), [Req(3, (*head, 2, 3, 4))], copy.deepcopy(before)).unwrap()
    return batch, pools, before


def _with_cache(pools: Pools, **changes: Any) -> Pools:
    return attrs.evolve(pools, cache=attrs.evolve(pools.cache, **changes))


def _with_top(pools: Pools, **changes: Any) -> Pools:
    """The pools with the page 1 node (the root's only child) changed."""
    root = pools.cache.root
    ((key, node),) = root.children.items()
    return _with_cache(pools, root=root._replace(children=Map({key: node._replace(**changes)})))


def _with_tree(pools: Pools, **changes: Any) -> Pools:
    """The pools with the page 1 node's first child (page 2) changed."""
    root = pools.cache.root
    ((key, node),) = root.children.items()
    page_2 = (14, 15, 16, 17)  # the key of page 2's node: its first page of tokens
    children = node.children.set(page_2, node.children[page_2]._replace(**changes))
    return _with_cache(
        pools, root=root._replace(children=Map({key: node._replace(children=children)}))
    )


def _with_prefixes(pools: Pools, lens: dict[int, int]) -> Pools:
    """The pools with each slot reading its first `lens[slot]` tokens of a count: 0, 1, ..."""
    prefixes = {slot: tuple(range(10, 10 + length)) for slot, length in lens.items()}
    return attrs.evolve(pools, prefixes=Map(prefixes))


def _with_free_pages(pools: Pools, pages: list[int]) -> Pools:
    return attrs.evolve(pools, page_list=FreeList.of(np.array(pages, dtype=np.int64)))


def test_the_pools_these_tests_break_pass_the_check() -> None:
    batch, pools, before = _running()
    assert pools.prefix_lens.tolist() == [0, 0, 0, 8, 0]
    assert pools.cache.entries() == {
        HEAD[:4]: (1, 1),
        HEAD: (2, 1),
        (*HEAD[:4], 20, 21, 22, 23): (5, 0),
    }
    assert sorted(pools.free_pages.tolist()) == [3, 4, 6, *range(8, 17)]
    check_pools(pools, [batch], compare_device=True)
    check_pools(before, compare_device=True)


def test_rows_in_the_first_and_the_last_slot_pass_the_check() -> None:
    pools = _shared()
    reqs = [Req(rid, (rid,) * 5) for rid in range(4)]
    batch, pools = extend(idle(CPU), reqs, pools).unwrap()
    assert sorted(batch.rows.req_pool_indices.host.tolist()) == [1, 2, 3, 4]
    check_pools(pools, [batch], compare_device=True)


def test_the_last_page_read_as_a_prefix_by_every_slot_passes_the_check() -> None:
    """Pages 15 and 16 (the last) hold the prefix; slots 1 to 4 all read it."""
    pools = _shared(max_context_len=64)
    reqs = [Req(0, tuple(range(100, 156))), Req(1, HEAD)]  # 14 pages, then 2
    first, pools = extend(idle(CPU), reqs, pools).unwrap()
    pools = release(first, idle(CPU), pools).unwrap()
    batch, pools = extend(idle(CPU), [Req(r, (*HEAD, r)) for r in range(2, 6)], pools).unwrap()
    assert sorted(batch.rows.req_pool_indices.host.tolist()) == [1, 2, 3, 4]
    assert batch.prefix_lens.tolist() == [8, 8, 8, 8]
    assert list(pools.cache.entries().values()) == [(15, 4), (16, 4)]
    check_pools(pools, [batch], compare_device=True)


def test_a_tree_of_one_token_pages_passes_the_check() -> None:
    pools = _shared(page_size=1)
    first, pools = extend(idle(CPU), [Req(1, (7, 8, 1)), Req(2, (7, 9, 1))], pools).unwrap()
    pools = release(first, idle(CPU), pools).unwrap()
    batch, pools = extend(idle(CPU), [Req(3, (7, 8, 2))], pools).unwrap()
    # Request 3's lock split (8, 1); its prefill then published its last token, 2.
    assert sorted(node.tokens for _, node in pools.cache.nodes()) == [
        (1,),
        (2,),
        (7,),
        (8,),
        (9, 1),
    ]
    check_pools(pools, [batch], compare_device=True)


def test_pools_without_kv_pages_pass_the_check() -> None:
    empty = make_pools(4, 32, 0, CPU, page_size=4, prefix_cache=True)
    check_pools(empty, compare_device=True)


def test_a_cache_of_another_page_size() -> None:
    _, pools, _ = _running()
    with raises_exactly("the cache has pages of 16, the pools of 4"):
        check_pools(_with_cache(pools, page_size=16))


def test_an_empty_edge_in_the_tree() -> None:
    _, pools, _ = _running()
    with raises_exactly("cache node at 0 tokens: edge of 0 tokens, 0 pages"):
        check_pools(_with_top(pools, tokens=(), pages=()))


def test_an_edge_of_part_of_a_page() -> None:
    _, pools, _ = _running()
    with raises_exactly("cache node at 6 tokens: edge of 6 tokens, 1 pages"):
        check_pools(_with_top(pools, tokens=HEAD[:6]))


def test_an_edge_with_fewer_pages_than_its_tokens_fill() -> None:
    _, pools, _ = _running()
    with raises_exactly("cache node at 8 tokens: edge of 8 tokens, 1 pages"):
        check_pools(_with_top(pools, tokens=HEAD))


def test_a_node_keyed_by_tokens_it_does_not_start_with() -> None:
    _, pools, _ = _running()
    with raises_exactly("a cache node is keyed by other tokens"):
        check_pools(_with_tree(pools, tokens=(15, 14, 16, 17)))


def test_a_node_locked_more_than_its_parent() -> None:
    _, pools, _ = _running()
    with raises_exactly("a cache node is locked more than its parent"):
        check_pools(_with_tree(pools, locks=2))


def test_a_node_with_negative_locks() -> None:
    _, pools, _ = _running()
    with raises_exactly("a cache node has negative locks"):
        check_pools(_with_tree(pools, locks=-1))


def test_cache_page_counts_other_than_the_tree() -> None:
    _, pools, _ = _running()
    with raises_exactly("cache counts 4 pages (2 locked), the tree holds 3 (2)"):
        check_pools(_with_cache(pools, num_pages=4))
    with raises_exactly("cache counts 3 pages (1 locked), the tree holds 3 (2)"):
        check_pools(_with_cache(pools, num_locked=1))
    with raises_exactly("cache counts 3 pages (3 locked), the tree holds 3 (2)"):
        check_pools(_with_cache(pools, num_locked=3))


def test_the_padding_slot_reading_a_prefix() -> None:
    _, pools, _ = _running()
    with raises_exactly("padding slot 0 reads a cached prefix"):
        check_pools(_with_prefixes(pools, {0: 4, 3: 8}))


def _prefix_message(prefix: int, tokens: int) -> str:
    return f"slot 3: cached prefix {prefix} of {tokens} tokens is not whole pages of its row"


def test_a_prefix_of_part_of_a_page() -> None:
    _, pools, _ = _running()
    with raises_exactly(_prefix_message(6, 11)):
        check_pools(_with_prefixes(pools, {3: 6}))


def test_a_prefix_longer_than_the_row() -> None:
    _, pools, _ = _running()
    for prefix in (12, 16):
        with raises_exactly(_prefix_message(prefix, 11)):
            check_pools(_with_prefixes(pools, {3: prefix}))


def test_a_prefix_of_the_whole_row_passes_the_check() -> None:
    """A prompt of whole pages is published whole: its row reads every token it holds."""
    _, pools, _ = _running()
    whole, after = extend(idle(CPU), [Req(4, (*HEAD, 2, 3, 4, 5))], pools).unwrap()
    assert whole.prefix_lens.tolist() == [8]  # read; then its third page was published
    slot = int(whole.rows.req_pool_indices.host[0])
    assert int(after.prefix_lens[slot]) == 12 == int(after.slot_tokens[slot])
    check_pools(after, [whole], compare_device=True)


def test_a_prefix_on_a_slot_that_holds_nothing() -> None:
    _, pools, _ = _running()
    with raises_exactly("slot 2: cached prefix 4 of 0 tokens is not whole pages of its row"):
        check_pools(_with_prefixes(pools, {2: 4, 3: 8}))


def test_a_prefix_read_from_pages_the_cache_does_not_hold() -> None:
    _, pools, _ = _running()
    empty = attrs.evolve(pools, cache=PrefixCache.empty(4))
    with raises_exactly("page 1 is read as a cached prefix but not cached"):
        check_pools(empty)


def test_a_cached_page_locked_by_rows_that_do_not_read_it() -> None:
    _, pools, _ = _running()
    with raises_exactly("page 1: locked by 1 rows, read by 0"):
        check_pools(_with_prefixes(pools, {}))


def test_a_cached_page_locked_by_more_rows_than_read_it() -> None:
    _, pools, _ = _running()
    with raises_exactly("page 1: locked by 2 rows, read by 1"):
        check_pools(_with_top(pools, locks=2))


def _pages_message(free: int, cached: int, private: int) -> str:
    return (
        f"KV pages: {free} free + {cached} cached + {private} private != 16,"
        " or a page is in two states or none"
    )


def test_a_page_lost() -> None:
    _, pools, _ = _running()
    free = sorted(pools.free_pages.tolist())
    with raises_exactly(_pages_message(11, 3, 1)):
        check_pools(_with_free_pages(pools, free[1:]))


def test_a_page_both_free_and_in_use() -> None:
    _, pools, _ = _running()
    free = pools.free_pages.tolist()
    for page in (1, 5, 7):  # read as a prefix, cached only, private
        with raises_exactly(_pages_message(13, 3, 1)):
            check_pools(_with_free_pages(pools, [*free, page]))


def test_the_padding_page_or_one_past_the_last_handed_out() -> None:
    _, pools, _ = _running()
    free = pools.free_pages.tolist()
    for page in (0, 17):
        with raises_exactly(_pages_message(13, 3, 1)):
            check_pools(_with_free_pages(pools, [*free, page]))


def test_a_slot_both_free_and_owned() -> None:
    _, pools, before = _running()
    both = attrs.evolve(pools, slot_list=before.slot_list)  # slot 3 free again
    with raises_exactly("request slots: 4 free + 1 owned != 4, or a slot is both or neither"):
        check_pools(both)


@pytest.mark.parametrize("lost", [1, 4])
def test_a_slot_neither_free_nor_owned(lost: int) -> None:
    _, pools, _ = _running()
    free = FreeList.of(np.array([slot for slot in (1, 2, 4) if slot != lost], dtype=np.int64))
    with raises_exactly("request slots: 2 free + 1 owned != 4, or a slot is both or neither"):
        check_pools(attrs.evolve(pools, slot_list=free))


def test_the_padding_slot_holding_tokens() -> None:
    _, pools, _ = _running()
    padded = attrs.evolve(pools, slot_tokens=host_int64([4, 0, 0, 11, 0]))
    with raises_exactly("request slots: 3 free + 2 owned != 4, or a slot is both or neither"):
        check_pools(padded)


def test_token_locations_that_do_not_fill_whole_pages() -> None:
    batch, pools, _ = _running()
    assert pools.table.host[3, :11].tolist() == [*range(4, 12), 28, 29, 30]
    pools.table.write(
        Mirrored.from_host(host_int64([3]), CPU),
        Mirrored.from_host(host_int64([9]), CPU),
        Mirrored.from_host(np.array([40], dtype=np.int32), CPU),
    )
    with raises_exactly("slot 3: locations do not fill whole pages"):
        check_pools(pools, [batch])


def test_a_slot_in_two_rows() -> None:
    batch, pools, _ = _running()
    with raises_exactly("slot 3 is in two rows"):
        check_pools(pools, [batch, batch])


def test_a_row_whose_slot_holds_another_count() -> None:
    batch, _, before = _running()
    with raises_exactly("slot 3: row has 11 tokens, the pools hold another count"):
        check_pools(before, [batch])


def test_a_row_whose_slot_the_pools_do_not_have() -> None:
    pools = _shared(max_reqs=8)
    reqs = [Req(rid, (rid,) * 3) for rid in range(5)]
    batch, _ = extend(idle(CPU), reqs, pools).unwrap()
    fifth = filter_batch(batch, [4])
    assert fifth.rows.req_pool_indices.host.tolist() == [5]
    with raises_exactly("slot 5: row has 3 tokens, the pools hold another count"):
        check_pools(_shared(), [fifth])


def test_a_device_table_that_differs_from_the_host_one() -> None:
    batch, pools, _ = _running()
    pools.table.device[3, 20] = 99  # past the row: only the sides differ
    check_pools(pools, [batch])
    with raises_exactly("table: host != device"):
        check_pools(pools, [batch], compare_device=True)


def test_a_row_whose_input_does_not_start_with_its_slots_prefix() -> None:
    batch, pools, _ = _running()
    other, _, _ = _running(tuple(range(50, 58)))
    # The same row under another request (of the same rid): its prefix is not this input.
    swapped = attrs.evolve(batch, rows=attrs.evolve(batch.rows, reqs=other.rows.reqs))
    with raises_exactly("slot 3: its cached prefix is not the start of request 3's input"):
        check_pools(pools, [swapped])


def test_a_prefix_whose_tokens_the_cache_does_not_hold() -> None:
    """Slot 3 reads pages 1 and 2, locked once each, but under other tokens than theirs."""
    _, pools, _ = _running()
    other = attrs.evolve(pools, prefixes=Map({3: (99,) * 8}))
    with raises_exactly("slot 3: its cached prefix is not the cache's pages for its tokens"):
        check_pools(other)


def test_a_row_whose_prefix_the_cache_holds_in_other_pages() -> None:
    """The cache holds tokens 10..17 at pages 2, 1; the row reads them at pages 1, 2.

    Pages, locks and counts are all right: the slot's prefix alone shows it,
    with or without its row.
    """
    batch, pools, _ = _running()
    swapped = _with_tree(_with_top(pools, pages=(2,)), pages=(1,))
    for batches in ([], [batch]):
        with raises_exactly("slot 3: its cached prefix is not the cache's pages for its tokens"):
            check_pools(swapped, batches)


@pytest.mark.parametrize("page", [0, 17])
def test_a_cached_page_outside_the_pools(page: int) -> None:
    _, pools, _ = _running()
    with raises_exactly("the cache holds a KV page outside 1..16"):
        check_pools(_with_top(pools, pages=(page,)))


def _move_page(pools: Pools, position: int, page: int) -> None:
    """Slot 3's page at `position` (a page start) moved to `page`, on both sides."""
    positions = list(range(position, position + 4))
    pools.table.write(
        Mirrored.from_host(host_int64([3] * 4), CPU),
        Mirrored.from_host(host_int64(positions), CPU),
        Mirrored.from_host(np.arange(4 * page, 4 * page + 4, dtype=np.int32), CPU),
    )


@pytest.mark.parametrize("page", [0, 17, -1])
@pytest.mark.parametrize("position", [0, 8])  # its first prefix page, its private page
def test_a_row_reading_a_page_outside_the_pools(position: int, page: int) -> None:
    batch, pools, _ = _running()
    _move_page(pools, position, page)
    with raises_exactly("slot 3: its row reads a KV page outside 1..16"):
        check_pools(pools, [batch])
