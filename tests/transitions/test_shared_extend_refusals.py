"""extend and decode with the prefix cache on refuse as with it off, by the same values."""

from __future__ import annotations

import re

import pytest
from returns.result import Failure

from batchstate import (
    BatchConflict,
    ContextTooLong,
    EmptyExtend,
    OutOfReqSlots,
    PhaseError,
    Pools,
    Req,
    decode,
    extend,
    idle,
)
from tests.builders import CPU, make_test_pools


def _both(max_reqs: int = 16, max_context_len: int = 64) -> list[Pools]:
    """The same pools with the cache off and on."""
    return [
        make_test_pools(
            4, max_reqs=max_reqs, max_context_len=max_context_len, prefix_cache=prefix_cache
        )
        for prefix_cache in (False, True)
    ]


@pytest.mark.parametrize("pools", _both(), ids=["off", "on"])
def test_extend_starts_from_idle_and_names_itself(pools: Pools) -> None:
    batch, pools = extend(idle(CPU), [Req(1, (1, 2))], pools).unwrap()
    with pytest.raises(PhaseError, match=r"^extend starts from Idle, got Extended$"):
        extend(batch, [Req(2, (3,))], pools)  # type: ignore[call-overload]  # on purpose


@pytest.mark.parametrize("pools", _both(), ids=["off", "on"])
def test_nothing_to_admit_and_a_rid_twice(pools: Pools) -> None:
    assert extend(idle(CPU), [], pools) == Failure(EmptyExtend())
    message = "the same rid appears twice among the requests: [1]"
    with pytest.raises(BatchConflict, match=f"^{re.escape(message)}$"):
        extend(idle(CPU), [Req(1, (1,)), Req(1, (2,))], pools)


@pytest.mark.parametrize("pools", _both(max_reqs=1), ids=["off", "on"])
def test_more_requests_than_free_slots(pools: Pools) -> None:
    result = extend(idle(CPU), [Req(1, (1,)), Req(2, (2,))], pools)
    assert result == Failure(OutOfReqSlots(2, 1))


@pytest.mark.parametrize("pools", _both(max_context_len=8), ids=["off", "on"])
def test_decode_at_the_context_limit_is_too_long(pools: Pools) -> None:
    batch, pools = extend(idle(CPU), [Req(1, tuple(range(8)))], pools).unwrap()
    assert decode(batch, pools) == Failure(ContextTooLong(1, 9, 8))


def test_more_requests_than_free_slots_locks_nothing() -> None:
    """A refused extend whose prompts would hit leaves the cache's locks as they were."""
    _, pools = _both(max_reqs=2)
    first, pools = extend(idle(CPU), [Req(1, (5,) * 9)], pools).unwrap()
    assert pools.cache.num_locked == 2
    result = extend(idle(CPU), [Req(2, (5,) * 9), Req(3, (5,) * 9)], pools)
    assert result == Failure(OutOfReqSlots(2, 1))
    slot = int(first.rows.req_pool_indices.host[0])
    assert pools.cache.num_locked == 2 and dict(pools.prefixes) == {slot: (5,) * 8}
