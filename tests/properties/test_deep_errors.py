"""Misuse that used to fail deep inside with a raw error is refused up front, typed.

A swapped chunk request raised a `KeyError` from the prefix cache after the
table was written; a draft count near int64's maximum raised numpy's
"array is too big"; a float chunk budget a bare `TypeError` from a compare;
`check_batch` on a record without rows an `AttributeError`.
"""

from __future__ import annotations

from typing import Final

import attrs
import numpy as np
import pytest
import torch
from returns.result import Failure

from batchstate import (
    Chunked,
    ContextTooLong,
    Departed,
    NotHeld,
    PhaseError,
    Pools,
    Req,
    Sampled,
    check_batch,
    decode,
    extend,
    finish_mixed,
    idle,
    make_pools,
    mix,
    verify,
)
from batchstate.base.mirrored import host_int64
from tests.strategies import assert_unchanged, snapshot

CPU: Final = torch.device("cpu")


def _held_chunk(prefix_cache: bool) -> tuple[Chunked, Pools]:
    pools = make_pools(4, 64, 128, CPU, 4, prefix_cache=prefix_cache)
    step = mix(idle(CPU), [Req(0, tuple(range(1, 20)))], 8, pools).unwrap()
    return finish_mixed(step.batch).held[0], step.pools


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("admit", ["extend", "mix"])
def test_a_chunk_whose_request_was_swapped_is_not_held(admit: str, prefix_cache: bool) -> None:
    """With the cache off too: the chunk remembers the request its KV was computed for."""
    chunk, pools = _held_chunk(prefix_cache=prefix_cache)
    swapped = attrs.evolve(chunk, req=Req(5, tuple(range(100, 130))))
    before = snapshot(pools)
    result = (
        extend(idle(CPU), [swapped], pools)
        if admit == "extend"
        else mix(idle(CPU), [swapped], 8, pools)
    )
    assert isinstance(result, Failure)
    failure = result.failure()
    assert isinstance(failure, NotHeld) and failure.other_tokens
    assert "the chunk's request was swapped" in str(failure)
    assert_unchanged(before, pools)
    assert pools.is_newest


def test_a_draft_count_near_int64_max_is_context_too_long() -> None:
    pools = make_pools(4, 32, 64, CPU)
    extended, pools = extend(idle(CPU), [Req(0, (1, 2, 3))], pools).unwrap()
    batch, pools = decode(extended, pools).unwrap()
    before = snapshot((batch, pools))
    result = verify(batch, np.array([2**63 - 2]), pools)
    assert result == Failure(ContextTooLong(0, 2**63 + 2, 32))
    assert_unchanged(before, (batch, pools))


@pytest.mark.parametrize("budget", [8.0, 1.5, True, "8"])
def test_a_chunk_budget_that_is_not_an_int_is_refused_by_name(budget: object) -> None:
    pools = make_pools(4, 32, 64, CPU)
    with pytest.raises(TypeError, match="mix: budget must be an int"):
        mix(idle(CPU), [Req(0, (1, 2, 3))], budget, pools)  # type: ignore[call-overload]
    assert pools.is_newest and pools.num_free_slots == 4


def test_check_batch_on_a_record_without_rows_is_a_phase_error() -> None:
    pools = make_pools(4, 32, 64, CPU)
    extended, pools = extend(idle(CPU), [Req(0, (1, 2, 3))], pools).unwrap()
    batch, pools = decode(extended, pools).unwrap()
    window, pools = verify(batch, [1], pools).unwrap()
    chunk, _ = _held_chunk(prefix_cache=False)
    departed = Departed((Req(0, (1,)),), host_int64([1]), host_int64([4]), gens=batch.rows.gens)
    sampled = Sampled.of(batch.rows, torch.tensor([7]))
    for record in (window, chunk, departed, sampled, "not a batch"):
        with pytest.raises(PhaseError, match=f"check_batch takes .* got {type(record).__name__}"):
            check_batch(record)  # type: ignore[arg-type]  # on purpose
