"""Which elements of one host array are also in another, by the cheaper of two methods."""

from __future__ import annotations

from typing import Final

import numpy as np

from batchstate.base.mirrored import HostArray

__all__ = ["overlap"]

# Up to this many (value, among) pairs, comparing every pair beats `np.isin`'s sort.
_MAX_PAIRS: Final = 1 << 16


def overlap(values: HostArray, among: HostArray) -> HostArray:
    """The elements of host array `values` that are also in `among`, in order.

    `np.isin` sorts; comparing every pair costs less while one side is small
    (one request joining, one leaving).
    """
    if values.shape[0] == 1:  # one request joining or leaving, the usual case
        return values if (among == values[0]).any() else values[:0]
    if values.shape[0] * among.shape[0] > _MAX_PAIRS:
        shared: HostArray = values[np.isin(values, among)]
    else:
        shared = values[(values[:, None] == among).any(1)]
    return shared
