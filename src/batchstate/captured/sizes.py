"""Captured CUDA-graph sizes, checked without torch: a command line checks them before it loads."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from batchstate.base.errors import PaddingError

__all__ = ["PaddingError", "check_sizes", "is_int"]


def is_int(value: object) -> bool:
    """An int, and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_sizes(sizes: Sequence[int]) -> None:
    """Raise `PaddingError` unless `sizes` is a non-empty, strictly increasing run of ints >= 1.

    >>> check_sizes([1, 2, 2])
    Traceback (most recent call last):
    ...
    batchstate.base.errors.PaddingError: captured sizes must be >= 1 and strictly ...
    """
    given: object = sizes  # callers without mypy may pass anything
    if not isinstance(given, Sequence) or not sizes:
        raise PaddingError(f"captured sizes must be a non-empty sequence, got {sizes!r}")
    if not all(is_int(size) for size in sizes):
        raise PaddingError(f"captured sizes must be ints, got {list(sizes)}")
    if sizes[0] < 1 or any(a >= b for a, b in itertools.pairwise(sizes)):
        raise PaddingError(
            f"captured sizes must be >= 1 and strictly increasing, got {list(sizes)}"
        )
