"""Every row of TRANSITIONS, run from records reached through the public API."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchstate import (
    TRANSITIONS,
    Batch,
    Pools,
    Transition,
    check_batch,
    check_pools,
    decode,
    extend,
    filter_batch,
    idle,
    merge,
    prebuilt,
)
from tests.builders import CPU, make_phase, make_reqs, make_test_pools

Caller = Callable[[Batch | None, Batch | None, Pools], tuple[Batch, Pools, list[Batch]]]


def _call_idle(
    source: Batch | None, operand: Batch | None, pools: Pools
) -> tuple[Batch, Pools, list[Batch]]:
    batch = idle(CPU)
    return batch, pools, [batch]


def _call_extend(
    source: Batch | None, operand: Batch | None, pools: Pools
) -> tuple[Batch, Pools, list[Batch]]:
    batch, pools = extend(source, make_reqs([2, 9], first_rid=50), pools).unwrap()  # type: ignore[arg-type]  # table rows type sources loosely
    return batch, pools, [batch]


def _call_prebuilt(
    source: Batch | None, operand: Batch | None, pools: Pools
) -> tuple[Batch, Pools, list[Batch]]:
    batch, pools = prebuilt(source, make_reqs([4, 17], first_rid=50), pools).unwrap()  # type: ignore[arg-type]  # as above
    return batch, pools, [batch]


def _call_decode(
    source: Batch | None, operand: Batch | None, pools: Pools
) -> tuple[Batch, Pools, list[Batch]]:
    batch, pools = decode(source, pools).unwrap()  # type: ignore[arg-type]  # as above
    return batch, pools, [batch]


def _call_filter(
    source: Batch | None, operand: Batch | None, pools: Pools
) -> tuple[Batch, Pools, list[Batch]]:
    assert source is not None
    kept = filter_batch(source, list(range(1, len(source.rows))))  # type: ignore[arg-type]  # as above
    dropped = filter_batch(source, [0] if len(source.rows) else [])  # type: ignore[arg-type]  # as above
    return kept, pools, [kept, dropped]


def _call_merge(
    source: Batch | None, operand: Batch | None, pools: Pools
) -> tuple[Batch, Pools, list[Batch]]:
    batch = merge(source, operand)  # type: ignore[arg-type]  # as above
    return batch, pools, [batch]


CALLERS: dict[Callable[..., object], Caller] = {
    idle: _call_idle,
    extend: _call_extend,
    prebuilt: _call_prebuilt,
    decode: _call_decode,
    filter_batch: _call_filter,
    merge: _call_merge,
}


def _row_id(row: Transition) -> str:
    source = row.source.__name__ if row.source else "none"
    operand = f"+{row.operand.__name__}" if row.operand else ""
    return f"{source}{operand}-{row.function.__name__}-{row.target.__name__}"


_LENGTHS = st.lists(st.integers(1, 40), min_size=1, max_size=5)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("row", TRANSITIONS, ids=_row_id)
@settings(max_examples=12, deadline=None)
@given(source_lengths=_LENGTHS, operand_lengths=_LENGTHS)
def test_transition_row(
    row: Transition, page_size: int, source_lengths: list[int], operand_lengths: list[int]
) -> None:
    """Each legal transition yields its target phase, and every invariant holds after it."""
    pools = make_test_pools(page_size)
    source, pools = make_phase(row.source, pools, source_lengths) if row.source else (None, pools)
    operand, pools = (
        make_phase(row.operand, pools, operand_lengths, first_rid=20)
        if row.operand
        else (None, pools)
    )
    caller = CALLERS.get(row.function)
    assert caller is not None, f"add a caller for {row.function.__name__} to CALLERS"
    result, pools, live = caller(source, operand, pools)
    assert type(result) is row.target
    for batch in live:
        check_batch(batch, compare_device=True)
    check_pools(pools, [result], compare_device=True)
    if row.function is merge and source is not None and operand is not None:
        assert len(result.rows) == len(source.rows) + len(operand.rows)
        assert result.rows.seq_lens_sum == source.rows.seq_lens_sum + operand.rows.seq_lens_sum
