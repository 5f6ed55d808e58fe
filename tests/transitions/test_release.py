"""Release: the memory of rows that left comes back once, and only theirs."""

from __future__ import annotations

from returns.result import Failure

from batchstate import NotOwned, check_pools, decode, release, split
from tests.builders import make_extended, make_test_pools
from tests.strategies import assert_unchanged, snapshot


def test_split_then_release_frees_exactly_the_rows_that_left() -> None:
    """After release the slot and its pages are free, and the kept rows still own theirs."""
    pools = make_test_pools(page_size=4)
    extended, pools = make_extended(pools, [3, 9, 5])
    free_pages = pools.free_pages.shape[0]
    kept, left = split(extended, [0, 2])
    assert [req.rid for req in left.reqs] == [1]
    assert left.seq_lens.tolist() == [9]
    pools = release(left, kept, pools).unwrap()
    assert pools.free_pages.shape[0] == free_pages + 3  # 9 tokens in pages of 4
    check_pools(pools, [kept], compare_device=True)


def test_release_of_a_stale_record_is_refused() -> None:
    """Rows from before a decode hold fewer tokens than their slots now do: NotOwned, no change."""
    pools = make_test_pools()
    extended, pools = make_extended(pools, [3, 5])
    _, stale_left = split(extended, [1])  # row 0 as it was before the decode
    decoded, pools = decode(extended, pools).unwrap()
    kept, _ = split(decoded, [1])
    state = snapshot(pools)
    assert release(stale_left, kept, pools) == Failure(NotOwned((1,)))
    assert_unchanged(state, pools, "pools after the refusal")
