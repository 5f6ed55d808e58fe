"""Decode: where the new token lands, and records or pools out of step with each other."""

from __future__ import annotations

import copy

import pytest

from batchstate import StaleRecord, decode, release, split
from tests.builders import make_extended, make_test_pools
from tests.strategies import assert_unchanged, snapshot


@pytest.mark.parametrize("page_size", [1, 4])
def test_new_token_continues_its_page(page_size: int) -> None:
    """Each row's new location follows its previous one inside a page, or opens a new page."""
    pools = make_test_pools(page_size)
    extended, pools = make_extended(pools, [3, 4])
    decoded, pools = decode(extended, pools).unwrap()
    table = pools.table.host
    locs = decoded.out_cache_loc.device.tolist()
    assert locs == [int(table[1, 3]), int(table[2, 4])]
    if page_size == 4:
        assert locs[0] == int(table[1, 2]) + 1  # position 3: the same page as position 2
        assert locs[1] % 4 == 0  # position 4 opens a page
        assert locs[1] // 4 != int(table[2, 3]) // 4


def test_decode_with_pools_from_before_the_last_step_is_stale() -> None:
    """Pools that missed a step disagree with the batch's lengths: StaleRecord, nothing changed."""
    pools = make_test_pools()
    extended, pools = make_extended(pools, [3, 5])
    before = copy.deepcopy(pools)  # pools are linear: the step-behind pools are a copy
    decoded, _after = decode(extended, pools).unwrap()
    state = snapshot((decoded, before))
    with pytest.raises(StaleRecord, match=r"row 0 \(request 0\) has 4 tokens in slot 1"):
        decode(decoded, before)
    assert_unchanged(state, (decoded, before), "batch and pools after the refusal")


def test_decode_after_release_is_stale() -> None:
    """A batch whose rows were released owns nothing: decoding it would double-allocate."""
    pools = make_test_pools()
    extended, pools = make_extended(pools, [3, 5])
    kept, left = split(extended, [])
    pools = release(left, kept, pools).unwrap()
    with pytest.raises(StaleRecord, match="the pools hold 0"):
        decode(extended, pools)
