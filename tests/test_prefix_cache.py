"""The prefix cache's values and hostile inputs: typed errors, nothing changed."""

from __future__ import annotations

import attrs
import pytest
from returns.result import Failure

from batchstate import (
    BatchConflict,
    EmptyPrompt,
    NotOwned,
    OutOfKVTokens,
    Req,
    StillRunning,
    cached_pools,
    check_cached_pools,
    extend_cached,
    idle,
    release_cached,
    split,
)
from tests.builders import CPU, make_test_pools

HEADER = tuple(range(10, 30))  # 20 tokens


def test_a_released_prefix_is_read_by_the_next_request_and_persistence_holds() -> None:
    pools = cached_pools(make_test_pools(4))
    first, pools = extend_cached(idle(CPU), [Req(1, (*HEADER, 1))], pools).unwrap()
    cached = release_cached(first, idle(CPU), pools).unwrap()
    assert cached.cache.num_tokens == 20 and pools.cache.num_tokens == 0  # the old value stands
    second, after = extend_cached(idle(CPU), [Req(2, (*HEADER, 2, 3))], cached).unwrap()
    assert second.prefix_lens == (20,) and second.extend_lens == (2,)
    assert after.cache.num_locked == 5 and cached.cache.num_locked == 0
    check_cached_pools(after, [second], compare_device=True)


def test_a_page_size_that_does_not_divide_the_prefix_caches_whole_pages_only() -> None:
    pools = cached_pools(make_test_pools(16))
    first, pools = extend_cached(idle(CPU), [Req(1, HEADER)], pools).unwrap()
    pools = release_cached(first, idle(CPU), pools).unwrap()
    assert list(pools.cache.entries()) == [HEADER[:16]]  # the partial page was freed
    batch, pools = extend_cached(idle(CPU), [Req(2, HEADER[:16])], pools).unwrap()
    assert batch.prefix_lens == (0,)  # a whole cached prompt still computes its last page
    check_cached_pools(pools, [batch])


def test_eviction_takes_the_least_recently_used_leaf_and_never_a_page_in_use() -> None:
    pools = cached_pools(make_test_pools(4, num_kv_tokens=48))  # 12 pages
    for rid, head in ((1, (1,) * 8), (2, (2,) * 8), (3, (3,) * 8)):
        batch, pools = extend_cached(idle(CPU), [Req(rid, (*head, 9))], pools).unwrap()
        pools = release_cached(batch, idle(CPU), pools).unwrap()
    reader, pools = extend_cached(idle(CPU), [Req(4, ((1,) * 8) + (5,))], pools).unwrap()
    assert reader.prefix_lens == (8,)
    # 12 pages: 6 cached (2 of them read by request 4), 1 private, 5 free; ask for 7.
    big, after = extend_cached(idle(CPU), [Req(5, (7,) * 28)], pools).unwrap()
    assert set(after.cache.entries()) == {(1,) * 4, (1,) * 8, (3,) * 4, (3,) * 8}
    check_cached_pools(after, [reader, big])
    result = extend_cached(idle(CPU), [Req(6, (8,) * 64)], after)
    assert isinstance(result, Failure) and isinstance(result.failure(), OutOfKVTokens)


def test_releasing_twice_or_while_running_fails_and_changes_nothing() -> None:
    pools = cached_pools(make_test_pools(2))
    batch, pools = extend_cached(idle(CPU), [Req(1, HEADER), Req(2, HEADER)], pools).unwrap()
    kept, left = split(batch, [1])
    assert release_cached(batch, kept, pools).failure() == StillRunning((2,))
    released = release_cached(left, kept, pools).unwrap()
    again = release_cached(left, kept, released)
    assert isinstance(again, Failure) and isinstance(again.failure(), NotOwned)
    check_cached_pools(released, [kept])


def test_an_empty_prompt_is_a_failure_value() -> None:
    pools = cached_pools(make_test_pools(2))
    result = extend_cached(idle(CPU), [Req(1, ())], pools)
    assert result.failure() == EmptyPrompt(1, 0, 0)


def test_a_cache_from_other_pools_is_refused() -> None:
    mine, theirs = cached_pools(make_test_pools(2)), cached_pools(make_test_pools(2))
    with pytest.raises(BatchConflict, match="other pools"):
        attrs.evolve(mine, cache=theirs.cache)


def test_tokens_that_do_not_start_with_the_prompt_are_refused() -> None:
    pools = cached_pools(make_test_pools(2))
    batch, pools = extend_cached(idle(CPU), [Req(1, HEADER)], pools).unwrap()
    with pytest.raises(ValueError, match="do not start"):
        release_cached(batch, idle(CPU), pools, [(0, *HEADER)])
