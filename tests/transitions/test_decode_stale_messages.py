"""decode's StaleRecord names the row, its request, its slot and what the pools hold there."""

from __future__ import annotations

import copy
import re

import pytest

from batchstate import StaleRecord, decode, filter_batch, release, split
from tests.builders import make_extended, make_test_pools
from tests.strategies import assert_unchanged, snapshot


def _stale(message: str) -> pytest.RaisesExc[StaleRecord]:
    return pytest.raises(StaleRecord, match=f"^{re.escape(message)}$")


@pytest.mark.parametrize("max_reqs", [1, 16])
def test_pools_a_step_behind_hold_the_old_length(max_reqs: int) -> None:
    """Slot 1 as the pools' top slot, and as one below it."""
    pools = make_test_pools(max_reqs=max_reqs)
    extended, pools = make_extended(pools, [3])
    before = copy.deepcopy(pools)  # pools are linear: the step-behind pools are a copy
    decoded, _ = decode(extended, pools).unwrap()
    with _stale(
        "row 0 (request 0) has 4 tokens in slot 1, the pools hold 3:"
        " the batch or the pools are stale"
    ):
        decode(decoded, before)


def test_the_first_stale_row_is_named_not_the_first_row() -> None:
    """Row 0 is current; row 1 left and was released, so its slot now holds nothing."""
    extended, pools = make_extended(make_test_pools(), [3, 5])
    decoded, pools = decode(extended, pools).unwrap()
    kept, left = split(decoded, [0])
    pools = release(left, kept, pools).unwrap()
    with _stale(
        "row 1 (request 1) has 6 tokens in slot 2, the pools hold 0:"
        " the batch or the pools are stale"
    ):
        decode(decoded, pools)


def test_a_slot_past_the_pools_table_is_named_not_indexed() -> None:
    """A batch from larger pools, decoded against pools of two slots: its slot 4 is not there."""
    extended, _ = make_extended(make_test_pools(max_reqs=8), [3, 5, 7, 9])
    batch = filter_batch(extended, [3])  # the row in slot 4
    small = make_test_pools(max_reqs=2)
    state = snapshot((batch, small))
    with _stale(
        "row 0 (request 3) has 9 tokens in slot 4, the pools hold no such slot:"
        " the batch or the pools are stale"
    ):
        decode(batch, small)
    assert_unchanged(state, (batch, small), "batch and pools after the refusal")
