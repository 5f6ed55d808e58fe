"""Generation-checked ownership: a holder from before its slot was reused is refused.

Each slot allocation gets a generation, and every holder (rows, `Departed`,
`Chunked`, `Verifying`) carries the generation of each slot it holds. Here
every reuse happens at the same length as before, so counting tokens alone
would accept the stale holder.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import pytest
import torch
from returns.result import Failure, Success

from batchstate import (
    Chunked,
    Departed,
    DraftError,
    Extended,
    Filtered,
    InvariantViolation,
    NoColumns,
    NotHeld,
    NotOwned,
    Pools,
    Req,
    StaleRecord,
    check_pools,
    decode,
    extend,
    find_leaks,
    finish_mixed,
    idle,
    make_pools,
    mix,
    release,
    split,
    sync,
    verify,
)
from tests.strategies import assert_unchanged, snapshot

CPU: Final = torch.device("cpu")


def _reused(
    prefix_cache: bool = False,
) -> tuple[Extended[NoColumns], Departed, Extended[NoColumns], Pools]:
    # Request 0 runs in slot 1 and leaves; request 1 takes slot 1 at the same length.
    pools = make_pools(1, 16, 8, CPU, prefix_cache=prefix_cache)
    first, pools = extend(idle(CPU), [Req(0, (1, 2, 3))], pools).unwrap()
    kept, left = split(first, [])
    pools = release(left, kept, pools).unwrap()
    second, pools = extend(idle(CPU), [Req(1, (4, 5, 6))], pools).unwrap()
    assert second.rows.req_pool_indices.host.tolist() == [1]
    return first, left, second, pools


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_releasing_twice_is_refused_after_the_slot_is_reused(prefix_cache: bool) -> None:
    _, left, second, pools = _reused(prefix_cache)
    before = snapshot(pools)
    assert release(left, idle(CPU), pools) == Failure(NotOwned((1,)))
    assert_unchanged(before, pools)
    check_pools(pools, [second])


def test_a_stale_batch_is_refused_at_the_same_length() -> None:
    first, _, second, pools = _reused()
    before = snapshot(pools)
    with pytest.raises(StaleRecord, match="generation"):
        decode(first, pools)
    assert_unchanged(before, pools)
    with pytest.raises(StaleRecord, match="generation"):
        mix(_kept(first), [], 4, pools, [1])
    assert_unchanged(before, pools)
    assert release(first, idle(CPU), pools) == Failure(NotOwned((1,)))
    decode(second, pools).unwrap()  # the live owner goes on


def _kept(batch: Extended[NoColumns]) -> Filtered[NoColumns]:
    return split(batch, list(range(len(batch.rows)))).kept


def test_a_stale_chunk_is_not_held_at_the_same_length() -> None:
    pools = make_pools(1, 32, 32, CPU)
    mixed, pools = mix(idle(CPU), [Req(0, tuple(range(10)))], 4, pools).unwrap()
    (chunk,) = finish_mixed(mixed).held
    pools = release(chunk, idle(CPU), pools).unwrap()
    mixed, pools = mix(idle(CPU), [Req(1, tuple(range(20, 30)))], 4, pools).unwrap()
    (live,) = finish_mixed(mixed).held
    assert (live.slot, live.cached) == (chunk.slot, chunk.cached)
    before = snapshot(pools)
    assert mix(idle(CPU), [chunk], 4, pools) == Failure(NotHeld(0, 1, 4, 4, stale=True))
    assert extend(idle(CPU), [chunk], pools) == Failure(NotHeld(0, 1, 4, 4, stale=True))
    assert release(chunk, idle(CPU), pools) == Failure(NotOwned((1,)))
    assert_unchanged(before, pools)
    mix(idle(CPU), [live], 4, pools).unwrap()


def test_a_stale_verify_window_is_refused() -> None:
    pools = make_pools(1, 32, 32, CPU)
    extended, pools = extend(idle(CPU), [Req(0, (1, 2, 3))], pools).unwrap()
    decoding, pools = decode(extended, pools).unwrap()
    window, pools = verify(decoding, [2], pools).unwrap()
    pools = release(window, idle(CPU), pools).unwrap()
    again, pools = extend(idle(CPU), [Req(1, (1, 2, 3))], pools).unwrap()
    decoding, pools = decode(again, pools).unwrap()
    live, pools = verify(decoding, [2], pools).unwrap()
    before = snapshot(pools)
    assert release(window, idle(CPU), pools) == Failure(NotOwned((1,)))
    with pytest.raises(DraftError):
        sync(window, np.array([1]), pools)
    assert_unchanged(before, pools)
    sync(live, np.array([1]), pools)


def test_find_leaks_and_check_pools_name_a_stale_holder() -> None:
    first, left, second, pools = _reused()
    leaks = find_leaks(pools, [first])
    assert leaks.stale == (1,) and leaks.wrong_length == ()
    assert "generation" in str(leaks)
    assert find_leaks(pools, [left]).stale == (1,)
    assert not find_leaks(pools, [second])
    with pytest.raises(InvariantViolation, match="generation"):
        check_pools(pools, [first])


def test_slots_taken_directly_and_dropped_are_leaks() -> None:
    _, pools = make_pools(2, 16, 8, CPU).allocate_slots(1).unwrap()
    leaks = find_leaks(pools, [])
    assert leaks.unheld == (1,) and leaks.unheld_tokens == 0
    check_pools(pools)  # owned at no tokens yet: the pools are consistent


def test_every_allocation_gets_a_new_generation() -> None:
    pools = make_pools(1, 16, 8, CPU)
    gens = []
    for rid in range(3):
        batch, pools = extend(idle(CPU), [Req(rid, (1, 2))], pools).unwrap()
        gens.append(int(batch.rows.gens[0]))
        assert int(pools.slot_gens[1]) == gens[-1]
        pools = release(batch, idle(CPU), pools).unwrap()
        assert int(pools.slot_gens[1]) == 0
    assert gens == sorted(set(gens))
    assert not pools.slot_gens.flags.writeable


def test_a_hand_built_chunk_names_its_generation() -> None:
    pools = make_pools(1, 32, 32, CPU)
    mixed, pools = mix(idle(CPU), [Req(0, tuple(range(10)))], 4, pools).unwrap()
    (chunk,) = finish_mixed(mixed).held
    wrong = Chunked(chunk.req, chunk.slot, chunk.cached, gen=chunk.gen + 1)
    assert isinstance(mix(idle(CPU), [wrong], 4, pools), Failure)
    same = Chunked(chunk.req, chunk.slot, chunk.cached, gen=int(pools.slot_gens[chunk.slot]))
    assert isinstance(mix(idle(CPU), [same], 4, pools), Success)
