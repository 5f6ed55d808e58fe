"""check_pools with the cache on reads again only what changed since it last passed.

What it keeps between checks is about immutable values (tree nodes, prefix
tuples, requests) or is read again each time (the table's page-start cells,
the free lists, the counts), and the table's rows written through its
methods are read again. So a corruption made after a check that passed is
found exactly as on pools never checked: each case here checks the clean
pools first, then the broken ones, and expects the message a fresh check
gives (tests/checks/test_check_shared_pools_messages.py).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import attrs
import numpy as np
import pytest
import torch
from benchmarks.production import run_turn
from benchmarks.production_batchstate import BatchstateProduction
from benchmarks.production_plan import make_production_plan
from immutables import Map

from batchstate import Extended, FreeList, Mirrored, Pools, PrefixCache, check_pools
from batchstate.base.mirrored import host_int64
from tests.checks.test_check_shared_pools_messages import (
    CPU,
    _move_page,
    _running,
    _with_cache,
    _with_prefixes,
    _with_top,
    _with_tree,
)
from tests.strategies import raises_exactly

Break = Callable[[Extended, Pools], tuple[Pools, list[Extended]]]


def _write_cell(pools: Pools, position: int, location: int) -> None:
    pools.table.write(
        Mirrored.from_host(host_int64([3]), CPU),
        Mirrored.from_host(host_int64([position]), CPU),
        Mirrored.from_host(np.array([location], dtype=np.int32), CPU),
    )


def _in_place(change: Callable[[Pools], None]) -> Break:
    def _in_place(batch: Extended, pools: Pools) -> tuple[Pools, list[Extended]]:
        change(pools)  # the table, written: these pools stay broken
        return pools, [batch]

    return _in_place


def _evolved(change: Callable[[Pools], Pools]) -> Break:
    return lambda batch, pools: (change(pools), [batch])


BREAKS: dict[str, tuple[Break, str]] = {
    "a cell in a private page": (
        _in_place(lambda pools: _write_cell(pools, 9, 40)),
        "slot 3: locations do not fill whole pages",
    ),
    "a cell in a prefix page": (
        _in_place(lambda pools: _write_cell(pools, 1, 40)),
        "slot 3: locations do not fill whole pages",
    ),
    "a prefix page moved outside the pools": (
        _in_place(lambda pools: _move_page(pools, 0, 17)),
        "slot 3: its row reads a KV page outside 1..16",
    ),
    "an edge of part of a page": (
        _evolved(lambda pools: _with_top(pools, tokens=tuple(range(10, 16)))),
        "cache node at 6 tokens: edge of 6 tokens, 1 pages",
    ),
    "a node keyed by other tokens": (
        _evolved(lambda pools: _with_tree(pools, tokens=(15, 14, 16, 17))),
        "a cache node is keyed by other tokens",
    ),
    "a node locked more than its parent": (
        _evolved(lambda pools: _with_tree(pools, locks=2)),
        "a cache node is locked more than its parent",
    ),
    "a node with negative locks": (
        _evolved(lambda pools: _with_tree(pools, locks=-1)),
        "a cache node has negative locks",
    ),
    "counts other than the tree's": (
        _evolved(lambda pools: _with_cache(pools, num_pages=4)),
        "cache counts 4 pages (2 locked), the tree holds 3 (2)",
    ),
    "an index of leaves other than the tree's": (
        _evolved(lambda pools: _with_cache(pools, leaves={})),
        "the cache's index of unlocked leaves (what eviction pops) differs from its tree",
    ),
    "a leaf's last use other than the tree's": (
        _evolved(
            lambda pools: _with_cache(
                pools, leaves={key: used + 1 for key, used in pools.cache.leaves.items()}
            )
        ),
        "the cache's index of unlocked leaves (what eviction pops) differs from its tree",
    ),
    "a cached page outside the pools": (
        _evolved(lambda pools: _with_top(pools, pages=(17,))),
        "the cache holds a KV page outside 1..16",
    ),
    "pages swapped in the tree": (
        _evolved(lambda pools: _with_tree(_with_top(pools, pages=(2,)), pages=(1,))),
        "slot 3: its cached prefix is not the cache's pages for its tokens",
    ),
    "a prefix of other tokens": (
        _evolved(lambda pools: attrs.evolve(pools, prefixes=Map({3: (99,) * 8}))),
        "slot 3: its cached prefix is not the cache's pages for its tokens",
    ),
    "a prefix of part of a page": (
        _evolved(lambda pools: _with_prefixes(pools, {3: 6})),
        "slot 3: cached prefix 6 of 11 tokens is not whole pages of its row",
    ),
    "a page lost from the free list": (
        _evolved(
            lambda pools: attrs.evolve(
                pools, page_list=FreeList.of(np.sort(pools.free_pages)[1:].copy())
            )
        ),
        "KV pages: 11 free + 3 cached + 1 private != 16, or a page is in two states or none",
    ),
    "a cache emptied": (
        _evolved(lambda pools: attrs.evolve(pools, cache=PrefixCache.empty(4))),
        "page 1 is read as a cached prefix but not cached",
    ),
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_a_corruption_after_a_passing_check_is_found(name: str) -> None:
    brk, message = BREAKS[name]
    batch, pools, _ = _running()
    check_pools(pools, [batch])
    check_pools(pools, [batch])  # the second reads only what changed: nothing
    broken, batches = brk(batch, pools)
    with raises_exactly(message):
        check_pools(broken, batches)
    fresh, fresh_batches = brk(*_running()[:2])
    with raises_exactly(message):  # the same as on pools never checked
        check_pools(fresh, fresh_batches)


def test_a_row_whose_input_changed_after_a_passing_check_is_found() -> None:
    batch, pools, _ = _running()
    other, _, _ = _running(tuple(range(50, 58)))
    check_pools(pools, [batch])
    swapped = attrs.evolve(batch, rows=attrs.evolve(batch.rows, reqs=other.rows.reqs))
    with raises_exactly("slot 3: its cached prefix is not the start of request 3's input"):
        check_pools(pools, [swapped])


def test_the_clean_pools_pass_again_after_a_failed_check() -> None:
    """A check that fails midway (the tree half read) leaves nothing behind that lies."""
    batch, pools, _ = _running()
    check_pools(pools, [batch])
    for brk, message in BREAKS.values():
        if brk.__name__ == _in_place.__name__:  # see below: the pools would stay broken
            continue
        broken, batches = brk(batch, pools)
        with raises_exactly(message):
            check_pools(broken, batches)
        check_pools(pools, [batch], compare_device=True)


def test_a_write_around_the_tables_methods_is_found_by_comparing_the_device() -> None:
    """`torch.from_numpy` of the read-only host side writes it anyway (numpy warns).

    The per-step check reads again the rows the table's methods wrote; a write
    around them is found by `compare_device=True`, which reads every row.
    """
    batch, pools, _ = _running()
    check_pools(pools, [batch])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.from_numpy(pools.table.host)[3, 9] = 40
    with raises_exactly("slot 3: locations do not fill whole pages"):
        check_pools(pools, [batch], compare_device=True)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_checked_production_run_agrees_with_fresh_checks_and_finds_a_late_corruption(
    page_size: int,
) -> None:
    """The production step (cache, chunks, overlap), checked after every step.

    A deep copy is its own lineage, with nothing kept: a full check. Both
    pass at every step; a cell broken at the end is found.
    """
    plan = make_production_plan(8, page_size, 24)
    impl = BatchstateProduction(plan)
    for turn in plan.turns:
        run_turn(impl, turn)
        check_pools(impl.pools, [impl.running])
        pools, running = copy.deepcopy((impl.pools, impl.running))
        check_pools(pools, [running])
    rows = impl.running.rows
    slot, length = int(rows.req_pool_indices.host[0]), int(rows.seq_lens.host[0])
    if page_size == 1:  # one-token pages always fill whole pages: give it another's
        other = int(rows.req_pool_indices.host[1])
        location = int(impl.pools.table.host[other, 0])
        message = "KV pages"
    else:
        location = int(impl.pools.table.host[slot, length - 1]) + 1
        message = f"slot {slot}: locations do not fill whole pages"
    impl.pools.table.write(
        Mirrored.from_host(host_int64([slot]), CPU),
        Mirrored.from_host(host_int64([length - 1]), CPU),
        Mirrored.from_host(np.array([location], dtype=np.int32), CPU),
    )
    with pytest.raises(Exception, match=message):
        check_pools(impl.pools, [impl.running])
