"""Refused keep positions are named exactly: the bool, the two values out of order, the end."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

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


def test_a_bool_among_the_first_two_positions_is_named() -> None:
    with _refused("keep indices must be integers, got a bool"):
        keep_indices([True], 3)


def test_a_float_numpy_array_is_named_by_its_dtype() -> None:
    with _refused("keep indices must be integers, got float64"):
        keep_indices(np.array([0.0, 1.0]), 3)


def test_a_negative_first_position_is_named_before_a_later_bool() -> None:
    """Increasing up to the bool: the negative first position is what is reported."""
    with _refused("keep index -1 is negative"):
        keep_indices([-1, 0, True], 3)


def test_tensor_ends_are_named_as_plain_ints() -> None:
    """A tensor's first and last positions are reported as numbers, not as tensors."""
    with _refused("keep index -1 is negative"):
        keep_indices(torch.tensor([-1, 0]), 3)
    with _refused("keep index 3 is out of range for 3 rows"):
        keep_indices(torch.tensor([0, 3]), 3)
