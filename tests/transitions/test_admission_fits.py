"""A short admission says how many of the requests it was offered would fit, exactly.

`extend`, `admit_prefilled` and `mix` fail whole when slots or KV run short; their
`OutOfReqSlots` / `OutOfKVTokens` carry `fits`: the same call with only the
first `fits` requests succeeds, and with one more fails. Drawn pools (page
sizes 1 and 4, cache off and on, a cached head that new prompts share),
running rows for `mix`, and requests and held chunks to admit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TypeVar

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from returns.result import Failure, Result, Success

from batchstate import (
    Chunked,
    Filtered,
    Idle,
    NoColumns,
    OutOfKVTokens,
    OutOfReqSlots,
    Pools,
    Req,
    admit_prefilled,
    extend,
    finish_mixed,
    idle,
    make_pools,
    merge,
    mix,
    release,
)
from tests.strategies import CPU

_T = TypeVar("_T")
HEAD = tuple(range(100, 108))  # two pages of 4: cached before each case with the cache on

Admit = Callable[[Sequence[Req | Chunked[NoColumns]], Pools], Result[object, object]]


def _admit(transition: str, running: Filtered[NoColumns] | Idle[NoColumns], budget: int) -> Admit:
    def call(items: Sequence[Req | Chunked[NoColumns]], pools: Pools) -> Result[object, object]:
        if transition == "extend":
            return extend(idle(CPU), items, pools)
        if transition == "admit_prefilled":
            reqs = [item for item in items if isinstance(item, Req)]
            return admit_prefilled(idle(CPU), reqs, pools)
        return mix(running, items, budget, pools, [1] * len(running.rows))

    return call


@st.composite
def _cases(
    draw: st.DrawFn, transition: str, cache: bool
) -> tuple[Admit, list[Req | Chunked[NoColumns]], Pools]:
    page_size = draw(st.sampled_from([1, 4]))
    pools = make_pools(
        draw(st.integers(2, 6)), 40, draw(st.integers(4, 24)) * page_size, CPU, page_size,
        prefix_cache=cache,
    )  # fmt: skip
    if cache:  # a finished request leaves HEAD cached
        done, pools = _set_up(extend(idle(CPU), [Req(900, (*HEAD, 1))], pools))
        pools = release(done, idle(CPU), pools).unwrap()
    running: Filtered[NoColumns] | Idle[NoColumns] = idle(CPU)
    items: list[Req | Chunked[NoColumns]] = []
    if transition == "mix" and draw(st.booleans()):
        rows, pools = _set_up(extend(idle(CPU), [Req(800, (7,) * draw(st.integers(1, 9)))], pools))
        running = merge(idle(CPU), rows)
    if transition != "admit_prefilled" and draw(st.booleans()):  # a held chunk first
        step, pools = _set_up(mix(idle(CPU), [Req(700, (*HEAD, *range(20)))], 4, pools))
        (chunk,) = finish_mixed(step).held
        items.append(chunk)
    for rid in range(draw(st.integers(1, 5))):
        tail = tuple(range(rid * 50, rid * 50 + draw(st.integers(1, 20))))
        items.append(Req(rid, (*HEAD, *tail) if draw(st.booleans()) else tail))
    return _admit(transition, running, draw(st.integers(1, 80))), items, pools


def _set_up(result: Result[_T, object]) -> _T:
    # A step the case needs before its admission; pools drawn too small for it: no case.
    assume(isinstance(result, Success))
    return result.unwrap()


def _short(result: Result[object, object]) -> OutOfReqSlots | OutOfKVTokens | None:
    failure = result.failure() if isinstance(result, Failure) else None
    return failure if isinstance(failure, OutOfReqSlots | OutOfKVTokens) else None


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("transition", ["extend", "admit_prefilled", "mix"])
@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_fits_is_the_most_requests_from_the_first_that_fit(
    transition: str, cache: bool, data: st.DataObject
) -> None:
    admit, items, pools = data.draw(_cases(transition, cache))
    short = _short(admit(items, copy.deepcopy(pools)))
    if short is None:
        return
    fits = short.fits
    assert 0 <= fits < len(items)
    if fits:
        assert isinstance(admit(items[:fits], copy.deepcopy(pools)), Success)
    assert _short(admit(items[: fits + 1], copy.deepcopy(pools))) is not None
    assert f"; {fits} of the requests offered fit" in str(short)


def test_a_mix_short_of_kv_names_how_many_fit() -> None:
    """Two prompts of two pages each, five pages free: the first fits, both do not."""
    pools = make_pools(4, 32, 20, CPU, page_size=4)
    reqs = [Req(0, tuple(range(8))), Req(1, tuple(range(8))), Req(2, tuple(range(8)))]
    before = copy.deepcopy(pools)
    first, pools = extend(idle(CPU), [Req(9, tuple(range(4)) * 3)], pools).unwrap()  # 3 pages
    short = mix(merge(idle(CPU), first), reqs, 64, pools, [1]).failure()
    assert short == OutOfKVTokens(7, 2, 4)  # the decode token alone needs a page
    assert short.fits == 0
    short = mix(idle(CPU), reqs, 64, before).failure()
    assert short == OutOfKVTokens(6, 5, 4)
    assert short.fits == 2
    assert isinstance(mix(idle(CPU), reqs[:2], 64, before), Success)
