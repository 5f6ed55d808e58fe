"""Per-row column values converted to their column's dtype exactly, or refused.

`np.asarray(values, dtype=...)` wraps an int64 into a narrower int
(`2**40 + 3` into int32 is 3), truncates floats into ints (`40.9` is 40)
and raises a bare `OverflowError` for Python ints past int64. A column
value that does not fit its dtype is a caller's bug that would reach the
forward as another value, so it is refused, naming the column.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from batchstate.base.errors import ColumnError

__all__ = ["exact_values"]

_NUMBERS: Final = "biufc"  # numpy's kinds: bool, signed, unsigned, float, complex


def exact_values(
    name: str,
    values: Sequence[object] | npt.NDArray[np.generic],
    dtype: np.dtype[np.generic] | None,
) -> npt.NDArray[np.generic]:
    """`values` as a 1-D array of `dtype` (the values' own, if None), each value kept exactly.

    Raises:
        ColumnError: a value that is not a number of the column's kind (a
            float into an int column, a non-0/1 into a bool one), or one
            outside the dtype's range.
    """
    try:
        given = np.asarray(values)
    except (OverflowError, ValueError) as error:
        raise ColumnError(f"{name}: values that fit no array: {error}") from None
    if given.dtype == object and all(isinstance(value, int) for value in given.ravel()):
        # Python ints past int64: no numpy integer dtype holds them.
        largest = max(given.ravel().tolist(), key=abs)
        raise ColumnError(f"{name}: {largest} does not fit {dtype or np.dtype(np.int64)}")
    if given.ndim != 1:
        raise ColumnError(f"{name}: expected one value per row, got shape {list(given.shape)}")
    if dtype is None or given.dtype == dtype or given.shape[0] == 0:
        if given.dtype.kind not in _NUMBERS:
            raise ColumnError(f"{name}: expected numbers, got {given.dtype}")
        return given if dtype is None else given.astype(dtype)
    if given.dtype.kind not in _NUMBERS or (given.dtype.kind == "c" and dtype.kind != "c"):
        raise ColumnError(f"{name}: expected {dtype} values, got {given.dtype}")
    if dtype.kind == "f":
        _expect_float_range(name, given, dtype)
    elif dtype.kind in "iu":
        _expect_int_range(name, given, dtype)
    elif dtype.kind == "b" and given.dtype.kind != "b":
        _expect_int_range(name, given, dtype, high=1)
    return given.astype(dtype)


def _expect_int_range(
    name: str, given: npt.NDArray[np.generic], dtype: np.dtype[np.generic], high: int | None = None
) -> None:
    if given.dtype.kind == "f":
        raise ColumnError(f"{name}: {dtype} column, got floats {given.tolist()[:4]}")
    if high is None:
        bottom, top = _int_bounds(dtype)
    else:
        bottom, top = 0, high  # a bool column: 0 or 1
    low_value, high_value = int(given.min()), int(given.max())
    if low_value < bottom or high_value > top:
        bad = low_value if low_value < bottom else high_value
        raise ColumnError(f"{name}: {bad} does not fit {dtype} ({bottom}..{top})")


def _expect_float_range(
    name: str, given: npt.NDArray[np.generic], dtype: np.dtype[np.generic]
) -> None:
    if given.dtype.itemsize <= dtype.itemsize and given.dtype.kind == "f":
        return
    largest = _float_bounds(dtype)
    # Two reductions settle the usual case (every value in range); NaN or an
    # infinity (both kept) fails the compare and takes the full check below.
    if -largest <= given.min() and given.max() <= largest:
        return
    finite = np.isfinite(given) if given.dtype.kind == "f" else np.ones(given.shape, bool)
    too_big = finite & (np.abs(given.astype(np.float64)) > largest)
    if too_big.any():
        raise ColumnError(
            f"{name}: {given[int(too_big.argmax())]} does not fit {dtype}"
            f" (|x| <= {np.finfo(dtype).max})"  # type: ignore[type-var]  # a float dtype
        )


def _int_bounds(dtype: np.dtype[np.generic]) -> tuple[int, int]:
    # np.iinfo costs about a microsecond a call; columns are built per admission.
    known = _INT_BOUNDS.get(dtype)
    if known is None:
        info = np.iinfo(dtype)  # type: ignore[type-var]  # an integer dtype here
        known = _INT_BOUNDS[dtype] = (int(info.min), int(info.max))
    return known


def _float_bounds(dtype: np.dtype[np.generic]) -> float:
    known = _FLOAT_BOUNDS.get(dtype)
    if known is None:
        known = _FLOAT_BOUNDS[dtype] = float(np.finfo(dtype).max)  # type: ignore[type-var]
    return known


_INT_BOUNDS: dict[np.dtype[np.generic], tuple[int, int]] = {}
_FLOAT_BOUNDS: dict[np.dtype[np.generic], float] = {}
