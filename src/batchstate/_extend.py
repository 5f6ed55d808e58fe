"""Admitting requests: the empty batch, extend (prefill), and hand-built decode batches.

The public transitions and the admission that checks their inputs and takes
slots; laying the admitted rows out is `_extend_placement.py`'s, the input
checks are `_extend_checks.py`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, TypeAlias, overload

import attrs
import torch
from returns.result import Failure, Result, Success

from batchstate._admissible import extend_fits
from batchstate._chunked import Chunked
from batchstate._column_checks import owned_host_columns
from batchstate._columns import NO_COLUMNS, C, NoColumns
from batchstate._errors import (
    AllocError,
    EmptyExtend,
    NotHeld,
    OutOfKVTokens,
    OutOfReqSlots,
    PhaseError,
)
from batchstate._extend_checks import _expect_columns, _expect_unique, _first_problem
from batchstate._extend_placement import _Admitted, _Matched, _place, _place_fresh
from batchstate._phases import Extended, Filtered, Idle, Step
from batchstate._pool_allocation import take_slots
from batchstate._pool_prefixes import lock_cached_prefixes
from batchstate._pools import Pools, expect_pools
from batchstate._rows import Req, Rows

__all__ = ["ExtendError", "extend", "idle", "prebuilt"]

ExtendError: TypeAlias = AllocError | NotHeld


@overload
def idle(device: torch.device | str) -> Idle[NoColumns]: ...
@overload
def idle(device: torch.device | str, columns: type[C]) -> Idle[C]: ...
def idle(device: torch.device | str, columns: type[Any] = NoColumns) -> Idle[Any]:
    """The canonical empty batch on `device`, carrying the column set `columns` (none by default).

    >>> idle("cpu").rows.seq_lens_sum
    0
    """
    return Idle(Rows.empty(_resolve(torch.device(device)), columns))


@overload
def extend(
    batch: Idle[NoColumns], reqs: Sequence[Req | Chunked[NoColumns]], pools: Pools
) -> Result[Step[Extended[NoColumns]], ExtendError]: ...
@overload
def extend(
    batch: Idle[C], reqs: Sequence[Req | Chunked[C]], pools: Pools, columns: C
) -> Result[Step[Extended[C]], ExtendError]: ...
def extend(  # the overloads above are the API; Any stands for their column set here
    batch: Idle[Any],
    reqs: Sequence[Req | Chunked[Any]],
    pools: Pools,
    columns: Any = NO_COLUMNS,
) -> Result[Step[Extended[Any]], ExtendError]:
    """Admit requests for an extend forward: allocate slots and KV, write the table.

    A `Req` gets a new request slot and computes all its input ids; a
    `Chunked` keeps its slot and computes the input ids past what it holds.
    With the prefix cache on, a `Req` first reads its longest cached prefix
    (whole pages, leaving at least one token to compute) and computes only
    the rest; free pages that run short are evicted from the cache; and
    each row's whole pages are published to the cache, so that later
    requests with the same prefix hit them (their KV is written by the
    forward this record is for, which runs before any later one). Requests
    of one extend that share an uncached prefix each compute it; a row
    whose whole pages the cache holds already (an earlier row published
    them) reads the cache's pages from then on, its cells moved there and
    its own pages retired (`Pools.retired`). Writes the request-to-token
    table (both sides) once every allocation has succeeded.

    Returns:
        `Success(Step(Extended, Pools))`, or a `Failure` naming what ran out
        or which request was bad (`NotHeld`: a chunk its slot no longer
        holds); the pools given are unchanged either way.

    Args:
        batch: the empty batch, carrying the column set's type.
        reqs: the requests to admit, in row order.
        pools: the pools to allocate from.
        columns: the new requests' own columns (one row per `Req`; a
            `Chunked` carries its own row), of the set `batch` carries;
            omitted when it carries none.

    Raises:
        PhaseError: `batch` is not `Idle`.
        BatchConflict: two inputs share a rid or a slot, or `batch` and
            `pools` live on different devices.
        ColumnError: `columns` is not `batch`'s set, or a column has the
            wrong length, dtype or device (nothing is allocated).
    """
    _expect_idle(batch, "extend")
    admitted = _admit(batch, reqs, pools, columns, match=True)
    if not isinstance(admitted, _Admitted):
        return Failure(admitted)
    extended = Extended._trusted(
        admitted.rows,
        admitted.input_ids,
        admitted.out_cache_loc,
        admitted.prefix_lens,
        admitted.extend_lens,
        admitted.num_computed,
    )
    return Success(Step(extended, admitted.pools._commit()))


@overload
def prebuilt(
    batch: Idle[NoColumns], reqs: Sequence[Req], pools: Pools
) -> Result[Step[Filtered[NoColumns]], ExtendError]: ...
@overload
def prebuilt(
    batch: Idle[C], reqs: Sequence[Req], pools: Pools, columns: C
) -> Result[Step[Filtered[C]], ExtendError]: ...
def prebuilt(  # the overloads above are the API; Any stands for their column set here
    batch: Idle[Any], reqs: Sequence[Req], pools: Pools, columns: Any = NO_COLUMNS
) -> Result[Step[Filtered[Any]], ExtendError]:
    """A decode-ready batch whose KV arrives from elsewhere (disaggregated prefill).

    Allocates a slot and KV for every input id of each request and builds
    every mirror, like `extend`, but runs no forward: the caller fills the
    KV at `pools.table.device[slot, :seq_len]` for each row, then decodes.
    On hybrid pools each row also takes a state slot, and window pages for
    its window's tail only (the positions its next decode reads): where
    the caller writes each kind is `transfer_targets(batch, pools)`.
    With the prefix cache on nothing is read from it (the KV arrives
    whole), and each row's whole pages are published as `extend` does.

    Raises:
        PhaseError: `batch` is not `Idle`.
        BatchConflict: two requests share a rid, or `batch` and `pools` live
            on different devices.
        ColumnError: as for `extend`.
    """
    _expect_idle(batch, "prebuilt")
    admitted = _admit(batch, reqs, pools, columns, match=False)
    if not isinstance(admitted, _Admitted):
        return Failure(admitted)
    return Success(Step(Filtered(admitted.rows), admitted.pools._commit()))


# Up to this many fresh requests, writing the table row by row beats index tensors.
_MAX_ROW_WRITES: Final = 8


def _admit(
    batch: Idle[C],
    inputs: Sequence[Req | Chunked[C]],
    pools: Pools,
    columns: C,
    *,
    match: bool,
) -> _Admitted[C] | ExtendError:
    columns = owned_host_columns(columns)  # a view of the caller's writable array: copied
    admitted = _admit_all(batch, inputs, pools, columns, match=match)
    if isinstance(admitted, OutOfReqSlots | OutOfKVTokens):  # say how many would fit
        return attrs.evolve(admitted, fits=extend_fits(inputs, pools, match=match))
    return admitted


def _admit_all(
    batch: Idle[C],
    inputs: Sequence[Req | Chunked[C]],
    pools: Pools,
    columns: C,
    *,
    match: bool,
) -> _Admitted[C] | ExtendError:
    expect_pools(pools)
    pools.table.expect_on(batch.device)
    _expect_columns(batch, columns, inputs)
    if not inputs:
        return EmptyExtend()
    fresh = all(type(item) is Req for item in inputs)
    if fresh and len(inputs) <= _MAX_ROW_WRITES and not pools.cache.enabled:
        return _place_fresh(batch, inputs, pools, columns, transferred=not match)  # type: ignore[arg-type]  # all Req
    reqs = [item.req if isinstance(item, Chunked) else item for item in inputs]
    _expect_unique([req.rid for req in reqs], "rid")
    held = [item for item in inputs if isinstance(item, Chunked)]
    _expect_unique([item.slot for item in held], "slot")
    for item in held:
        not_held = item._not_held(pools)
        if not_held is not None:
            return not_held
    cached = [item.cached if isinstance(item, Chunked) else 0 for item in inputs]
    problem = _first_problem(reqs, cached, pools.max_context_len)
    if problem is not None:
        return problem
    num_new = len(inputs) - len(held)
    new_ids = [item.input_ids for item in inputs if not isinstance(item, Chunked)]
    locked, matched, pages = (
        lock_cached_prefixes(pools, new_ids) if match else (pools, [0] * num_new, [])
    )
    allocated = take_slots(locked, num_new)  # too few free slots (or states): nothing taken
    if isinstance(allocated, OutOfReqSlots):
        return allocated
    return _place(
        batch, inputs, reqs, cached, _Matched(matched, pages), allocated, columns, retire=match
    )


def _expect_idle(batch: object, transition: str) -> None:
    if not isinstance(batch, Idle):
        raise PhaseError(f"{transition} starts from Idle, got {type(batch).__name__}")


def _resolve(device: torch.device) -> torch.device:
    # Tensors report `cuda:0` where asked for `cuda`: take the device a tensor
    # reports, so that record checks compare equal.
    return torch.empty(0, device=device).device
