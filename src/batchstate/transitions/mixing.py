"""`mix` and `decode_sampled`: one forward of prompt chunks and running decode rows.

The layout is `Mixed`'s: extend rows first, then the running rows as
one-token extends. A chunk budget caps the extend tokens: requests are
taken in order, each computes as much of its prompt as the budget has
left, and the last one taken may stop part way.

In this module, top to bottom: choosing the chunks a budget admits
(`_fill`) and building their rows with the running ones (`_build`: slots
and KV, what the chunks compute published to the prefix cache, every
mirror in one host-to-device copy, the table written last); the checks of
`mix`'s inputs; and the public transitions.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any, NamedTuple, TypeAlias, overload

import attrs
import numpy as np
import numpy.typing as npt
import torch
from immutables import Map
from returns.result import Failure, Result, Success

from batchstate.base.errors import (
    BatchConflict,
    ColumnError,
    ContextTooLong,
    EmptyExtend,
    EmptyPrompt,
    MixError,
    NoChunkBudget,
    NotHeld,
    OutOfKVTokens,
    OutOfReqSlots,
    PhaseError,
)
from batchstate.base.expect import expect_instance
from batchstate.base.mirrored import (
    NO_INTS,
    DeviceOnly,
    HostArray,
    Mirrored,
    frozen,
    host_int64,
    same,
)
from batchstate.cache.sharing import prefix_cells
from batchstate.columns.arguments import check_column_set, owned_host_columns
from batchstate.columns.columns import NO_COLUMNS, C, NoColumns
from batchstate.columns.rows import join_pending
from batchstate.pools.pools import ExtendRows, Pools, expect_pools
from batchstate.records.chunked import Chunked, columns_in_order
from batchstate.records.mixed import Mixed, MixStep
from batchstate.records.phases import Filtered, Idle
from batchstate.records.rows import (
    Req,
    Rows,
    build_rows,
    expect_current,
    expect_token_ids,
    pack_ints,
)
from batchstate.transitions.decoding import DecodeError, _too_long, grow
from batchstate.transitions.sampled import Sampled

__all__ = ["MixError", "Tokens", "decode_sampled", "mix"]


# The running rows' input tokens: host ints, or the last forward's tokens left on the device.
Tokens: TypeAlias = Sequence[int] | Sampled


class _Chunks(NamedTuple):
    # The admitted prefix of `admit`: requests, whether each is new, prefix and extend lengths.
    reqs: tuple[Req, ...]
    slots: list[int]  # 0 for a new request (a slot comes from the pools)
    prefix_lens: list[int]  # a chunk's held tokens, or a new request's cached prefix
    extend_lens: list[int]
    prefix_pages: list[HostArray]  # each new request's cached prefix pages, in order


def _fill(
    admit: Sequence[Req | Chunked[C]], budget: int, pools: Pools, caps: Mapping[int, int]
) -> _Chunks:
    reqs: list[Req] = []
    slots, prefix_lens, extend_lens = [], [], []
    prefix_pages: list[HostArray] = []
    left = budget
    cache = pools.cache
    for item in admit:
        if not left:
            break
        if isinstance(item, Chunked):
            req, slot, cached = item.req, item.slot, item.cached
        else:
            req, slot = item, 0
            # A cap keeps whole pages (a page is read from the cache or not at all) and, on
            # hybrid pools, an anchor: a prefix is never read where its tail is not kept.
            cap = caps.get(req.rid)
            cached, pages = (
                pools.usable_prefix(req.input_ids, cap) if cache.enabled else (0, NO_INTS)
            )
            prefix_pages.append(pages)
        take = min(len(req.input_ids) - cached, left)
        left -= take
        reqs.append(req)
        slots.append(slot)
        prefix_lens.append(cached)
        extend_lens.append(take)
    return _Chunks(tuple(reqs), slots, prefix_lens, extend_lens, prefix_pages)


def _build(
    rows: Rows[C], chunks: _Chunks, pools: Pools, tokens: Tokens, extend_columns: Sequence[C]
) -> MixStep[C] | OutOfReqSlots | OutOfKVTokens:
    allocated = _allocate(rows, chunks, pools)
    if isinstance(allocated, OutOfReqSlots | OutOfKVTokens):
        return attrs.evolve(allocated, fits=_fits(rows, chunks, pools))
    new_slots, slots, prefix, extend_lens, seq_lens, locs, after = allocated
    new_ids = [
        req.input_ids for req, slot in zip(chunks.reqs, chunks.slots, strict=True) if not slot
    ]
    matched = [
        length for length, slot in zip(chunks.prefix_lens, chunks.slots, strict=True) if not slot
    ]
    prefix_pages = chunks.prefix_pages
    num_extend = len(chunks.reqs)
    extend_slots = slots[:num_extend].tolist()
    num_tokens = locs.shape[0]
    token_rows = np.repeat(np.arange(slots.shape[0]), extend_lens)
    first = np.cumsum(extend_lens) - extend_lens
    positions = prefix[token_rows] + np.arange(num_tokens) - first[token_rows]
    token_slots = slots[token_rows]
    cells: tuple[HostArray, HostArray, npt.NDArray[np.int32]] = (
        token_slots,
        positions,
        locs.astype(np.int32),
    )  # the table write's
    if num_extend:
        # Each chunk's end: its whole pages go into the cache and its lock moves to them,
        # or, where the cache holds them already, its cells move onto the cache's copy.
        ends = seq_lens[:num_extend].tolist()
        after, cells = after.publish_computed(
            [
                (slot, ids[:length])
                for slot, ids, length in zip(new_slots, new_ids, matched, strict=True)
            ],
            ExtendRows(
                extend_slots,
                chunk_tokens := [
                    req.input_ids[:end] for req, end in zip(chunks.reqs, ends, strict=True)
                ],
                chunks.prefix_lens,
                first[:num_extend].tolist(),
            ),
            cells,
            retire=True,
        )
        # Hybrid pools: an anchor at each chunk's last page boundary, where there is room.
        after = after.publish_tails(extend_slots, chunk_tokens, chunks.prefix_lens)
    if any(matched):  # new rows read a cached prefix: their cells there are the cache's pages
        cells = prefix_cells(
            list(zip(new_slots, prefix_pages, strict=True)), pools.page_size, cells
        )
    extend_ids = _prompt_ids(chunks)
    on_device = isinstance(tokens, Sampled)
    input_ids = (
        extend_ids
        if on_device
        else np.concatenate((extend_ids, np.asarray(tokens, dtype=np.int64)))
    )
    host_tokens = () if isinstance(tokens, Sampled) else tokens
    expect_token_ids(input_ids, chunks.reqs, host_tokens)  # nothing written yet
    # The table's position cells are the forward's positions, uploaded once, unless cells
    # were added (cached prefixes read, earlier chunks' cells moved onto the cache's pages).
    shared = cells[1] is positions
    seq_lens_sum = rows.seq_lens_sum + len(rows) + sum(chunks.prefix_lens) + sum(chunks.extend_lens)
    built, (ids_side, locs_side, positions_side, *cell_sides) = build_rows(
        rows.device,
        chunks.reqs + rows.reqs,
        pack_ints(
            seq_lens,
            slots,
            np.concatenate((host_int64([req.rid for req in chunks.reqs]), rows.rids)),
            rows.gens if not num_extend else after.slot_gens[slots],
        ),
        rows.req_pool_indices if not num_extend else None,
        seq_lens_sum,
        int(seq_lens.max()) if seq_lens.shape[0] else 0,
        join_pending([*extend_columns, rows.columns]),  # the running rows' columns last
        (input_ids, locs, positions, cells[0], cells[2])
        if shared
        else (input_ids, locs, positions, *cells),
    )
    if shared:
        cell_sides.insert(1, positions_side)
    if isinstance(tokens, Sampled):
        # The host does not know these tokens: append them on the device.
        sampled = tokens.tokens.device
        ids_side = torch.cat((ids_side, sampled)) if num_extend else sampled
    # NOTE: the table write comes last: a failure before it leaves the table as it was.
    after.table.write(
        Mirrored.trusted(frozen(cells[0]), cell_sides[0]),
        Mirrored.trusted(frozen(cells[1]), cell_sides[1]),
        Mirrored.trusted(frozen(cells[2]), cell_sides[2]),
    )
    partial = tuple(
        row
        for row, (req, length) in enumerate(zip(chunks.reqs, seq_lens.tolist(), strict=False))
        if length < len(req.input_ids)
    )
    mixed = Mixed.trusted(
        built,
        DeviceOnly(ids_side),
        DeviceOnly(positions_side),
        DeviceOnly(locs_side),
        frozen(prefix),
        frozen(extend_lens),
        num_extend,
        sum(chunks.extend_lens),
        partial,
    )
    return MixStep(mixed, after.commit())


_Allocated: TypeAlias = tuple[
    list[int], HostArray, HostArray, HostArray, HostArray, HostArray, Pools
]


def _allocate(
    rows: Rows[C], chunks: _Chunks, pools: Pools
) -> _Allocated | OutOfReqSlots | OutOfKVTokens:
    # The slots and KV of the chunks and of the running rows' one token each, in new
    # pools not yet committed (nothing written): new slots, every row's slot, prefix,
    # extend and sequence lengths, the KV locations, the pools after.
    num_new = chunks.slots.count(0)
    new_slots: list[int] = []
    if num_new:
        if num_new > pools.num_free_slots:
            return OutOfReqSlots(num_new, pools.num_free_slots)
        new_ids = [
            req.input_ids for req, slot in zip(chunks.reqs, chunks.slots, strict=True) if not slot
        ]
        matched = [
            length
            for length, slot in zip(chunks.prefix_lens, chunks.slots, strict=True)
            if not slot
        ]
        pools = pools.lock_matched_prefixes(new_ids, matched)
        allocated = pools.take_slots(num_new)
        if isinstance(allocated, OutOfReqSlots):  # hybrid pools: fewer state slots than slots
            return allocated
        taken, pools = allocated
        new_slots = taken.tolist()
        pools = pools.resume_rows(new_slots, new_ids, matched)  # hybrid pools: from anchors
    next_new = iter(new_slots)
    extend_slots = [slot or next(next_new) for slot in chunks.slots]
    slots = np.concatenate((host_int64(extend_slots), rows.req_pool_indices.host))
    prefix = np.concatenate((host_int64(chunks.prefix_lens), rows.seq_lens.host))
    extend_lens = np.concatenate(
        (host_int64(chunks.extend_lens), np.ones(len(rows), dtype=np.int64))
    )
    seq_lens = prefix + extend_lens
    allocation = pools.take_tokens(slots, prefix, seq_lens)
    if isinstance(allocation, OutOfKVTokens):
        return allocation
    locs, after = allocation
    return new_slots, slots, prefix, extend_lens, seq_lens, locs, after


def _fits(rows: Rows[C], chunks: _Chunks, pools: Pools) -> int:
    # How many of the chunks, from the first, the pools take beside the running rows:
    # the allocation alone, tried on ever fewer (uncommitted, nothing written).
    with pools.memory.probing():
        for count in range(len(chunks.reqs) - 1, 0, -1):
            num_new = chunks.slots[:count].count(0)
            fewer = _Chunks(
                chunks.reqs[:count],
                chunks.slots[:count],
                chunks.prefix_lens[:count],
                chunks.extend_lens[:count],
                chunks.prefix_pages[:num_new],
            )
            if not isinstance(_allocate(rows, fewer, pools), OutOfReqSlots | OutOfKVTokens):
                return count
    return 0


def _prompt_ids(chunks: _Chunks) -> HostArray:
    ids = array(
        "q",
        chain.from_iterable(
            req.input_ids[prefix : prefix + length]
            for req, prefix, length in zip(
                chunks.reqs, chunks.prefix_lens, chunks.extend_lens, strict=True
            )
        ),
    )
    return np.frombuffer(ids, dtype=np.int64) if ids else np.empty(0, dtype=np.int64)


# The checks `mix` and `decode_sampled` run on their inputs before anything is allocated.


def _problem(item: Req | Chunked[C], pools: Pools) -> NotHeld | EmptyPrompt | ContextTooLong | None:
    req, cached = (item.req, item.cached) if isinstance(item, Chunked) else (item, 0)
    if isinstance(item, Chunked):
        problem = item.not_held(pools)
        if problem is not None:
            return problem
    if len(req.input_ids) <= cached:
        return EmptyPrompt(req.rid, len(req.input_ids), cached)
    if len(req.input_ids) > pools.max_context_len:
        return ContextTooLong(req.rid, len(req.input_ids), pools.max_context_len)
    return None


def _expect_disjoint(admit: Sequence[Req | Chunked[C]], rows: Rows[C]) -> None:
    rids = [item.req.rid if isinstance(item, Chunked) else item.rid for item in admit]
    rids += rows.rids.tolist()
    slots = [item.slot for item in admit if isinstance(item, Chunked)]
    slots += rows.req_pool_indices.host.tolist()
    for values, what in ((rids, "rid"), (slots, "slot")):
        if len(set(values)) != len(values):
            repeated = sorted({value for value in values if values.count(value) > 1})
            raise BatchConflict(
                f"the same {what} appears twice among the chunks and running rows: {repeated}"
            )


def _expect_tokens(tokens: Tokens, rows: Rows[C]) -> None:
    if isinstance(tokens, Sampled):
        if not same(tokens.rids, rows.rids):
            raise BatchConflict(
                f"sampled tokens are for requests {tokens.rids.tolist()}, the running rows are"
                f" {rows.rids.tolist()}: gather_sampled() them to the running batch first"
            )
        if tokens.tokens.device.device != rows.device:
            raise BatchConflict(
                f"sampled tokens on {tokens.tokens.device.device}, the batch on {rows.device}"
            )
    elif len(tokens) != len(rows):
        raise BatchConflict(f"{len(tokens)} input tokens for {len(rows)} running rows")


def _expect_columns(rows: Rows[C], admit: Sequence[Req | Chunked[C]], columns: C) -> None:
    # Before any allocation: the new requests' columns, and each chunk's, are the batch's set.
    kind = type(rows.columns)
    if type(columns) is not kind:
        raise ColumnError(
            f"the batch carries {kind.__name__} columns, got {type(columns).__name__}"
        )
    num_new = sum(1 for item in admit if not isinstance(item, Chunked))
    check_column_set(columns, num_new, rows.device, "columns")
    for item in admit:
        if isinstance(item, Chunked):
            check_column_set(item.columns, 1, rows.device, f"request {item.req.rid}'s chunk")
            if type(item.columns) is not kind:
                raise ColumnError(
                    f"request {item.req.rid}'s chunk carries {type(item.columns).__name__}"
                    f" columns, the batch {kind.__name__}"
                )


def _expect_caps(caps: object) -> None:
    if not isinstance(caps, Mapping):
        raise TypeError(f"mix: read_at_most must be a mapping, got {type(caps).__name__}")
    for rid, cap in caps.items():
        for value in (rid, cap):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(
                    f"mix: read_at_most maps int rids to ints, got {type(value).__name__}"
                )
        if cap < 0:
            raise ValueError(f"mix: read_at_most[{rid}] is {cap}, a cap is >= 0")


# The public transitions.


_NO_CAPS: Mapping[int, int] = Map()  # no request's cache hit capped


@overload
def mix(
    running: Filtered[NoColumns] | Idle[NoColumns],
    admit: Sequence[Req | Chunked[NoColumns]],
    budget: int,
    pools: Pools,
    tokens: Tokens = (),
    *,
    read_at_most: Mapping[int, int] = _NO_CAPS,
) -> Result[MixStep[NoColumns], MixError]: ...
@overload
def mix(
    running: Filtered[C] | Idle[C],
    admit: Sequence[Req | Chunked[C]],
    budget: int,
    pools: Pools,
    tokens: Tokens,
    columns: C,
    *,
    read_at_most: Mapping[int, int] = _NO_CAPS,
) -> Result[MixStep[C], MixError]: ...
def mix(  # noqa: PLR0917  # the overloads above are the API; Any stands for their column set
    running: Filtered[Any] | Idle[Any],
    admit: Sequence[Req | Chunked[Any]],
    budget: int,
    pools: Pools,
    tokens: Tokens = (),
    columns: Any = NO_COLUMNS,
    *,
    read_at_most: Mapping[int, int] = _NO_CAPS,
) -> Result[MixStep[Any], MixError]:
    """One forward for prompt chunks under `budget` and one decode token per running row.

    Requests of `admit` are taken in order while the budget lasts: a `Req`
    gets a fresh slot and computes up to `budget` tokens of its prompt, a
    `Chunked` continues past what its slot holds. The last one taken may
    stop part way (it comes back from `finish_mixed` as a `Chunked`); the rest are
    not admitted (`batch.num_extend_rows` says how many were). Every
    running row gets one KV location, as `decode` gives it. The table is
    written once every allocation has succeeded; one host-to-device copy
    carries every column (with `Sampled` tokens, a device `cat` appends them).

    With the prefix cache on, a `Req` reads its longest cached prefix first
    (as in `extend`; the budget counts only the tokens it computes), free
    pages that run short are evicted from the cache, and each extend row's
    whole pages are published when its chunk ends, its lock moving onto
    them (or, where the cache holds them already, onto the cache's pages,
    its own retired); a partly filled last page stays private until a
    later chunk fills it.

    Args:
        running: the running batch (`Idle`: a chunked prefill alone).
        admit: held chunks and new requests, in the order they may go.
        budget: prompt tokens this forward may compute, >= 1.
        pools: the pools that own `running`'s and the chunks' memory.
        tokens: each running row's input token, as host ints or as the
            last forward's `Sampled` tokens (which must be `running`'s rows).
        columns: for a batch that carries a column set, the new requests'
            own columns: one row per `Req` of `admit`, in order (a
            `Chunked` carries its own row).
        read_at_most: by rid, the most cached tokens a new request of
            `admit` reads (rounded down to whole pages); others read
            their longest cached prefix.

    Returns:
        `Success(MixStep(Mixed, Pools))`; or a `Failure` naming the first
        problem (budget, nothing to run, a chunk not held, a prompt with
        nothing left or too long, slots, KV), inputs unchanged.

    Raises:
        PhaseError: `running` is not `Filtered` or `Idle`.
        BatchConflict: a rid or slot twice, `tokens` not one per running
            row, or `running` and `pools` on different devices.
        StaleRecord: `running` and `pools` disagree about a slot.
        ColumnError: `columns` or a chunk's columns are not the batch's set,
            or not one row per new request (nothing is allocated).
        TypeError: `read_at_most` is not a mapping of int rids to ints.
        ValueError: `read_at_most` holds a negative cap.
    """
    if not isinstance(running, Filtered | Idle):
        raise PhaseError(f"mix takes Filtered or Idle, got {type(running).__name__}")
    expect_pools(pools)
    rows = running.rows
    pools.table.expect_on(rows.device)
    _expect_tokens(tokens, rows)
    columns = owned_host_columns(columns)  # a view of the caller's writable array: copied
    _expect_columns(rows, admit, columns)
    _expect_caps(read_at_most)
    given: object = budget  # callers without mypy may pass anything
    if not isinstance(given, int) or isinstance(given, bool):
        raise TypeError(f"mix: budget must be an int, got {type(budget).__name__}")
    if budget < 1:
        return Failure(NoChunkBudget(budget))
    if not admit and not len(rows):
        return Failure(EmptyExtend())
    _expect_disjoint(admit, rows)
    for item in admit:
        problem = _problem(item, pools)
        if problem is not None:
            return Failure(problem)
    if len(rows) and rows.max_seq_len >= pools.max_context_len:
        return Failure(_too_long(running, pools.max_context_len))  # type: ignore[arg-type]
    expect_current(rows, pools)
    chunks = _fill(admit, budget, pools, read_at_most)
    built = _build(
        rows, chunks, pools, tokens, columns_in_order(admit[: len(chunks.reqs)], columns)
    )
    return Failure(built) if isinstance(built, OutOfReqSlots | OutOfKVTokens) else Success(built)


def decode_sampled(
    batch: Filtered[C], sampled: Sampled, pools: Pools
) -> Result[MixStep[C], DecodeError]:
    """`decode`, fed the last forward's sampled tokens on the device: a `Mixed` of decode rows.

    The same allocation and table write as `decode`; the record also holds
    `input_ids` (the `Sampled` tokens, not read), `positions` and the
    one-token extend layout, so the forward needs nothing from the host.

    Raises:
        PhaseError: `batch` is not `Filtered`.
        BatchConflict: `sampled` is not `batch`'s rows in order (see `gather_sampled`),
            or `batch` and `pools` live on different devices.
        StaleRecord: `batch` and `pools` disagree about a slot.
    """
    expect_instance(sampled, Sampled, "decode_sampled: sampled")
    if not isinstance(batch, Filtered):
        raise PhaseError(f"decode_sampled takes Filtered, got {type(batch).__name__}")
    expect_pools(pools)
    rows = batch.rows
    pools.table.expect_on(rows.device)
    _expect_tokens(sampled, rows)
    if len(rows) and rows.max_seq_len >= pools.max_context_len:
        return Failure(_too_long(batch, pools.max_context_len))
    expect_current(rows, pools)
    grown = grow(rows, pools)
    if isinstance(grown, OutOfKVTokens):
        return Failure(grown)
    new_rows, out_cache_loc, after = grown
    mixed = Mixed.trusted(
        new_rows,
        sampled.tokens,  # on the device, not read
        DeviceOnly(rows.seq_lens.device),  # each token's position: its row's old length
        out_cache_loc,
        rows.seq_lens.host,
        _ones(len(rows)),
        0,
        0,
        (),
    )
    return Success(MixStep(mixed, after.commit()))


def _ones(num_rows: int) -> HostArray:
    # A decode row's extend length, read-only.
    return frozen(np.ones(num_rows, dtype=np.int64))
