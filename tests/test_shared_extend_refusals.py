"""extend_cached and decode_cached refuse as extend and decode do, by the same values."""

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
    Req,
    cached_pools,
    decode_cached,
    extend_cached,
    idle,
)
from tests.builders import CPU, make_test_pools


def test_extend_cached_starts_from_idle_and_names_itself() -> None:
    pools = cached_pools(make_test_pools(4))
    batch, pools = extend_cached(idle(CPU), [Req(1, (1, 2))], pools).unwrap()
    with pytest.raises(PhaseError, match=r"^extend_cached starts from Idle, got Extended$"):
        extend_cached(batch, [Req(2, (3,))], pools)  # type: ignore[call-overload]  # on purpose


def test_nothing_to_admit_and_a_rid_twice() -> None:
    pools = cached_pools(make_test_pools(4))
    assert extend_cached(idle(CPU), [], pools) == Failure(EmptyExtend())
    message = "the same rid appears twice among the requests: [1]"
    with pytest.raises(BatchConflict, match=f"^{re.escape(message)}$"):
        extend_cached(idle(CPU), [Req(1, (1,)), Req(1, (2,))], pools)


def test_more_requests_than_free_slots() -> None:
    pools = cached_pools(make_test_pools(4, max_reqs=1))
    result = extend_cached(idle(CPU), [Req(1, (1,)), Req(2, (2,))], pools)
    assert result == Failure(OutOfReqSlots(2, 1))


def test_decode_cached_at_the_context_limit_is_too_long() -> None:
    pools = cached_pools(make_test_pools(4, max_context_len=8))
    batch, pools = extend_cached(idle(CPU), [Req(1, tuple(range(8)))], pools).unwrap()
    assert decode_cached(batch, pools) == Failure(ContextTooLong(1, 9, 8))
