"""`mix` and `decode_sampled`: build one forward of prompt chunks and running decode rows.

The layout is `Mixed`'s (see `_mixed.py`): extend rows first, then the
running rows as one-token extends. A chunk budget caps the extend tokens:
requests are taken in order, each computes as much of its prompt as the
budget has left, and the last one taken may stop part way.

Choosing the chunks and laying the forward out is `_mix_forward.py`'s; the
input checks are `_mix_checks.py`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias, overload

import numpy as np
from immutables import Map
from returns.result import Failure, Result, Success

from batchstate._chunked import Chunked, columns_in_order
from batchstate._column_checks import owned_host_columns
from batchstate._columns import NO_COLUMNS, C, NoColumns
from batchstate._decode import DecodeError, _expect_current, _too_long, grow
from batchstate._errors import (
    AllocError,
    EmptyExtend,
    NoChunkBudget,
    NotHeld,
    OutOfKVTokens,
    OutOfReqSlots,
    PhaseError,
)
from batchstate._expect import expect_instance
from batchstate._mirrored import DeviceOnly, HostArray, frozen
from batchstate._mix_checks import (
    _expect_caps,
    _expect_columns,
    _expect_disjoint,
    _expect_tokens,
    _problem,
)
from batchstate._mix_forward import Tokens, _build, _fill
from batchstate._mixed import Mixed, MixStep
from batchstate._phases import Filtered, Idle
from batchstate._pools import Pools, expect_pools
from batchstate._rows import Req
from batchstate._sampled import Sampled

__all__ = ["MixError", "Tokens", "decode_sampled", "mix"]

MixError: TypeAlias = AllocError | NoChunkBudget | NotHeld
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
    stop part way (it comes back from `settle` as a `Chunked`); the rest are
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
    _expect_current(rows, pools)
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
        BatchConflict: `sampled` is not `batch`'s rows in order (see `follow`),
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
    _expect_current(rows, pools)
    grown = grow(rows, pools)
    if isinstance(grown, OutOfKVTokens):
        return Failure(grown)
    new_rows, out_cache_loc, after = grown
    mixed = Mixed._trusted(
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
    return Success(MixStep(mixed, after._commit()))


def _ones(num_rows: int) -> HostArray:
    # A decode row's extend length, read-only.
    return frozen(np.ones(num_rows, dtype=np.int64))
