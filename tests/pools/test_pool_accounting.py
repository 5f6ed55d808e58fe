"""The pools' public allocation calls, their failures, their bounds and how pools print."""

from __future__ import annotations

import re
from typing import Final

import numpy as np
import pytest
import torch
from returns.result import Failure

from batchstate import (
    OutOfKVTokens,
    Pools,
    Req,
    Rows,
    check_pools,
    extend,
    filter_batch,
    idle,
    make_pools,
    release,
    split,
)
from batchstate.base.mirrored import HostArray, host_int64
from batchstate.columns.columns import NO_COLUMNS

CPU: Final = torch.device("cpu")


def _two_slots(num_kv_tokens: int = 64, context: int = 32) -> tuple[HostArray, Pools]:
    pools = make_pools(4, context, num_kv_tokens, CPU, page_size=4)
    slots, pools = pools.allocate_slots(2).unwrap()
    assert slots.tolist() == [1, 2]
    return slots, pools


def test_allocate_fresh_lays_out_whole_pages_per_row() -> None:
    slots, pools = _two_slots()
    allocation = pools.allocate_fresh(slots, [3, 5]).unwrap()
    assert allocation.locs.tolist() == [4, 5, 6, 8, 9, 10, 11, 12]
    assert allocation.pools.slot_tokens.tolist() == [0, 3, 5, 0, 0]
    assert allocation.pools.free_pages.tolist() == list(range(4, 17))
    assert pools.free_pages.tolist() == list(range(1, 17))  # the input is unchanged


def test_allocate_fresh_past_the_free_pages_is_a_failure() -> None:
    slots, pools = _two_slots(context=64)
    result = pools.allocate_fresh(slots, [40, 40])
    assert result == Failure(OutOfKVTokens(20, 16, 4))


def test_allocate_next_opens_a_page_where_a_position_starts_one() -> None:
    slots, pools = _two_slots()
    fresh = pools.allocate_fresh(slots, [4, 8]).unwrap()
    allocation = fresh.pools.allocate_next(slots, host_int64([5, 9])).unwrap()
    assert allocation.locs.tolist() == [16, 20]  # pages 4 and 5, first token of each
    assert allocation.pools.slot_tokens.tolist() == [0, 5, 9, 0, 0]
    assert allocation.pools.free_pages.tolist() == list(range(6, 17))


def test_allocate_next_with_no_free_page_is_a_failure() -> None:
    slots, pools = _two_slots(num_kv_tokens=12)
    fresh = pools.allocate_fresh(slots, [4, 8]).unwrap()
    assert fresh.pools.allocate_next(slots, host_int64([5, 9])) == Failure(OutOfKVTokens(2, 0, 4))


def test_shrink_keeps_at_least_one_token() -> None:
    slots, pools = _two_slots()
    fresh = pools.allocate_fresh(slots, [6, 8]).unwrap().pools
    with pytest.raises(
        ValueError,
        match=re.escape(
            "slot 1 owns 6 tokens (1 of them needed: its cached prefix, or one), cannot shrink to 0"
        ),
    ):
        fresh.shrink(slots, host_int64([0, 8]))
    shrunk = fresh.shrink(slots, host_int64([1, 8])).unwrap()
    assert shrunk.slot_tokens.tolist() == [0, 1, 8, 0, 0]
    assert len(shrunk.free_pages) == len(fresh.free_pages) + 1  # slot 1's second page


def test_shrink_keeps_a_cached_prefix_and_names_it() -> None:
    """Slot 2 (slot 1 went to the back when freed) reads 8 cached tokens and owns 11."""
    pools = make_pools(4, 32, 64, CPU, page_size=4, prefix_cache=True)
    first, pools = extend(idle(CPU), [Req(1, (1,) * 8 + (2,))], pools).unwrap()
    pools = release(first, idle(CPU), pools).unwrap()
    batch, pools = extend(idle(CPU), [Req(2, (1,) * 8 + (3, 4, 5))], pools).unwrap()
    slots = batch.rows.req_pool_indices.host
    assert (batch.prefix_lens.tolist(), pools.prefix_lens.tolist()) == ([8], [0, 0, 8, 0, 0])
    with pytest.raises(ValueError, match=re.escape("slot 2 owns 11 tokens (8 of them needed")):
        pools.shrink(slots, host_int64([7]))
    shrunk = pools.shrink(slots, host_int64([8])).unwrap()
    assert shrunk.slot_tokens.tolist() == [0, 0, 8, 0, 0]
    assert len(shrunk.free_pages) == len(pools.free_pages) + 1  # the private third page
    assert shrunk.cache is pools.cache and shrunk.prefixes == pools.prefixes
    check_pools(shrunk)


def test_pools_print_their_counts_and_never_the_table() -> None:
    pools = make_pools(4, 32, 64, CPU, page_size=16)
    slots, pools = pools.allocate_slots(1).unwrap()
    pools = pools.allocate_fresh(slots, [20]).unwrap().pools
    assert repr(pools) == (
        "Pools(free_slots=3/4, free_pages=2/4, page_size=16,"
        " table=TokenTable(shape=(5, 32), dtype=torch.int32, device=cpu))"
    )
    shared = make_pools(4, 32, 64, CPU, page_size=16, prefix_cache=True)
    _, shared = extend(idle(CPU), [Req(1, tuple(range(20)))], shared).unwrap()
    assert repr(shared) == (
        "Pools(free_slots=3/4, free_pages=2/4, cached_pages=1 (1 in use), page_size=16,"
        " table=TokenTable(shape=(5, 32), dtype=torch.int32, device=cpu))"
    )


def test_rows_from_no_requests_have_no_longest_row() -> None:
    rows = Rows.from_host(CPU, [], [], [], NO_COLUMNS)
    assert (len(rows), rows.seq_lens_sum, rows.max_seq_len) == (0, 0, 0)
    one = Rows.from_host(CPU, [Req(7, (1, 2))], [3], [2], NO_COLUMNS)
    assert (one.seq_lens_sum, one.max_seq_len) == (2, 2)
    assert one.rids.tolist() == [7]
    assert np.array_equal(one.req_pool_indices.host, [3])


@pytest.mark.parametrize("page_size", [2, 3])
def test_freeing_gives_back_the_pages_not_their_token_locations(page_size: int) -> None:
    pools = make_pools(4, 32, 12 * page_size, CPU, page_size=page_size)
    batch, after = extend(idle(CPU), [Req(0, (1,) * 5), Req(1, (2,) * 2)], pools).unwrap()
    _, left = split(batch, [])
    freed = release(left, filter_batch(batch, []), after).unwrap()
    assert sorted(freed.free_pages.tolist()) == list(range(1, 13))
    assert freed.slot_tokens.tolist() == [0] * 5


def test_allocate_next_with_pages_of_one_token_is_an_allocation() -> None:
    slots, pools = make_pools(4, 32, 8, CPU).allocate_slots(2).unwrap()
    fresh = pools.allocate_fresh(slots, [2, 1]).unwrap()
    allocation = fresh.pools.allocate_next(slots, host_int64([3, 2])).unwrap()
    assert allocation.locs.tolist() == [4, 5]
    assert allocation.pools.slot_tokens.tolist() == [0, 3, 2, 0, 0]


def test_free_refuses_lengths_that_do_not_match_the_slots_one_for_one() -> None:
    slots, pools = _two_slots()
    owned = pools.allocate_fresh(slots, [3, 5]).unwrap().pools
    with pytest.raises(ValueError):  # not a partial free of the first slots
        owned.free(slots, host_int64([3]))
