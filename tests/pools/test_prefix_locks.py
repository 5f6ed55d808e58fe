"""`Pools.lock_matched_prefixes` and its inverse `unlock_matched_prefixes`: a reader of a
cached prefix that leaves before taking a slot (an admission that was not run)."""

from __future__ import annotations

import pytest

from batchstate import (
    MemoryKinds,
    Pools,
    RecurrentState,
    Req,
    SlidingWindow,
    finish_mixed,
    idle,
    make_pools,
    mix,
    release,
    split,
)
from batchstate.errors import PoolsArgumentError
from tests.builders import CPU
from tests.strategies import assert_unchanged, snapshot

PROMPT = tuple(range(100, 140))  # two whole pages and 8 tokens


def _cached() -> Pools:
    # PROMPT's two whole pages cached, no row reading them.
    pools = make_pools(4, 256, 256, CPU, 16, prefix_cache=True)
    mixed, pools = mix(idle(CPU), [Req(1, PROMPT)], 64, pools).unwrap()
    running, _ = finish_mixed(mixed)
    kept, left = split(running, [])
    return release(left, kept, pools, [PROMPT]).unwrap()


def test_an_unlock_gives_back_what_a_lock_took() -> None:
    pools = _cached()
    assert (pools.cache.num_locked, pools.cache.num_evictable) == (0, 2)
    locked = pools.lock_matched_prefixes([PROMPT, PROMPT], [32, 16]).commit()
    assert (locked.cache.readers(PROMPT, 16), locked.cache.readers(PROMPT, 32)) == (2, 1)
    assert (locked.cache.num_locked, locked.cache.num_evictable) == (2, 0)
    once = locked.unlock_matched_prefixes([PROMPT], [32]).commit()
    assert (once.cache.readers(PROMPT, 16), once.cache.readers(PROMPT, 32)) == (1, 0)
    assert (once.cache.num_locked, once.cache.num_evictable) == (1, 1)
    back = once.unlock_matched_prefixes([PROMPT], [16]).commit()
    assert (back.cache.num_locked, back.cache.num_evictable) == (0, 2)
    assert back.num_free_tokens == pools.num_free_tokens  # locks move no page
    assert back.unlock_matched_prefixes([PROMPT], [0]) is back  # nothing to give back


@pytest.mark.parametrize(
    ("tokens", "length"),
    [
        (PROMPT, 32),  # cached, but no row reads it
        (PROMPT, 48),  # more than the cache holds
        (tuple(range(500, 540)), 16),  # not cached at all
        (PROMPT, 8),  # not a whole page
    ],
    ids=["unlocked", "longer", "uncached", "part-page"],
)
def test_an_unlock_of_what_no_lock_holds_is_refused_and_changes_nothing(
    tokens: tuple[int, ...], length: int
) -> None:
    pools = _cached()
    before = snapshot(pools)
    with pytest.raises(PoolsArgumentError, match="unlock_matched_prefixes"):
        pools.unlock_matched_prefixes([tokens], [length])
    assert_unchanged(before, pools, "pools")
    assert pools.is_newest


def test_a_second_unlock_in_one_call_is_refused_whole() -> None:
    locked = _cached().lock_matched_prefixes([PROMPT], [32]).commit()
    before = snapshot(locked)
    with pytest.raises(PoolsArgumentError):
        locked.unlock_matched_prefixes([PROMPT, PROMPT], [32, 32])
    assert_unchanged(before, locked, "pools")


def test_hybrid_pools_are_refused_by_name() -> None:
    kinds = MemoryKinds((SlidingWindow(8, 512), RecurrentState(16, 8)))
    pools = make_pools(8, 128, 160, CPU, 4, prefix_cache=True, memory=kinds)
    with pytest.raises(PoolsArgumentError, match="hybrid pools"):
        pools.unlock_matched_prefixes([PROMPT], [16])
