"""Keep positions refused past the first two name what is wrong, and where."""

from __future__ import annotations

import re

import pytest

from batchstate import KeepIndicesError, keep_indices


def _refused(message: str) -> pytest.RaisesExc[KeepIndicesError]:
    return pytest.raises(KeepIndicesError, match=f"^{re.escape(message)}$")


def test_a_bool_past_the_first_two_positions_is_named() -> None:
    """`True` after 1 breaks the order; the message names the bool, not the order."""
    with _refused("keep indices must be integers, got a bool"):
        keep_indices([0, 1, True], 3)


def test_an_order_break_in_the_middle_names_both_values() -> None:
    """The two values that break the order are the one at the position and the one before."""
    with _refused(
        "keep indices must be strictly increasing: out of order at position 2 (3 then 1)"
    ):
        keep_indices([0, 3, 1], 4)
    with _refused("keep indices must be strictly increasing: a duplicate at position 3 (2 then 2)"):
        keep_indices([0, 1, 2, 2], 4)
