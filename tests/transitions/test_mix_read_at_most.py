"""mix's `read_at_most`: a new request's cache hit capped, what it then computes and holds."""

from __future__ import annotations

import pytest
import torch
from returns.result import Success

from batchstate import Pools, Req, finish_mixed, idle, mix, release
from tests.builders import make_test_pools

CPU = torch.device("cpu")
PROMPT = tuple(range(1, 50))  # 49 tokens: three whole pages of 16 are cacheable


def _cached(page_size: int) -> Pools:
    """Pools whose cache holds PROMPT's whole pages (one request ran and left)."""
    pools = make_test_pools(page_size, prefix_cache=True, max_context_len=128)
    mixed, pools = mix(idle(CPU), [Req(0, PROMPT)], 64, pools).unwrap()
    running, _ = finish_mixed(mixed)
    return release(running, idle(CPU), pools).unwrap()


@pytest.mark.parametrize(("page_size", "cap", "read"), [(16, 40, 32), (16, 0, 0), (1, 40, 40)])
def test_a_capped_request_reads_whole_pages_under_its_cap_and_computes_the_rest(
    page_size: int, cap: int, read: int
) -> None:
    uncapped, plain = mix(idle(CPU), [Req(1, PROMPT)], 64, _cached(page_size)).unwrap()
    pools = _cached(page_size)
    mixed, after = mix(idle(CPU), [Req(1, PROMPT)], 64, pools, read_at_most={1: cap}).unwrap()
    assert uncapped.prefix_lens.tolist() == [48]
    assert mixed.prefix_lens.tolist() == [read]
    assert mixed.extend_lens.tolist() == [len(PROMPT) - read]
    # Its copies of pages the cache holds are retired when its prefill ends: it holds
    # no more memory than the uncapped request once its forward has run.
    assert (after.num_retired - plain.num_retired) * page_size == 48 - read
    assert after.num_free_tokens == plain.num_free_tokens


def test_a_cap_on_a_request_not_admitted_or_above_its_hit_changes_nothing() -> None:
    plain, _ = mix(idle(CPU), [Req(1, PROMPT)], 64, _cached(16)).unwrap()
    caps = {1: 99, 7: 0}
    capped, _ = mix(idle(CPU), [Req(1, PROMPT)], 64, _cached(16), read_at_most=caps).unwrap()
    assert capped.prefix_lens.tolist() == plain.prefix_lens.tolist() == [48]


def test_the_recomputed_pages_are_retired_when_the_request_leaves() -> None:
    pools = _cached(16)
    cached_pages = pools.cache.num_evictable
    mixed, pools = mix(idle(CPU), [Req(1, PROMPT)], 64, pools, read_at_most={1: 0}).unwrap()
    running, _ = finish_mixed(mixed)
    pools = release(running, idle(CPU), pools).unwrap()
    # The cache held those pages already: the request's copies were freed, not cached twice.
    assert pools.cache.num_evictable == cached_pages == 3
    assert pools.num_free_tokens + cached_pages * 16 == 512


@pytest.mark.parametrize(
    ("caps", "kind", "message"),
    [
        ([1], TypeError, "read_at_most must be a mapping, got list"),
        ({1: 2.0}, TypeError, "read_at_most maps int rids to ints, got float"),
        ({"1": 2}, TypeError, "read_at_most maps int rids to ints, got str"),
        ({1: True}, TypeError, "read_at_most maps int rids to ints, got bool"),
        ({1: -1}, ValueError, "read_at_most[1] is -1, a cap is >= 0"),
    ],
)
def test_a_bad_cap_is_refused_and_the_pools_stay_usable(
    caps: object, kind: type[Exception], message: str
) -> None:
    pools = _cached(16)
    free = pools.num_free_tokens
    with pytest.raises(kind, match=message.replace("[", r"\[").replace("]", r"\]")):
        mix(idle(CPU), [Req(1, PROMPT)], 64, pools, read_at_most=caps)  # type: ignore[call-overload]
    assert pools.num_free_tokens == free
    assert isinstance(mix(idle(CPU), [Req(1, PROMPT)], 64, pools), Success)
