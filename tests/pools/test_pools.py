"""Pools as values: allocation counts pages on the host, and failures change nothing."""

from __future__ import annotations

import numpy as np
import pytest
from returns.result import Failure

from batchstate import (
    Mirrored,
    NotOwned,
    OutOfKVTokens,
    OutOfReqSlots,
    Pools,
    check_pools,
    make_pools,
)
from batchstate.base.mirrored import HostArray, host_int64
from tests.builders import CPU
from tests.strategies import assert_unchanged, snapshot


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_reqs": 0}, "max_reqs must be >= 1"),
        ({"max_context_len": 0}, "max_context_len must be >= 1"),
        ({"page_size": 0}, "page_size must be >= 1"),
        ({"num_kv_tokens": -16}, "non-negative multiple"),
        ({"num_kv_tokens": 20}, "multiple of page_size=16"),  # a partial page cannot be handed out
    ],
)
def test_make_pools_rejects_bad_sizes(kwargs: dict[str, int], message: str) -> None:
    """Sizes that cannot make a working pool raise ValueError naming the size."""
    sizes = {"max_reqs": 4, "max_context_len": 32, "num_kv_tokens": 64, "page_size": 16} | kwargs
    with pytest.raises(ValueError, match=message):
        make_pools(
            sizes["max_reqs"],
            sizes["max_context_len"],
            sizes["num_kv_tokens"],
            CPU,
            sizes["page_size"],
        )


def test_out_of_slots_is_a_failure_and_changes_nothing() -> None:
    """Asking for more slots than are free returns the numbers and keeps the pools."""
    pools = make_pools(2, 8, 16, CPU)
    before = snapshot(pools)
    assert pools.allocate_slots(3) == Failure(OutOfReqSlots(3, 2))
    assert_unchanged(before, pools)


@pytest.mark.parametrize(
    ("page_size", "old", "new", "pages"),
    [
        (1, [0, 0], [5, 3], 8),  # a page per token
        (16, [0, 0], [16, 17], 3),  # 17 tokens straddle two pages
        (16, [16, 5], [17, 16], 1),  # only the row crossing a boundary takes a page
        (4, [3], [4], 0),  # filling the last slot of a page takes none
    ],
)
def test_pages_are_counted_from_host_lengths(
    page_size: int, old: list[int], new: list[int], pages: int
) -> None:
    """A row takes a new page exactly where a position starts one."""
    pools = make_pools(4, 64, 256, CPU, page_size)
    slots, pools = pools.allocate_slots(len(old)).unwrap()
    if any(old):
        first = pools.allocate_tokens(slots, host_int64([0] * len(old)), host_int64(old)).unwrap()
        _write(first.pools, slots, [0] * len(old), old, first.locs)
        pools = first.pools
    free_before = pools.free_pages.shape[0]
    allocation = pools.allocate_tokens(slots, host_int64(old), host_int64(new)).unwrap()
    assert free_before - allocation.pools.free_pages.shape[0] == pages
    assert allocation.locs.shape[0] == sum(new) - sum(old)


def test_out_of_kv_tokens_is_a_failure_and_changes_nothing() -> None:
    """A request larger than the free pages fails with the page counts."""
    pools = make_pools(4, 64, 32, CPU, page_size=16)
    slots, pools = pools.allocate_slots(1).unwrap()
    before = snapshot(pools)
    result = pools.allocate_tokens(slots, host_int64([0]), host_int64([33]))
    assert result == Failure(OutOfKVTokens(3, 2, 16))
    assert_unchanged(before, pools)


@pytest.mark.parametrize(
    ("slots", "offending"),
    [
        ([1, 1], (1, 1)),  # the same slot twice in one call
        ([3], (3,)),  # a slot never allocated
        ([0], (0,)),  # the padding row
        ([-1], (-1,)),  # negative: must not wrap around to the last slot
        ([99], (99,)),  # past the table
    ],
)
def test_freeing_what_is_not_owned_is_a_failure(
    slots: list[int], offending: tuple[int, ...]
) -> None:
    """Double frees and foreign slots are NotOwned, and the pools stay as they were."""
    pools = make_pools(4, 16, 64, CPU)
    owned, pools = pools.allocate_slots(2).unwrap()
    pools = pools.allocate_tokens(owned, host_int64([0, 0]), host_int64([2, 2])).unwrap().pools
    before = snapshot(pools)
    assert pools.free(host_int64(slots)) == Failure(NotOwned(offending))
    assert_unchanged(before, pools)


def test_free_returns_every_page_and_conserves_capacity() -> None:
    """After allocating and freeing, free + owned = capacity and everything is free again."""
    pools = make_pools(4, 64, 128, CPU, page_size=16)
    slots, pools = pools.allocate_slots(3).unwrap()
    allocation = pools.allocate_tokens(slots, host_int64([0, 0, 0]), host_int64([5, 16, 40]))
    pools = allocation.unwrap().pools
    _write(pools, slots, [0, 0, 0], [5, 16, 40], allocation.unwrap().locs)
    check_pools(pools)
    assert pools.free_pages.shape[0] == 8 - (1 + 1 + 3)
    pools = pools.free(slots).unwrap()
    check_pools(pools)
    assert pools.num_free_slots == 4
    assert pools.free_pages.shape[0] == 8


def _write(pools: Pools, slots: HostArray, old: list[int], new: list[int], locs: HostArray) -> None:
    # What a transition does after allocating: record the locations in the table.
    rows = np.repeat(slots, [n - o for o, n in zip(old, new, strict=True)])
    columns = np.concatenate([np.arange(o, n) for o, n in zip(old, new, strict=True)])
    pools.table.write(
        Mirrored.from_host(rows, CPU),
        Mirrored.from_host(columns, CPU),
        Mirrored.from_host(locs.astype(np.int32), CPU),
    )
