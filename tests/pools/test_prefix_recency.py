"""`Pools.touch_prefix` (a match that reads nothing moves eviction's clock, as a radix
tree's match does, the rest of a node it ends inside included) and
`batchstate.pools.eviction.evict_least_recent` (eviction ahead of an allocation, least
recently used leaves first)."""

from __future__ import annotations

import pytest

from batchstate import Pools, Req, finish_mixed, idle, make_pools, mix, release, split
from batchstate.errors import PoolsArgumentError
from batchstate.pools.eviction import evict_least_recent
from tests.builders import CPU
from tests.strategies import assert_unchanged, snapshot

OLD = tuple(range(100, 148))  # three whole pages
NEW = tuple(range(500, 532))  # two whole pages
SPLIT = OLD[:16] + tuple(range(900, 932))  # shares OLD's first page, then its own two


def _cached(*prompts: tuple[int, ...]) -> Pools:
    # Each prompt's whole pages cached, in this order (the first the least recent).
    pools = make_pools(4, 512, 512, CPU, 16, prefix_cache=True)
    for number, prompt in enumerate(prompts):
        mixed, pools = mix(idle(CPU), [Req(number, (*prompt, 7))], 256, pools).unwrap()
        running, _ = finish_mixed(mixed)
        kept, left = split(running, [])
        pools = release(left, kept, pools, [(*prompt, 7)]).unwrap()
    return pools


def _left(pools: Pools, prompt: tuple[int, ...]) -> int:
    return pools.cache.match(prompt)[0]


def test_eviction_takes_the_least_recent_leaf_first() -> None:
    pools = _cached(OLD, NEW)
    evicted = evict_least_recent(pools, 1)
    assert (_left(evicted, OLD), _left(evicted, NEW)) == (0, 32)  # the whole leaf goes
    assert evicted.num_free_tokens == pools.num_free_tokens + 48
    assert evict_least_recent(pools, 0) is pools


def test_a_touched_prefix_is_evicted_last() -> None:
    pools = _cached(OLD, NEW).touch_prefix(OLD, 48).commit()
    evicted = evict_least_recent(pools, 1)
    assert (_left(evicted, OLD), _left(evicted, NEW)) == (48, 0)
    assert pools.cache.num_locked == 0  # a touch takes no lock


def test_a_match_ending_inside_a_run_refreshes_the_rest_of_it() -> None:
    # OLD's first page matched, its other two pages the rest of the node the match ends
    # inside: SGLang's match splits the node there and refreshes both parts.
    pools = _cached(OLD, NEW).touch_prefix(OLD, 16).commit()
    evicted = evict_least_recent(pools, 1)
    assert (_left(evicted, OLD), _left(evicted, NEW)) == (48, 0)


def test_a_touch_moves_only_its_own_branch() -> None:
    pools = _cached(OLD, SPLIT, NEW).touch_prefix(SPLIT, 48).commit()
    # OLD's own two pages (a leaf below the shared first page) are now the oldest.
    evicted = evict_least_recent(pools, 1)
    assert (_left(evicted, OLD), _left(evicted, SPLIT), _left(evicted, NEW)) == (16, 48, 32)


@pytest.mark.parametrize(
    ("tokens", "length"),
    [(OLD, 64), (OLD, 8), (tuple(range(700, 748)), 16), (OLD, -16)],
    ids=["longer", "part-page", "uncached", "negative"],
)
def test_a_touch_of_what_is_not_cached_is_refused_and_changes_nothing(
    tokens: tuple[int, ...], length: int
) -> None:
    pools = _cached(OLD)
    before = snapshot(pools)
    with pytest.raises(PoolsArgumentError, match="touch_prefix"):
        pools.touch_prefix(tokens, length)
    assert_unchanged(before, pools, "pools")
    assert pools.touch_prefix(OLD, 0) is pools
