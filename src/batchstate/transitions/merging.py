"""Merge: append a batch's rows to the running batch."""

from __future__ import annotations

from typing import Final

import numpy as np

from batchstate.base.errors import BatchConflict, ColumnError, PhaseError
from batchstate.base.intersection import overlap
from batchstate.base.mirrored import HostArray
from batchstate.columns.columns import C
from batchstate.records.phases import Decoding, Extended, Filtered, Idle
from batchstate.records.rows import RIDS, SLOTS

__all__ = ["merge"]


def merge(
    running: Decoding[C] | Filtered[C] | Idle[C], incoming: Extended[C] | Filtered[C]
) -> Filtered[C]:
    """`running`'s rows followed by `incoming`'s, on every column, device and host.

    Reads nothing from the device. Merging with an empty side returns the
    other side's rows as they are.

    Raises:
        PhaseError: a side of a phase merge does not accept.
        BatchConflict: a request id or a request slot is on both sides, or
            the sides live on different devices.
        ColumnError: the sides carry different column sets (mypy rejects
            that too).
    """
    if not isinstance(running, _RUNNING):
        raise PhaseError(
            f"merge appends to Decoding, Filtered or Idle, got {type(running).__name__}"
        )
    if not isinstance(incoming, _INCOMING):
        raise PhaseError(f"merge appends Extended or Filtered, got {type(incoming).__name__}")
    left, right = running.rows, incoming.rows
    if left.device != right.device:
        raise BatchConflict(f"cannot merge a batch on {right.device} into one on {left.device}")
    if type(left.columns) is not type(right.columns):
        raise ColumnError(
            f"cannot merge {type(right.columns).__name__} columns into"
            f" {type(left.columns).__name__} ones"
        )
    if not len(right):
        return Filtered(left)
    if not len(left):
        return Filtered(right)
    # One joining row (the usual case): one compare of its id and slot against every
    # row's; `count_nonzero`, a C call, costs a third less than `.any()` here. Several
    # rows, or a match: each column is checked on its own and what is shared is named.
    check_each = len(right) != 1 or np.count_nonzero(
        left.ints[_SLOTS_AND_RIDS] == right.ints[_SLOTS_AND_RIDS]
    )
    if check_each:
        _expect_disjoint(left.rids, right.rids, "request ids")
        _expect_disjoint(left.req_pool_indices.host, right.req_pool_indices.host, "request slots")
    return Filtered(left.cat(right))


# The rows of `Rows.ints` that must not meet: one compare checks both for one joining row.
_SLOTS_AND_RIDS: Final = slice(SLOTS, RIDS + 1)


def _expect_disjoint(left: HostArray, right: HostArray, what: str) -> None:
    shared = overlap(right, left)
    if shared.shape[0]:
        raise BatchConflict(f"{what} {shared.tolist()} are in both batches")


# isinstance against a tuple: a third of the cost of building a union at every call.
_RUNNING: Final = (Decoding, Filtered, Idle)
_INCOMING: Final = (Extended, Filtered)
