"""Keep positions at the far ends of int64 are refused, never taken as rows.

An array whose last step wrapped around int64 used to pass as increasing (its
difference overflowed), and a uint64 position past int64 became a negative one;
`filter_batch` then failed with an `IndexError`.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from batchstate import KeepIndicesError, Req, extend, filter_batch, idle, keep_indices, make_pools

CPU = torch.device("cpu")
INT64_MIN = -(2**63)


@pytest.mark.parametrize("length", [2, 3, 200])
def test_a_step_down_to_int64_min_is_out_of_order(length: int) -> None:
    keep = np.arange(1, length + 1, dtype=np.int64)
    keep[-1] = INT64_MIN
    message = (
        f"keep indices must be strictly increasing: out of order at position {length - 1}"
        f" ({length - 1} then {INT64_MIN})"
    )
    with pytest.raises(KeepIndicesError, match=f"^{re.escape(message)}$"):
        keep_indices(keep, length + 1)
    with pytest.raises(KeepIndicesError, match=re.escape(message)):
        keep_indices(torch.from_numpy(keep), length + 1)


@pytest.mark.parametrize("length", [1, 3, 200])
def test_a_uint64_position_past_int64_is_refused(length: int) -> None:
    keep = np.arange(length, dtype=np.uint64)
    keep[-1] = 2**63
    with pytest.raises(KeepIndicesError, match=rf"^keep indices must fit in int64, got {2**63}$"):
        keep_indices(keep, length)


def test_filter_batch_refuses_a_wrapped_step() -> None:
    pools = make_pools(4, 16, 32, CPU)
    batch, _ = extend(idle(CPU), [Req(rid, (1, 2)) for rid in range(3)], pools).unwrap()
    with pytest.raises(KeepIndicesError, match="out of order"):
        filter_batch(batch, np.array([1, INT64_MIN]))


def test_the_largest_int64_position_is_converted_then_out_of_range() -> None:
    keep = np.array([2**63 - 1], dtype=np.uint64)
    with pytest.raises(
        KeepIndicesError, match=rf"^keep index {2**63 - 1} is out of range for 3 rows$"
    ):
        keep_indices(keep, 3)


@pytest.mark.parametrize("dtype", [np.uint64, np.int64])
def test_an_empty_integer_array_keeps_nothing(dtype: type[np.integer]) -> None:
    assert keep_indices(np.array([], dtype=dtype), 3).tolist() == []
