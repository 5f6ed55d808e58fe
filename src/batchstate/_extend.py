"""Admitting requests: the empty batch, extend (prefill), and hand-built decode batches."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import chain
from typing import Any, Final, Generic, NamedTuple, TypeAlias, final, overload

import attrs
import numpy as np
import torch
from returns.result import Failure, Result, Success

from batchstate._columns import NO_COLUMNS, C, NoColumns, check_column_set
from batchstate._errors import (
    AllocError,
    BatchConflict,
    ColumnError,
    ContextTooLong,
    EmptyExtend,
    EmptyPrompt,
    NotOwned,
    OutOfKVTokens,
    OutOfReqSlots,
    PhaseError,
)
from batchstate._mirrored import DeviceOnly, HostArray, Mirrored, frozen, host_int64
from batchstate._phases import Extended, Filtered, Idle, Step
from batchstate._pools import Pools
from batchstate._rows import Req, Rows, build_rows

__all__ = ["ExtendError", "Resumed", "extend", "idle", "prebuilt"]

ExtendError: TypeAlias = AllocError | NotOwned


@final
@attrs.frozen(eq=False)
class Resumed:
    """A request whose first tokens already have KV in the slot it owns.

    The prefix length is what the pools hold for `slot`; extend computes the
    rest of `req.input_ids`. This is a chunked prefill between chunks: the
    request was filtered out of its batch and kept its memory.
    """

    req: Req
    slot: int


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
    batch: Idle[NoColumns], reqs: Sequence[Req | Resumed], pools: Pools
) -> Result[Step[Extended[NoColumns]], ExtendError]: ...
@overload
def extend(
    batch: Idle[C], reqs: Sequence[Req | Resumed], pools: Pools, columns: C
) -> Result[Step[Extended[C]], ExtendError]: ...
def extend(  # the overloads above are the API; Any stands for their column set here
    batch: Idle[Any],
    reqs: Sequence[Req | Resumed],
    pools: Pools,
    columns: Any = NO_COLUMNS,
) -> Result[Step[Extended[Any]], ExtendError]:
    """Admit requests for an extend forward: allocate slots and KV, write the table.

    A `Req` gets a new request slot and computes all its input ids; a
    `Resumed` keeps its slot and computes the input ids past its cached
    prefix. Writes the request-to-token table (both sides) once every
    allocation has succeeded.

    Returns:
        `Success(Step(Extended, Pools))`, or a `Failure` naming what ran out
        or which request was bad; the pools given are unchanged either way.

    Args:
        batch: the empty batch, carrying the column set's type.
        reqs: the requests to admit, in row order.
        pools: the pools to allocate from.
        columns: the admitted rows' own columns (one row per request), of
            the set `batch` carries; omitted when it carries none.

    Raises:
        PhaseError: `batch` is not `Idle`.
        BatchConflict: two inputs share a rid or a slot, or `batch` and
            `pools` live on different devices.
        ColumnError: `columns` is not `batch`'s set, or a column has the
            wrong length, dtype or device (nothing is allocated).
    """
    _expect_idle(batch, "extend")
    admitted = _admit(batch, reqs, pools, columns)
    if not isinstance(admitted, _Admitted):
        return Failure(admitted)
    extended = Extended._trusted(
        admitted.rows,
        admitted.input_ids,
        admitted.out_cache_loc,
        admitted.prefix_lens,
        admitted.extend_lens,
        admitted.rows.seq_lens_sum - sum(admitted.prefix_lens),
    )
    return Success(Step(extended, admitted.pools))


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

    Raises:
        PhaseError: `batch` is not `Idle`.
        BatchConflict: two requests share a rid, or `batch` and `pools` live
            on different devices.
        ColumnError: as for `extend`.
    """
    _expect_idle(batch, "prebuilt")
    admitted = _admit(batch, reqs, pools, columns)
    if not isinstance(admitted, _Admitted):
        return Failure(admitted)
    return Success(Step(Filtered(admitted.rows), admitted.pools))


