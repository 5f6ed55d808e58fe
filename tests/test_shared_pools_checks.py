"""CachedPools built or changed by hand, and a stale record released into them: named refusals."""

from __future__ import annotations

import re

import attrs
import pytest
from returns.result import Failure

from batchstate import (
    BatchConflict,
    Departed,
    NotOwned,
    Req,
    cached_pools,
    extend_cached,
    idle,
    release_cached,
)
from batchstate._mirrored import host_int64
from tests.builders import CPU, make_test_pools


def _refused(message: str) -> pytest.RaisesExc[BatchConflict]:
    return pytest.raises(BatchConflict, match=f"^{re.escape(message)}$")


def test_a_cache_from_other_pools_is_refused() -> None:
    pools, other = cached_pools(make_test_pools(4)), cached_pools(make_test_pools(4))
    with _refused("the prefix cache belongs to other pools (another token table)"):
        attrs.evolve(pools, cache=other.cache)


def test_prefix_lens_for_another_number_of_slots_is_refused() -> None:
    pools = cached_pools(make_test_pools(4))
    with _refused("prefix_lens has 2 slots, the pools 17"):
        attrs.evolve(pools, prefix_lens=host_int64([0, 0]))


def test_a_departed_whose_length_is_stale_is_not_owned() -> None:
    """The slot holds 9 tokens; a record saying 8 is from another step."""
    batch, pools = extend_cached(
        idle(CPU), [Req(1, tuple(range(9)))], cached_pools(make_test_pools(4))
    ).unwrap()
    stale = Departed(batch.rows.reqs, host_int64([1]), host_int64([8]))
    assert release_cached(stale, idle(CPU), pools) == Failure(NotOwned((1,)))


def test_a_cache_of_another_page_size_is_refused() -> None:
    pools = cached_pools(make_test_pools(4))
    with _refused("the prefix cache has pages of 16, the pools of 4"):
        attrs.evolve(pools, cache=attrs.evolve(pools.cache, page_size=16))
