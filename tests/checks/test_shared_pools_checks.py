"""Pools with the cache on, changed by hand or released into by a stale record: named refusals.

`Pools` has no construction-time checks: a cache or prefixes put in by hand
are accepted, and `check_pools` names what no longer agrees.
"""

from __future__ import annotations

import re

import attrs
import pytest
from immutables import Map
from returns.result import Failure

from batchstate import (
    Departed,
    InvariantViolation,
    NotOwned,
    Pools,
    Req,
    check_pools,
    extend,
    idle,
    release,
)
from batchstate.base.mirrored import host_int64
from tests.builders import CPU, make_test_pools


def _violation(message: str) -> pytest.RaisesExc[InvariantViolation]:
    return pytest.raises(InvariantViolation, match=f"^{re.escape(message)}$")


def _reading() -> Pools:
    """Slot 1 holds 9 tokens and reads its first 8 (two pages of 4) from the cache."""
    pools = make_test_pools(4, max_reqs=4, prefix_cache=True)
    _, pools = extend(idle(CPU), [Req(1, tuple(range(9)))], pools).unwrap()
    assert dict(pools.prefixes) == {1: tuple(range(8))}
    return pools


def test_a_cache_of_another_page_size_is_caught() -> None:
    pools = _reading()
    with _violation("the cache has pages of 16, the pools of 4"):
        check_pools(attrs.evolve(pools, cache=attrs.evolve(pools.cache, page_size=16)))


def test_an_empty_cache_in_place_of_the_one_read_is_caught() -> None:
    pools = _reading()
    empty = attrs.evolve(pools, cache=type(pools.cache).empty(4))
    with _violation("page 1 is read as a cached prefix but not cached"):
        check_pools(empty)


def test_prefix_lens_are_derived_from_the_prefixes_and_read_only() -> None:
    pools = _reading()
    lens = pools.prefix_lens
    assert lens.tolist() == [0, 8, 0, 0, 0] and not lens.flags.writeable
    moved = attrs.evolve(pools, prefixes=Map({2: tuple(range(4))}))
    assert moved.prefix_lens.tolist() == [0, 0, 4, 0, 0]
    with _violation("slot 2: cached prefix 4 of 0 tokens is not whole pages of its row"):
        check_pools(moved)


@pytest.mark.parametrize("slot", [9, -1])
def test_a_prefix_for_a_slot_past_the_pools_is_caught(slot: int) -> None:
    pools = _reading()
    outside = attrs.evolve(pools, prefixes=Map({slot: tuple(range(8))}))
    with pytest.raises(InvariantViolation, match=rf"outside 1\.\.\d+: \[{slot}\]"):
        check_pools(outside)


def test_a_departed_whose_length_is_stale_is_not_owned() -> None:
    """The slot holds 9 tokens; a record saying 8 is from another step."""
    batch, pools = extend(
        idle(CPU), [Req(1, tuple(range(9)))], make_test_pools(4, prefix_cache=True)
    ).unwrap()
    stale = Departed(batch.rows.reqs, host_int64([1]), host_int64([8]), gens=batch.rows.gens)
    assert release(stale, idle(CPU), pools) == Failure(NotOwned((1,)))
