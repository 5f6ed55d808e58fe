"""What a caller hands `Pools`' public allocate and free methods, checked before any change.

The transitions call the allocators underneath these doors directly: they
derive their arguments from records already checked against the pools, so
they pay for none of this. A caller of the doors may pass anything, and an
unchecked count, slot or length would hand a live request's slot or KV
pages to another (a free list moved back over pages still in use). Every
check here raises `PoolsArgumentError` naming the argument, before
anything is taken or freed.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from batchstate._errors import PoolsArgumentError
from batchstate._mirrored import HostArray

if TYPE_CHECKING:
    from batchstate._pools import Pools

__all__ = [
    "check_count",
    "check_free",
    "check_fresh",
    "check_next",
    "check_shrink",
    "check_tokens",
]


def check_count(num_slots: object) -> int:
    """`num_slots` as an int, if it is a non-negative integer (not a bool)."""
    if isinstance(num_slots, bool | np.bool_):
        raise PoolsArgumentError("num_slots must be an integer, got a bool")
    try:
        count = operator.index(num_slots)  # type: ignore[arg-type]  # checked just below
    except TypeError:
        raise PoolsArgumentError(
            f"num_slots must be an integer, got {type(num_slots).__name__}"
        ) from None
    if count < 0:
        raise PoolsArgumentError(f"num_slots must be >= 0, got {count}")
    return count


def check_tokens(pools: Pools, slots: object, old_lens: object, new_lens: object) -> None:
    """`allocate_tokens`' arguments: owned slots, at the length each owns, growing in the table."""
    checked = _owned(pools, slots)
    old = _host_array("old_lens", old_lens, checked.shape[0])
    new = _host_array("new_lens", new_lens, checked.shape[0])
    _expect_held(pools, checked, old, "old_lens")
    _expect_growth(pools, checked, old, new)


def check_fresh(pools: Pools, slots: object, seq_lens: object) -> list[int]:
    """`allocate_fresh`'s arguments: owned slots holding nothing yet, lengths in the table.

    Returns the lengths as Python ints, as the allocator counts them.
    """
    checked = _owned(pools, slots)
    if isinstance(seq_lens, np.ndarray):
        lens = _host_array("seq_lens", seq_lens, checked.shape[0])
    else:
        lens = _ints("seq_lens", seq_lens, checked.shape[0])
    _expect_held(pools, checked, np.zeros_like(checked), "a fresh slot's length")
    _expect_growth(pools, checked, np.zeros_like(checked), lens, least=1)
    fresh: list[int] = lens.tolist()
    return fresh


def check_next(pools: Pools, slots: object, new_lens: object) -> None:
    """`allocate_next`'s arguments: owned slots, each growing by exactly one token."""
    checked = _owned(pools, slots)
    new = _host_array("new_lens", new_lens, checked.shape[0])
    _expect_held(pools, checked, new - 1, "new_lens - 1")
    _expect_growth(pools, checked, new - 1, new)


def check_free(slots: object, seq_lens: object, tokens: object, gens: object) -> None:
    """`free`'s arguments' types and shapes; ownership is `owned_tokens`' to check."""
    checked = _host_array("slots", slots)
    if seq_lens is not None:
        _host_array("seq_lens", seq_lens, checked.shape[0])
    if gens is not None:
        _host_array("gens", gens, checked.shape[0])
    if tokens is not None and (not isinstance(tokens, Sequence) or len(tokens) != checked.shape[0]):
        raise PoolsArgumentError(
            f"tokens must be a sequence of one token sequence per slot"
            f" ({checked.shape[0]}), got {type(tokens).__name__}"
        )


def check_shrink(slots: object, new_lens: object) -> None:
    """`shrink`'s arguments' types and shapes; ownership and range are checked there."""
    checked = _host_array("slots", slots)
    _host_array("new_lens", new_lens, checked.shape[0])


def _owned(pools: Pools, slots: object) -> HostArray:
    # `slots` as a host array, if each is a distinct slot the pools hold (at any length).
    checked = _host_array("slots", slots)
    values = checked.tolist()
    out_of_range = [slot for slot in values if not 1 <= slot <= pools.max_reqs]
    if out_of_range:
        raise PoolsArgumentError(
            f"slots {out_of_range} are out of range: request slots are 1..{pools.max_reqs}"
        )
    free = [slot for slot in values if not pools.slot_gens[slot]]
    if free:
        raise PoolsArgumentError(f"slots {free} are free: allocate_slots hands out slots first")
    if len(set(values)) != len(values):
        raise PoolsArgumentError(f"slots {values} repeat a slot")
    return checked


def _expect_held(pools: Pools, slots: HostArray, lens: HostArray, what: str) -> None:
    held = pools.slot_tokens[slots]
    wrong = (held != lens).nonzero()[0].tolist()
    if wrong:
        at = wrong[0]
        raise PoolsArgumentError(
            f"slot {int(slots[at])} owns {int(held[at])} tokens, {what} says {int(lens[at])}:"
            f" positions below what a slot owns are another row's KV"
        )


def _expect_growth(
    pools: Pools, slots: HostArray, old: HostArray, new: HostArray, least: int = 0
) -> None:
    short = (new < old + least).nonzero()[0].tolist()
    if short:
        at = short[0]
        raise PoolsArgumentError(
            f"slot {int(slots[at])} would go from {int(old[at])} to {int(new[at])} tokens:"
            f" an allocation grows a slot (free or shrink give tokens back)"
        )
    too_long = (new > pools.max_context_len).nonzero()[0].tolist()
    if too_long:
        at = too_long[0]
        raise PoolsArgumentError(
            f"slot {int(slots[at])} would own {int(new[at])} tokens, the table holds"
            f" {pools.max_context_len}"
        )


def _host_array(name: str, value: object, length: int | None = None) -> HostArray:
    # A 1-D int64 numpy array of `length` (any, if None).
    if not isinstance(value, np.ndarray) or value.dtype != np.int64 or value.ndim != 1:
        got = (
            f"{value.dtype} {list(value.shape)}"
            if isinstance(value, np.ndarray)
            else type(value).__name__
        )
        raise PoolsArgumentError(f"{name} must be a 1-D int64 numpy array, got {got}")
    if length is not None and value.shape[0] != length:
        raise PoolsArgumentError(f"{name} has {value.shape[0]} values, slots has {length}")
    return value


def _ints(name: str, value: object, length: int) -> HostArray:
    # Python ints (no bools, no floats) as an int64 array of `length`.
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise PoolsArgumentError(f"{name} must be a sequence of ints, got {type(value).__name__}")
    if len(value) != length:
        raise PoolsArgumentError(f"{name} has {len(value)} values, slots has {length}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int | np.integer):
            raise PoolsArgumentError(f"{name} must be ints, got {type(item).__name__}")
    try:
        return np.array(value, dtype=np.int64).reshape(length)
    except OverflowError:
        raise PoolsArgumentError(f"{name} must fit in int64, got {list(value)}") from None