class _Admitted(NamedTuple, Generic[C]):
    rows: Rows[C]
    input_ids: DeviceOnly  # int64 [num_tokens]
    out_cache_loc: DeviceOnly  # int64 [num_tokens]
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    pools: Pools


# Up to this many fresh requests, writing the table row by row beats index tensors.
_MAX_ROW_WRITES: Final = 8


def _admit(
    batch: Idle[C], inputs: Sequence[Req | Resumed], pools: Pools, columns: C
) -> _Admitted[C] | ExtendError:
    pools.table.expect_on(batch.device)
    _expect_columns(batch, columns, len(inputs))
    if not inputs:
        return EmptyExtend()
    if len(inputs) <= _MAX_ROW_WRITES and all(type(item) is Req for item in inputs):
        return _place_fresh(batch, inputs, pools, columns)  # type: ignore[arg-type]  # all Req
    reqs = [item.req if isinstance(item, Resumed) else item for item in inputs]
    _expect_unique([req.rid for req in reqs], "rid")
    resumed_slots = [item.slot for item in inputs if isinstance(item, Resumed)]
    _expect_unique(resumed_slots, "slot")
    cached = [_cached_tokens(pools, item) for item in inputs]
    prefix_lens = [prefix for prefix in cached if not isinstance(prefix, NotOwned)]
    problem = _first_problem(reqs, cached, pools.max_context_len)
    if problem is not None:
        return problem
    allocated = pools._allocate_slots(len(inputs) - len(resumed_slots))
    if isinstance(allocated, OutOfReqSlots):
        return allocated
    return _place(batch, inputs, reqs, prefix_lens, allocated, columns)


def _place_fresh(
    batch: Idle[C], reqs: Sequence[Req], pools: Pools, columns: C
) -> _Admitted[C] | ExtendError:
    # A few new requests, the common extend: every position from 0, so rows
    # take whole pages in order and the table is written one slice per row.
    rids = [req.rid for req in reqs]
    _expect_unique(rids, "rid")
    seq_lens = [len(req.input_ids) for req in reqs]
    longest = max(seq_lens)
    if min(seq_lens) == 0 or longest > pools.max_context_len:
        problem = _first_problem(reqs, [0] * len(reqs), pools.max_context_len)
        assert problem is not None
        return problem
    allocated = pools._allocate_slots(len(reqs))
    if isinstance(allocated, OutOfReqSlots):
        return allocated
    slots, with_slots = allocated
    allocation = with_slots._allocate_fresh(slots, seq_lens)
    if isinstance(allocation, OutOfKVTokens):
        return allocation
    locs, after = allocation
    locs32 = locs.astype(np.int32)
    total = sum(seq_lens)
    rows, (input_ids, out_cache_loc, table_locs) = build_rows(
        batch.device,
        tuple(reqs),
        host_int64(rids),
        slots,
        host_int64(seq_lens),
        total,
        longest,
        columns,
        (_token_ids(reqs, (0,) * len(reqs)), locs, locs32),
    )
    # NOTE: the table write comes last: a failure before it leaves the table as it was.
    after.table.write_rows(slots.tolist(), seq_lens, Mirrored._pair(frozen(locs32), table_locs))
    return _Admitted(
        rows,
        DeviceOnly(input_ids),
        DeviceOnly(out_cache_loc),
        (0,) * len(reqs),
        tuple(seq_lens),
        after,
    )


