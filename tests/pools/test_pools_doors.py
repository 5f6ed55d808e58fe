"""`Pools`' public allocate and free methods refuse arguments that would hand out live memory.

Each call below once succeeded and moved a free list back over pages a live
row still used, or handed a running request's slot to the next extend. Now
each raises `PoolsArgumentError` naming the argument, and the pools handed in
stay unchanged and newest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import numpy as np
import pytest
import torch

from batchstate import Pools, PoolsArgumentError, Req, check_pools, extend, idle, make_pools
from batchstate.base.mirrored import host_int64
from tests.strategies import assert_unchanged, snapshot

CPU: Final = torch.device("cpu")


def _live(page_size: int = 1, prefix_cache: bool = False) -> Pools:
    """Pools where slot 1 holds 3 tokens and slot 2 holds 5, for two live rows."""
    pools = make_pools(4, 32, 64, CPU, page_size, prefix_cache=prefix_cache)
    _, pools = extend(idle(CPU), [Req(0, (1, 2, 3)), Req(1, (4, 5, 6, 7, 8))], pools).unwrap()
    return pools


def _i(*values: int) -> np.ndarray:
    return host_int64(list(values))


MISUSE: Final[dict[str, tuple[Callable[[Pools], object], str]]] = {
    # The free list moved back over slot 1's pages: the next extend wrote into them.
    "tokens-shrinking-a-live-slot": (
        lambda p: p.allocate_tokens(_i(1), _i(3), _i(0)),
        r"slot 1 would go from 3 to 0 tokens",
    ),
    "tokens-from-the-wrong-length": (
        lambda p: p.allocate_tokens(_i(1), _i(0), _i(4)),
        r"slot 1 owns 3 tokens, old_lens says 0",
    ),
    "tokens-for-a-free-slot": (
        lambda p: p.allocate_tokens(_i(3), _i(0), _i(4)),
        r"slots \[3\] are free",
    ),
    "tokens-for-the-padding-slot": (
        lambda p: p.allocate_tokens(_i(0), _i(0), _i(4)),
        r"slots \[0\] are out of range: request slots are 1..4",
    ),
    "tokens-negative-slot": (
        lambda p: p.allocate_tokens(_i(-1), _i(0), _i(4)),
        r"slots \[-1\] are out of range",
    ),
    "tokens-past-the-table": (
        lambda p: p.allocate_tokens(_i(1), _i(3), _i(33)),
        r"would own 33 tokens, the table holds 32",
    ),
    "tokens-slot-twice": (
        lambda p: p.allocate_tokens(_i(1, 1), _i(3, 3), _i(4, 4)),
        r"slots \[1, 1\] repeat a slot",
    ),
    "tokens-int32-slots": (
        lambda p: p.allocate_tokens(np.array([1], dtype=np.int32), _i(3), _i(4)),
        r"slots must be a 1-D int64 numpy array, got int32 \[1\]",
    ),
    "tokens-list-lens": (
        lambda p: p.allocate_tokens(_i(1), [3], _i(4)),  # type: ignore[arg-type]  # on purpose
        r"old_lens must be a 1-D int64 numpy array, got list",
    ),
    "tokens-short-lens": (
        lambda p: p.allocate_tokens(_i(1, 2), _i(3, 5), _i(4)),
        r"new_lens has 1 values, slots has 2",
    ),
    # A running request's slot went to the next extend, which overwrote its table row.
    "slots-negative": (lambda p: p.allocate_slots(-1), r"num_slots must be >= 0, got -1"),
    "slots-float": (
        lambda p: p.allocate_slots(1.5),  # type: ignore[arg-type]  # on purpose
        r"num_slots must be an integer, got float",
    ),
    "slots-bool": (lambda p: p.allocate_slots(True), r"got a bool"),
    "fresh-negative-length": (
        lambda p: p.allocate_fresh(_i(1), [-4]),
        r"slot 1 owns 3 tokens, a fresh slot's length says 0",
    ),
    "fresh-on-a-live-slot": (
        lambda p: p.allocate_fresh(_i(2), [2]),
        r"slot 2 owns 5 tokens",
    ),
    "fresh-float-length": (
        lambda p: p.allocate_fresh(_i(1), [2.5]),  # type: ignore[list-item]  # on purpose
        r"seq_lens must be ints, got float",
    ),
    "fresh-huge-length": (
        lambda p: p.allocate_fresh(_i(1), [2**70]),
        r"seq_lens must fit in int64",
    ),
    "next-at-a-wrong-length": (
        lambda p: p.allocate_next(_i(1), _i(2)),
        r"slot 1 owns 3 tokens, new_lens - 1 says 1",
    ),
    "next-skipping-ahead": (
        lambda p: p.allocate_next(_i(1, 2), _i(4, 9)),
        r"slot 2 owns 5 tokens, new_lens - 1 says 8",
    ),
    "free-int32-slots": (
        lambda p: p.free(np.array([1], dtype=np.int32)),
        r"slots must be a 1-D int64 numpy array, got int32",
    ),
    "free-short-gens": (
        lambda p: p.free(_i(1, 2), gens=_i(1)),
        r"gens has 1 values, slots has 2",
    ),
    "free-tokens-not-per-slot": (
        lambda p: p.free(_i(1, 2), tokens=[(1, 2, 3)]),
        r"tokens must be a sequence of one token sequence per slot \(2\)",
    ),
    "shrink-2d-lens": (
        lambda p: p.shrink(_i(1), np.array([[1]], dtype=np.int64)),
        r"new_lens must be a 1-D int64 numpy array, got int64 \[1, 1\]",
    ),
    "shrink-below-one": (
        lambda p: p.shrink(_i(1), _i(0)),
        r"slot 1 owns 3 tokens .* cannot shrink to 0",
    ),
}


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["cache-off", "cache-on"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", MISUSE.values(), ids=MISUSE.keys())
def test_a_public_pools_method_refuses_misuse_and_changes_nothing(
    case: tuple[Callable[[Pools], object], str], page_size: int, prefix_cache: bool
) -> None:
    call, message = case
    pools = _live(page_size, prefix_cache)
    before = snapshot(pools)
    with pytest.raises(PoolsArgumentError, match=message):
        call(pools)
    assert_unchanged(before, pools)
    assert pools.is_newest
    check_pools(pools, compare_device=True)


def test_the_next_extend_after_a_refused_allocation_writes_no_live_row() -> None:
    """The reproduction end to end: the refusal leaves slot 1's pages to slot 1."""
    pools = _live(page_size=1)
    row_one = pools.table.host[1, :3].copy()
    with pytest.raises(PoolsArgumentError):
        pools.allocate_tokens(_i(1), _i(3), _i(0))
    batch, pools = extend(idle(CPU), [Req(9, (1, 2, 3, 4))], pools).unwrap()
    assert not np.isin(batch.out_cache_loc.device.numpy(), row_one).any()
    assert pools.table.host[1, :3].tolist() == row_one.tolist()


def test_legal_calls_through_the_doors_still_allocate() -> None:
    pools = make_pools(4, 32, 64, CPU, page_size=4)
    slots, pools = pools.allocate_slots(2).unwrap()
    pools = pools.allocate_fresh(slots, [3, 5]).unwrap().pools
    pools = pools.allocate_next(slots, _i(4, 6)).unwrap().pools
    pools = pools.allocate_tokens(slots, _i(4, 6), _i(9, 6)).unwrap().pools
    assert pools.slot_tokens.tolist() == [0, 9, 6, 0, 0]
    pools = pools.shrink(slots, _i(5, 6)).unwrap()
    pools = pools.free(slots, _i(5, 6)).unwrap()
    assert pools.num_free_slots == 4 and pools.num_free_tokens == 64
