"""Admitting requests: the empty batch (`idle`), `extend` (prefill) and `admit_prefilled` batches.

In this module, top to bottom: how many of the requests an admission was
offered the pools would take, for its failure (`extend` and `admit_prefilled`
admit all of their inputs or none; when the pools run short, the failure
says how many, from the first, would have fitted, so that a scheduler can
offer exactly those; `mix` counts its own in `transitions.mixing`); the
checks of the inputs; laying admitted requests out as rows (KV locations,
pages published to the prefix cache, every mirror in one host-to-device
copy, the request-to-token table written last, so that a failure before it
leaves the table as it was); and the public transitions.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import chain
from typing import Any, Final, Generic, NamedTuple, overload

import attrs
import numpy as np
import torch
from returns.result import Failure, Result, Success

from batchstate.base.errors import (
    BatchConflict,
    ColumnError,
    ContextTooLong,
    EmptyExtend,
    EmptyPrompt,
    ExtendError,
    OutOfKVTokens,
    OutOfReqSlots,
    PhaseError,
)
from batchstate.base.mirrored import DeviceOnly, HostArray, Mirrored, frozen, host_int64
from batchstate.cache.sharing import prefix_cells
from batchstate.columns.arguments import check_column_set, owned_host_columns
from batchstate.columns.columns import NO_COLUMNS, C, NoColumns
from batchstate.columns.rows import join_pending
from batchstate.pools.pools import ExtendRows, Pools, expect_pools
from batchstate.records.chunked import Chunked, columns_in_order
from batchstate.records.phases import BatchAndPools, Extended, Filtered, Idle
from batchstate.records.rows import Req, Rows, build_rows, expect_token_ids, pack_ints

__all__ = ["ExtendError", "admit_prefilled", "extend", "extend_fits", "idle"]


def extend_fits(inputs: Sequence[Req | Chunked[C]], pools: Pools, *, match: bool) -> int:
    """The most of `inputs`, from the first, whose slots and KV the pools have (0: none).

    `match`: new requests read their cached prefixes first (`extend`), or not
    (`admit_prefilled`). Fewer inputs never need more, so the first count that fits,
    counting down, is the most.
    """
    with pools.memory.probing():
        for count in range(len(inputs) - 1, 0, -1):
            if _allocates(inputs[:count], pools, match=match):
                return count
    return 0


def _allocates(inputs: Sequence[Req | Chunked[C]], pools: Pools, *, match: bool) -> bool:
    # As `extend` allocates: slots for the new requests (their cached prefixes locked
    # first), then every row's KV from its prefix to its prompt's end.
    new_ids = [item.input_ids for item in inputs if isinstance(item, Req)]
    if len(new_ids) > pools.num_free_slots:
        return False
    locked, matched, _ = (
        pools.lock_cached_prefixes(new_ids) if match else (pools, [0] * len(new_ids), [])
    )
    taken = locked.take_slots(len(new_ids))
    if isinstance(taken, OutOfReqSlots):
        return False
    new_slots, with_slots = taken
    if match and any(matched):  # hybrid pools: window starts at the anchors' tails
        with_slots = with_slots.resume_rows(new_slots.tolist(), new_ids, matched)
    next_slot, next_match = iter(new_slots.tolist()), iter(matched)
    slots: list[int] = []
    prefix: list[int] = []
    seq_lens: list[int] = []
    for item in inputs:
        if isinstance(item, Req):
            slots.append(next(next_slot))
            prefix.append(next(next_match))
            seq_lens.append(len(item.input_ids))
        else:
            slots.append(item.slot)
            prefix.append(item.cached)
            seq_lens.append(len(item.req.input_ids))
    lengths = host_int64(seq_lens)
    # `admit_prefilled` (no match) takes window pages for each window's tail only, as it admits.
    reads_from = None if match else lengths
    allocation = with_slots.take_tokens(host_int64(slots), host_int64(prefix), lengths, reads_from)
    return not isinstance(allocation, OutOfKVTokens)


# The checks `extend` and `admit_prefilled` run on their inputs before anything is allocated.


def _first_problem(
    reqs: Sequence[Req], cached: Sequence[int], max_context_len: int
) -> EmptyPrompt | ContextTooLong | None:
    for req, prefix_len in zip(reqs, cached, strict=True):
        if len(req.input_ids) <= prefix_len:
            return EmptyPrompt(req.rid, len(req.input_ids), prefix_len)
        if len(req.input_ids) > max_context_len:
            return ContextTooLong(req.rid, len(req.input_ids), max_context_len)
    return None


def _expect_unique(values: Sequence[int], what: str) -> None:
    if len(set(values)) != len(values):
        repeated = sorted({value for value in values if values.count(value) > 1})
        raise BatchConflict(f"the same {what} appears twice among the requests: {repeated}")


def _expect_columns(batch: Idle[C], columns: C, inputs: Sequence[Req | Chunked[C]]) -> None:
    # Before any allocation: the new rows' columns are the batch's set, one row per
    # `Req`, and each chunk's own row is of that set too.
    kind = type(batch.rows.columns)
    if type(columns) is not kind:
        raise ColumnError(
            f"the batch carries {kind.__name__} columns, got {type(columns).__name__}"
        )
    held = [item for item in inputs if isinstance(item, Chunked)]
    check_column_set(columns, len(inputs) - len(held), batch.device, "columns")
    for item in held:
        if type(item.columns) is not kind:
            raise ColumnError(
                f"request {item.req.rid}'s chunk carries {type(item.columns).__name__}"
                f" columns, the batch {kind.__name__}"
            )
        check_column_set(item.columns, 1, batch.device, f"request {item.req.rid}'s chunk")


# Laying admitted requests out as rows: KV locations, published pages, mirrors, the table write.


class _Admitted(NamedTuple, Generic[C]):
    rows: Rows[C]
    input_ids: DeviceOnly  # int64 [num_tokens]
    out_cache_loc: DeviceOnly  # int64 [num_tokens]
    prefix_lens: HostArray  # read-only int64 [num_reqs]
    extend_lens: HostArray  # read-only int64 [num_reqs]
    num_computed: int  # extend_lens.sum(), the tokens the forward computes
    pools: Pools


class _Matched(NamedTuple):
    # The new requests' cached prefixes, locked: lengths and pages, in input order.
    lengths: list[int]
    pages: list[HostArray]


def _place_fresh(
    batch: Idle[C], reqs: Sequence[Req], pools: Pools, columns: C, *, transferred: bool
) -> _Admitted[C] | ExtendError:
    # A few new requests with the cache off, the common extend: every position from 0,
    # so rows take whole pages in order and the table is written one slice per row.
    rids = [req.rid for req in reqs]
    _expect_unique(rids, "rid")
    seq_lens = [len(req.input_ids) for req in reqs]
    longest = max(seq_lens)
    if min(seq_lens) == 0 or longest > pools.max_context_len:
        problem = _first_problem(reqs, [0] * len(reqs), pools.max_context_len)
        assert problem is not None
        return problem
    allocated = pools.take_slots(len(reqs))
    if isinstance(allocated, OutOfReqSlots):
        return allocated
    slots, with_slots = allocated
    allocation = with_slots.take_fresh(slots, seq_lens, transferred=transferred)
    if isinstance(allocation, OutOfKVTokens):
        return allocation
    locs, after = allocation
    locs32 = locs.astype(np.int32)
    total = sum(seq_lens)
    ids = _token_ids(reqs, (0,) * len(reqs))
    expect_token_ids(ids, reqs)  # nothing written, nothing committed yet
    rows, (input_ids, out_cache_loc, table_locs) = build_rows(
        batch.device,
        tuple(reqs),
        pack_ints(host_int64(seq_lens), slots, host_int64(rids), with_slots.slot_gens[slots]),
        None,
        total,
        longest,
        columns,
        (ids, locs, locs32),
    )
    # NOTE: the table write comes last: a failure before it leaves the table as it was.
    after.table.write_rows(slots.tolist(), seq_lens, Mirrored.trusted(frozen(locs32), table_locs))
    return _Admitted(
        rows,
        DeviceOnly(input_ids),
        DeviceOnly(out_cache_loc),
        _no_prefix(len(reqs)),
        rows.seq_lens.host,  # every token is computed: the rows' own read-only lengths
        total,
        after,
    )


def _place(  # noqa: PLR0917  # the admission's parts, in the order _admit has them
    batch: Idle[C],
    inputs: Sequence[Req | Chunked[C]],
    reqs: Sequence[Req],
    cached: Sequence[int],
    matched: _Matched,
    allocated: tuple[HostArray, Pools],
    columns: C,
    *,
    retire: bool,  # a forward computes the pages (not `admit_prefilled`): duplicates are retired
) -> _Admitted[C] | ExtendError:
    new_slots, pools = allocated
    new_slot_iter = iter(new_slots.tolist())
    slots = [item.slot if isinstance(item, Chunked) else next(new_slot_iter) for item in inputs]
    # Each row's prefix: what its chunk holds, or what it reads from the cache.
    matched_iter = iter(matched.lengths)
    prefix_lens = [
        held if isinstance(item, Chunked) else next(matched_iter)
        for item, held in zip(inputs, cached, strict=True)
    ]
    seq_lens = [len(req.input_ids) for req in reqs]
    new_rows = [row for row, item in enumerate(inputs) if not isinstance(item, Chunked)]
    slots_host = host_int64(slots)
    prefix_host = host_int64(prefix_lens)
    seq_lens_host = host_int64(seq_lens)
    if retire and any(matched.lengths):  # hybrid pools: new rows resume from anchors
        pools = pools.resume_rows(
            [slots[row] for row in new_rows],
            [reqs[row].input_ids for row in new_rows],
            matched.lengths,
        )
    # Rows no forward computes here (`admit_prefilled`) are first read by their next decode,
    # at `seq_len`: they take window pages for their window's tail only.
    reads_from = None if retire else seq_lens_host
    allocation = pools.take_tokens(slots_host, prefix_host, seq_lens_host, reads_from)
    if isinstance(allocation, OutOfKVTokens):
        return allocation
    locs, after = allocation
    extend_lens = seq_lens_host - prefix_host
    rows_of_tokens = np.repeat(np.arange(len(reqs)), extend_lens)
    first_token = np.cumsum(extend_lens) - extend_lens
    positions = prefix_host[rows_of_tokens] + np.arange(locs.shape[0]) - first_token[rows_of_tokens]
    token_slots = slots_host[rows_of_tokens]
    locs32 = locs.astype(np.int32)
    # Each row's whole pages go into the cache, or its cells move onto the cache's copy.
    after, (token_slots, positions, locs32) = after.publish_computed(
        [
            (slots[row], reqs[row].input_ids[:length])
            for row, length in zip(new_rows, matched.lengths, strict=True)
        ],
        ExtendRows(slots, [req.input_ids for req in reqs], prefix_lens, first_token.tolist()),
        (token_slots, positions, locs32),
        retire=retire,
    )
    if retire:  # hybrid pools: an anchor at each row's last page boundary, where there is room
        after = after.publish_tails(slots, [req.input_ids for req in reqs], prefix_lens)
    if any(matched.lengths):
        # Rows that read a cached prefix: their table cells there are the cache's pages.
        prefix_rows = [
            (slots[row], pages) for row, pages in zip(new_rows, matched.pages, strict=True)
        ]
        token_slots, positions, locs32 = prefix_cells(
            prefix_rows, pools.page_size, (token_slots, positions, locs32)
        )
    ids = _token_ids(reqs, prefix_lens)
    expect_token_ids(ids, reqs)  # nothing written, nothing committed yet
    # One host-to-device copy for every column, the table write and the forward.
    rows, (input_ids, out_cache_loc, *cells) = build_rows(
        batch.device,
        tuple(reqs),
        pack_ints(
            seq_lens_host,
            slots_host,
            host_int64([req.rid for req in reqs]),
            pools.slot_gens[slots_host],  # the chunks' own, checked equal, and the new
        ),
        None,
        sum(seq_lens),
        max(seq_lens),
        join_pending(columns_in_order(inputs, columns) or [columns]),
        (ids, locs, token_slots, positions, locs32),
    )
    # NOTE: the table write comes last: a failure before it leaves the table as it was.
    after.table.write(
        Mirrored.trusted(frozen(token_slots), cells[0]),
        Mirrored.trusted(frozen(positions), cells[1]),
        Mirrored.trusted(frozen(locs32), cells[2]),
    )
    return _Admitted(
        rows,
        DeviceOnly(input_ids),
        DeviceOnly(out_cache_loc),
        frozen(prefix_host),
        frozen(extend_lens),
        int(extend_lens.sum()),
        after,
    )


def _no_prefix(num_reqs: int) -> HostArray:
    # Read-only zeros: a fresh extend's prefix lengths. Each record gets its own: a
    # shared array written through `torch.as_tensor` would change every record's.
    return frozen(np.zeros(num_reqs, dtype=np.int64))


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


# The public transitions: the empty batch, extend (prefill), and batches whose KV arrives.


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
) -> Result[BatchAndPools[Extended[NoColumns]], ExtendError]: ...
@overload
def extend(
    batch: Idle[C], reqs: Sequence[Req | Chunked[C]], pools: Pools, columns: C
) -> Result[BatchAndPools[Extended[C]], ExtendError]: ...
def extend(  # the overloads above are the API; Any stands for their column set here
    batch: Idle[Any],
    reqs: Sequence[Req | Chunked[Any]],
    pools: Pools,
    columns: Any = NO_COLUMNS,
) -> Result[BatchAndPools[Extended[Any]], ExtendError]:
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
        `Success(BatchAndPools(Extended, Pools))`, or a `Failure` naming what ran out
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
    extended = Extended.trusted(
        admitted.rows,
        admitted.input_ids,
        admitted.out_cache_loc,
        admitted.prefix_lens,
        admitted.extend_lens,
        admitted.num_computed,
    )
    return Success(BatchAndPools(extended, admitted.pools.commit()))


@overload
def admit_prefilled(
    batch: Idle[NoColumns], reqs: Sequence[Req], pools: Pools
) -> Result[BatchAndPools[Filtered[NoColumns]], ExtendError]: ...
@overload
def admit_prefilled(
    batch: Idle[C], reqs: Sequence[Req], pools: Pools, columns: C
) -> Result[BatchAndPools[Filtered[C]], ExtendError]: ...
def admit_prefilled(  # the overloads above are the API; Any stands for their column set here
    batch: Idle[Any], reqs: Sequence[Req], pools: Pools, columns: Any = NO_COLUMNS
) -> Result[BatchAndPools[Filtered[Any]], ExtendError]:
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
    _expect_idle(batch, "admit_prefilled")
    admitted = _admit(batch, reqs, pools, columns, match=False)
    if not isinstance(admitted, _Admitted):
        return Failure(admitted)
    return Success(BatchAndPools(Filtered(admitted.rows), admitted.pools.commit()))


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
        not_held = item.not_held(pools)
        if not_held is not None:
            return not_held
    cached = [item.cached if isinstance(item, Chunked) else 0 for item in inputs]
    problem = _first_problem(reqs, cached, pools.max_context_len)
    if problem is not None:
        return problem
    num_new = len(inputs) - len(held)
    new_ids = [item.input_ids for item in inputs if not isinstance(item, Chunked)]
    locked, matched, pages = (
        pools.lock_cached_prefixes(new_ids) if match else (pools, [0] * num_new, [])
    )
    allocated = locked.take_slots(num_new)  # too few free slots (or states): nothing taken
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