def _place(  # noqa: PLR0917  # the admission's parts, in the order _admit has them
    batch: Idle[C],
    inputs: Sequence[Req | Resumed],
    reqs: Sequence[Req],
    prefix_lens: Sequence[int],
    allocated: tuple[HostArray, Pools],
    columns: C,
) -> _Admitted[C] | ExtendError:
    new_slots, pools = allocated
    new_slot_iter = iter(new_slots.tolist())
    slots = [item.slot if isinstance(item, Resumed) else next(new_slot_iter) for item in inputs]
    seq_lens = [len(req.input_ids) for req in reqs]
    slots_host = host_int64(slots)
    prefix_host = host_int64(prefix_lens)
    seq_lens_host = host_int64(seq_lens)
    allocation = pools._allocate_tokens(slots_host, prefix_host, seq_lens_host)
    if isinstance(allocation, OutOfKVTokens):
        return allocation
    locs, after = allocation
    extend_lens = seq_lens_host - prefix_host
    rows_of_tokens = np.repeat(np.arange(len(reqs)), extend_lens)
    first_token = np.cumsum(extend_lens) - extend_lens
    positions = prefix_host[rows_of_tokens] + np.arange(locs.shape[0]) - first_token[rows_of_tokens]
    token_slots = slots_host[rows_of_tokens]
    locs32 = locs.astype(np.int32)
    # One host-to-device copy for every column, the table write and the forward.
    rows, (input_ids, out_cache_loc, *cells) = build_rows(
        batch.device,
        tuple(reqs),
        host_int64([req.rid for req in reqs]),
        slots_host,
        seq_lens_host,
        sum(seq_lens),
        max(seq_lens),
        columns,
        (_token_ids(reqs, prefix_lens), locs, token_slots, positions, locs32),
    )
    admitted = _Admitted(
        rows,
        DeviceOnly(input_ids),
        DeviceOnly(out_cache_loc),
        tuple(prefix_lens),
        tuple(extend_lens.tolist()),
        after,
    )
    # NOTE: the table write comes last: a failure before it leaves the table as it was.
    after.table.write(
        *(
            Mirrored._pair(frozen(host), side)
            for host, side in zip((token_slots, positions, locs32), cells, strict=True)
        )
    )
    return admitted


def _token_ids(reqs: Sequence[Req], prefix_lens: Sequence[int]) -> HostArray:
    # The input ids each row computes, back to back.
    if len(reqs) == 1 and not prefix_lens[0]:
        ids = array("q", reqs[0].input_ids)  # `array` converts ints at C speed
    else:
        ids = array(
            "q",
            chain.from_iterable(
                req.input_ids[prefix:] for req, prefix in zip(reqs, prefix_lens, strict=True)
            ),
        )
    return np.frombuffer(ids, dtype=np.int64)


def _first_problem(
    reqs: Sequence[Req], cached: Sequence[int | NotOwned], max_context_len: int
) -> NotOwned | EmptyPrompt | ContextTooLong | None:
    for req, prefix_len in zip(reqs, cached, strict=True):
        if isinstance(prefix_len, NotOwned):
            return prefix_len
        if len(req.input_ids) <= prefix_len:
            return EmptyPrompt(req.rid, len(req.input_ids), prefix_len)
        if len(req.input_ids) > max_context_len:
            return ContextTooLong(req.rid, len(req.input_ids), max_context_len)
    return None


def _cached_tokens(pools: Pools, item: Req | Resumed) -> int | NotOwned:
    if not isinstance(item, Resumed):
        return 0
    owned = int(pools.slot_tokens[item.slot]) if 1 <= item.slot <= pools.max_reqs else 0
    return owned or NotOwned((item.slot,))


def _expect_unique(values: Sequence[int], what: str) -> None:
    if len(set(values)) != len(values):
        repeated = sorted({value for value in values if values.count(value) > 1})
        raise BatchConflict(f"the same {what} appears twice among the requests: {repeated}")


def _expect_columns(batch: Idle[C], columns: C, num_rows: int) -> None:
    # Before any allocation: the admitted rows' columns are the batch's set, of their length.
    if type(columns) is not type(batch.rows.columns):
        raise ColumnError(
            f"the batch carries {type(batch.rows.columns).__name__} columns,"
            f" got {type(columns).__name__}"
        )
    check_column_set(columns, num_rows, batch.device, "columns")


def _expect_idle(batch: object, transition: str) -> None:
    if not isinstance(batch, Idle):
        raise PhaseError(f"{transition} starts from Idle, got {type(batch).__name__}")


def _resolve(device: torch.device) -> torch.device:
    # Tensors report `cuda:0` where asked for `cuda`: take the device a tensor
    # reports, so that record checks compare equal.
    return torch.empty(0, device=device).device
