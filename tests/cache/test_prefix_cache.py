"""The prefix cache inside `Pools`: values, eviction, and hostile inputs changing nothing."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from returns.result import Failure

from batchstate import (
    EmptyPrompt,
    InvariantViolation,
    NotOwned,
    OutOfKVTokens,
    Pools,
    Req,
    StillRunning,
    check_pools,
    extend,
    idle,
    release,
    split,
)
from tests.builders import CPU, make_test_pools

HEADER = tuple(range(10, 30))  # 20 tokens


def _shared(page_size: int, num_kv_tokens: int = 512) -> Pools:
    return make_test_pools(page_size, num_kv_tokens=num_kv_tokens, prefix_cache=True)


def _snapshot(pools: Pools) -> tuple[object, ...]:
    """What a failed or refused call must leave as it was."""
    return (
        pools.free_slots.tolist(),
        pools.free_pages.tolist(),
        pools.slot_tokens.tolist(),
        pools.cache.entries(),
        dict(pools.prefixes),
        pools.table.host.copy().tolist(),
    )


def test_a_published_prefix_is_read_by_the_next_request_and_persistence_holds() -> None:
    empty = _shared(4)
    first, pools = extend(idle(CPU), [Req(1, (*HEADER, 1))], empty).unwrap()
    # The prefill's five whole pages are cached at once, and its row reads them.
    assert pools.cache.num_tokens == 20 and pools.cache.num_locked == 5
    assert empty.cache.num_tokens == 0  # the old value stands
    cached = release(first, idle(CPU), pools).unwrap()
    assert cached.cache.num_tokens == 20 and cached.cache.num_locked == 0
    assert pools.cache.num_locked == 5  # the value released from is unchanged
    second, after = extend(idle(CPU), [Req(2, (*HEADER, 2, 3))], cached).unwrap()
    assert second.prefix_lens.tolist() == [20] and second.extend_lens.tolist() == [2]
    assert after.cache.num_locked == 5 and cached.cache.num_locked == 0
    check_pools(after, [second], compare_device=True)


def test_a_page_size_that_does_not_divide_the_prefix_caches_whole_pages_only() -> None:
    first, pools = extend(idle(CPU), [Req(1, HEADER)], _shared(16)).unwrap()
    assert list(pools.cache.entries()) == [HEADER[:16]]  # published: the whole page only
    pools = release(first, idle(CPU), pools).unwrap()
    assert list(pools.cache.entries()) == [HEADER[:16]]  # the partial page was freed
    batch, pools = extend(idle(CPU), [Req(2, HEADER[:16])], pools).unwrap()
    assert batch.prefix_lens.tolist() == [0]  # a whole cached prompt still computes its last page
    # Its page holds tokens the cache holds already: at the prefill's end it reads the
    # cache's page, its own is retired (written by this forward, then freed), its cell moved.
    cached_page = pools.cache.match(HEADER[:16])[1].tolist()
    slot = int(batch.rows.req_pool_indices.host[0])
    assert dict(pools.prefixes) == {slot: HEADER[:16]}
    assert pools.cache.num_pages == 1 and pools.retired.shape[0] == 1
    assert (pools.table.host[slot, :16] // 16).tolist() == cached_page * 16
    assert batch.rows.seq_lens.host.tolist() == [16]
    assert pools.num_free_tokens == pools.num_pages * 16 - 16  # the KV held once
    check_pools(pools, [batch], compare_device=True)


def test_eviction_takes_the_least_recently_used_leaf_and_never_a_page_in_use() -> None:
    pools = _shared(4, num_kv_tokens=48)  # 12 pages
    for rid, head in ((1, (1,) * 8), (2, (2,) * 8), (3, (3,) * 8)):
        batch, pools = extend(idle(CPU), [Req(rid, (*head, 9))], pools).unwrap()
        pools = release(batch, idle(CPU), pools).unwrap()
    reader, pools = extend(idle(CPU), [Req(4, ((1,) * 8) + (5,))], pools).unwrap()
    assert reader.prefix_lens.tolist() == [8]
    # 12 pages: 6 cached (2 of them read by request 4), 1 private, 5 free; ask for 7.
    big, after = extend(idle(CPU), [Req(5, (7,) * 28)], pools).unwrap()
    published = {(7,) * end for end in range(4, 29, 4)}  # request 5's seven pages
    assert set(after.cache.entries()) == {(1,) * 4, (1,) * 8, (3,) * 4, (3,) * 8} | published
    assert after.cache.num_evicted == 2
    check_pools(after, [reader, big])
    before = _snapshot(after)
    result = extend(idle(CPU), [Req(6, (8,) * 64)], after)
    assert isinstance(result, Failure) and isinstance(result.failure(), OutOfKVTokens)
    assert _snapshot(after) == before


def test_releasing_twice_or_while_running_fails_and_changes_nothing() -> None:
    pools = _shared(2)
    batch, pools = extend(idle(CPU), [Req(1, HEADER), Req(2, HEADER)], pools).unwrap()
    kept, left = split(batch, [1])
    before = _snapshot(pools)
    assert release(batch, kept, pools).failure() == StillRunning((2,))
    assert _snapshot(pools) == before
    released = release(left, kept, pools).unwrap()
    after = _snapshot(released)
    again = release(left, kept, released)
    assert isinstance(again, Failure) and isinstance(again.failure(), NotOwned)
    assert _snapshot(released) == after
    check_pools(released, [kept])


def test_an_empty_prompt_is_a_failure_value() -> None:
    pools = _shared(2)
    result = extend(idle(CPU), [Req(1, ())], pools)
    assert result.failure() == EmptyPrompt(1, 0, 0)


def test_a_cache_from_other_pools_is_caught_by_the_check() -> None:
    """A row reads pages 1-5 of its cache; the other pools' cache holds none of them."""
    _, mine = extend(idle(CPU), [Req(1, (*HEADER, 1))], _shared(4)).unwrap()
    theirs = _shared(4)
    swapped = attrs.evolve(mine, cache=theirs.cache)
    with pytest.raises(InvariantViolation, match="is read as a cached prefix but not cached"):
        check_pools(swapped)


def test_tokens_that_do_not_start_with_the_prompt_are_refused() -> None:
    batch, pools = extend(idle(CPU), [Req(1, HEADER)], _shared(2)).unwrap()
    before = _snapshot(pools)
    with pytest.raises(ValueError, match="do not start"):
        release(batch, idle(CPU), pools, [(0, *HEADER)])
    assert _snapshot(pools) == before
    assert np.array_equal(pools.table.host, pools.table.device.numpy())
