"""Mixed forwards: prompt chunks and running decode rows in one attention call.

Layout (SGLang's mixed mode lays a batch out the same way): extend rows
first, then the running rows, each a one-token extend whose prefix is its
length before this step. `input_ids`, `positions` and `out_cache_loc` run
over every token back to back, so one ragged (varlen) attention call
covers both kinds with per-row `extend_lens` and `seq_lens`; extend tokens
are a contiguous prefix of the token dimension, the decode tokens its tail,
and each row samples at its last token, `cumsum(extend_lens) - 1`.

    tokens  [ req a: chunk ... | req b: prompt ... | run 0 | run 1 | ... ]
    rows    [ a (extend)       | b (extend)        | 0     | 1     | ... ]
            |<-- num_extend_rows, num_extend_tokens -->|<-- decode -->|

A chunk budget caps the extend tokens per step: requests are taken in
order, each computes as much of its prompt as the budget has left, and the
last one taken may stop part way. `settle` then hands back the running
batch (decode rows, then every row whose prompt is done) and a `Chunked`
for each row whose prompt goes on.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import chain
from typing import Any, Generic, NamedTuple, TypeAlias, final, overload

import attrs
import numpy as np
import torch
from returns.result import Failure, Result, Success

from batchstate._chunked import Chunked
from batchstate._columns import (
    NO_COLUMNS,
    C,
    NoColumns,
    check_column_set,
    join_pending,
    slice_columns,
    take_pending,
)
from batchstate._decode import DecodeError, _expect_current, _too_long
from batchstate._errors import (
    AllocError,
    BatchConflict,
    ColumnError,
    ContextTooLong,
    EmptyExtend,
    EmptyPrompt,
    NoChunkBudget,
    NotHeld,
    OutOfKVTokens,
    OutOfReqSlots,
    PhaseError,
    RecordShapeError,
)
from batchstate._mirrored import DeviceOnly, HostArray, Mirrored, frozen, host_int64
from batchstate._phases import Filtered, Idle
from batchstate._pools import Pools
from batchstate._rows import Req, Rows, _take_tuple, build_rows, check_host
from batchstate._sampled import Sampled

__all__ = ["MixError", "MixStep", "Mixed", "Settled", "decode_sampled", "mix", "settle"]

MixError: TypeAlias = AllocError | NoChunkBudget | NotHeld
# The running rows' input tokens: host ints, or the last forward's tokens left on the device.
Tokens: TypeAlias = Sequence[int] | Sampled


@final
@attrs.frozen(eq=False)
class Mixed(Generic[C]):
    """Ready for one forward over prompt chunks and running decode rows together.

    Rows `[0, num_extend_rows)` compute `extend_lens[i]` prompt tokens past
    `prefix_lens[i]`; the rest are decode rows (`extend_lens` 1). Each row's
    `seq_lens` counts what it holds after this forward. Rows in `partial`
    stop part way through their prompt: their sampled token means nothing.
    """

    rows: Rows[C]  # extend rows, then decode rows
    input_ids: DeviceOnly  # int64 [num_tokens]
    positions: DeviceOnly  # int64 [num_tokens], each token's position in its request
    out_cache_loc: DeviceOnly  # int64 [num_tokens], token -> KV location it writes
    prefix_lens: HostArray  # read-only int64 [num_reqs], tokens in the KV cache before
    extend_lens: HostArray  # read-only int64 [num_reqs], tokens this forward computes
    num_extend_rows: int
    num_extend_tokens: int  # host only: extend_lens[:num_extend_rows].sum()
    partial: tuple[int, ...]  # extend rows whose prompt goes on in a later chunk

    def __attrs_post_init__(self) -> None:
        num_reqs = len(self.rows)
        for name, host in (("prefix_lens", self.prefix_lens), ("extend_lens", self.extend_lens)):
            check_host(f"Mixed.{name}", host, np.int64, num_reqs)
        if not 0 <= self.num_extend_rows <= num_reqs or any(
            not 0 <= row < self.num_extend_rows for row in self.partial
        ):
            raise RecordShapeError(
                f"Mixed: {self.num_extend_rows} extend rows and partial rows {self.partial}"
                f" do not fit {num_reqs} rows"
            )
        if (
            not np.array_equal(self.prefix_lens + self.extend_lens, self.rows.seq_lens.host)
            or (self.extend_lens[self.num_extend_rows :] != 1).any()
        ):
            raise RecordShapeError("Mixed: seq_lens differ from prefix_lens + extend_lens")
        if int(self.extend_lens[: self.num_extend_rows].sum()) != self.num_extend_tokens:
            raise RecordShapeError("Mixed: num_extend_tokens differs from the extend rows' lens")
        num_tokens = self.num_tokens
        for name, column in (
            ("input_ids", self.input_ids),
            ("positions", self.positions),
            ("out_cache_loc", self.out_cache_loc),
        ):
            if (
                len(column) != num_tokens
                or column.dtype != torch.int64
                or column.device.device != self.rows.device
            ):
                raise RecordShapeError(
                    f"Mixed.{name}: expected int64 [{num_tokens}] on {self.rows.device},"
                    f" got {column.dtype} [{len(column)}] on {column.device.device}"
                )

    @property
    def device(self) -> torch.device:
        return self.rows.device

    @property
    def num_tokens(self) -> int:
        """Tokens in the forward: the extend tokens, then one per decode row."""
        return self.num_extend_tokens + len(self.rows) - self.num_extend_rows

    @property
    def sample_index(self) -> HostArray:
        """Each row's last token in the flat token dimension, where its logits are taken."""
        return frozen(np.cumsum(self.extend_lens) - 1)


class MixStep(NamedTuple, Generic[C]):
    """What `mix` and `decode_sampled` return: the mixed forward and the pools holding its KV."""

    batch: Mixed[C]
    pools: Pools


class Settled(NamedTuple, Generic[C]):
    """A mixed forward after it ran: the running rows, and the requests held between chunks."""

    running: Filtered[C]
    held: tuple[Chunked[C], ...]


@overload
def mix(
    running: Filtered[NoColumns] | Idle[NoColumns],
    admit: Sequence[Req | Chunked[NoColumns]],
    budget: int,
    pools: Pools,
    tokens: Tokens = (),
) -> Result[MixStep[NoColumns], MixError]: ...
@overload
def mix(
    running: Filtered[C] | Idle[C],
    admit: Sequence[Req | Chunked[C]],
    budget: int,
    pools: Pools,
    tokens: Tokens,
    columns: C,
) -> Result[MixStep[C], MixError]: ...
def mix(  # noqa: PLR0917  # the overloads above are the API; Any stands for their column set
    running: Filtered[Any] | Idle[Any],
    admit: Sequence[Req | Chunked[Any]],
    budget: int,
    pools: Pools,
    tokens: Tokens = (),
    columns: Any = NO_COLUMNS,
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
    """
    if not isinstance(running, Filtered | Idle):
        raise PhaseError(f"mix takes Filtered or Idle, got {type(running).__name__}")
    rows = running.rows
    pools.table.expect_on(rows.device)
    _expect_tokens(tokens, rows)
    _expect_columns(rows, admit, columns)
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
    chunks = _fill(admit, budget)
    built = _build(rows, chunks, pools, tokens, _extend_columns(admit, chunks, columns))
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
    if not isinstance(batch, Filtered):
        raise PhaseError(f"decode_sampled takes Filtered, got {type(batch).__name__}")
    rows = batch.rows
    pools.table.expect_on(rows.device)
    _expect_tokens(sampled, rows)
    if len(rows) and rows.max_seq_len >= pools.max_context_len:
        return Failure(_too_long(batch, pools.max_context_len))
    _expect_current(rows, pools)
    built = _build(rows, _Chunks((), [], [], []), pools, sampled, ())
    return Failure(built) if isinstance(built, OutOfKVTokens | OutOfReqSlots) else Success(built)  # type: ignore[arg-type]  # no new slots: never OutOfReqSlots


def settle(batch: Mixed[C]) -> Settled[C]:
    """After the forward: the running rows as `Filtered`, and a `Chunked` per partial row.

    The running batch holds the decode rows first, then each extend row
    whose prompt is done (its sampled token is its first output), in
    order. Host work and one upload; no read.

    Raises:
        PhaseError: `batch` is not `Mixed`.
    """
    if not isinstance(batch, Mixed):
        raise PhaseError(f"settle takes Mixed, got {type(batch).__name__}")
    rows, num_extend = batch.rows, batch.num_extend_rows
    if not num_extend:
        return Settled(Filtered(rows), ())
    partial = set(batch.partial)
    order = host_int64(
        [*range(num_extend, len(rows)), *(row for row in range(num_extend) if row not in partial)]
    )
    seq_lens = rows.seq_lens.host.take(order)
    settled, _ = build_rows(
        rows.device,
        _take_tuple(rows.reqs, order),
        frozen(rows.rids.take(order)),
        rows.req_pool_indices.host.take(order),
        seq_lens,
        int(seq_lens.sum()),
        int(seq_lens.max()) if order.shape[0] else 0,
        take_pending(rows.columns, order),
    )
    slots, lens = rows.req_pool_indices.host, rows.seq_lens.host
    held = tuple(
        Chunked(
            rows.reqs[row],
            int(slots[row]),
            int(lens[row]),
            slice_columns(rows.columns, row, row + 1),  # a view of its row: no copy
        )
        for row in batch.partial
    )
    return Settled(Filtered(settled), held)


class _Chunks(NamedTuple):
    # The admitted prefix of `admit`: requests, whether each is new, prefix and extend lengths.
    reqs: tuple[Req, ...]
    slots: list[int]  # 0 for a new request (a slot comes from the pools)
    prefix_lens: list[int]
    extend_lens: list[int]


def _fill(admit: Sequence[Req | Chunked[C]], budget: int) -> _Chunks:
    reqs: list[Req] = []
    slots, prefix_lens, extend_lens = [], [], []
    left = budget
    for item in admit:
        if not left:
            break
        req, slot, cached = (
            (item.req, item.slot, item.cached) if isinstance(item, Chunked) else (item, 0, 0)
        )
        take = min(len(req.input_ids) - cached, left)
        left -= take
        reqs.append(req)
        slots.append(slot)
        prefix_lens.append(cached)
        extend_lens.append(take)
    return _Chunks(tuple(reqs), slots, prefix_lens, extend_lens)


def _build(
    rows: Rows[C], chunks: _Chunks, pools: Pools, tokens: Tokens, extend_columns: Sequence[C]
) -> MixStep[C] | OutOfReqSlots | OutOfKVTokens:
    num_new = chunks.slots.count(0)
    new_slots = iter(())
    if num_new:
        allocated = pools._allocate_slots(num_new)
        if isinstance(allocated, OutOfReqSlots):
            return allocated
        taken, pools = allocated
        new_slots = iter(taken.tolist())
    num_extend = len(chunks.reqs)
    extend_slots = [slot or next(new_slots) for slot in chunks.slots]
    decode_lens = rows.seq_lens.host
    slots = np.concatenate((host_int64(extend_slots), rows.req_pool_indices.host))
    prefix = np.concatenate((host_int64(chunks.prefix_lens), decode_lens))
    extend_lens = np.concatenate(
        (host_int64(chunks.extend_lens), np.ones(len(rows), dtype=np.int64))
    )
    seq_lens = prefix + extend_lens
    allocation = pools._allocate_tokens(slots, prefix, seq_lens)
    if isinstance(allocation, OutOfKVTokens):
        return allocation
    locs, after = allocation
    num_tokens = locs.shape[0]
    token_rows = np.repeat(np.arange(slots.shape[0]), extend_lens)
    first = np.cumsum(extend_lens) - extend_lens
    positions = prefix[token_rows] + np.arange(num_tokens) - first[token_rows]
    token_slots = slots[token_rows]
    locs32 = locs.astype(np.int32)
    extend_ids = _prompt_ids(chunks)
    on_device = isinstance(tokens, Sampled)
    input_ids = (
        extend_ids
        if on_device
        else np.concatenate((extend_ids, np.asarray(tokens, dtype=np.int64)))
    )
    seq_lens_sum = rows.seq_lens_sum + len(rows) + sum(chunks.prefix_lens) + sum(chunks.extend_lens)
    keep_slots: Mirrored | HostArray = rows.req_pool_indices if not num_extend else slots
    built, (ids_side, locs_side, positions_side, slots_side, cells_side) = build_rows(
        rows.device,
        chunks.reqs + rows.reqs,
        frozen(np.concatenate((host_int64([req.rid for req in chunks.reqs]), rows.rids))),
        keep_slots,
        seq_lens,
        seq_lens_sum,
        int(seq_lens.max()) if seq_lens.shape[0] else 0,
        join_pending([*extend_columns, rows.columns]),  # the running rows' columns last
        (input_ids, locs, positions, token_slots, locs32),
    )
    if isinstance(tokens, Sampled):
        # The host does not know these tokens: append them on the device.
        sampled = tokens.tokens.device
        ids_side = torch.cat((ids_side, sampled)) if num_extend else sampled
    # NOTE: the table write comes last: a failure before it leaves the table as it was.
    after.table.write(
        Mirrored._pair(frozen(token_slots), slots_side),
        Mirrored._pair(frozen(positions), positions_side),
        Mirrored._pair(frozen(locs32), cells_side),
    )
    partial = tuple(
        row
        for row, (req, length) in enumerate(zip(chunks.reqs, seq_lens.tolist(), strict=False))
        if length < len(req.input_ids)
    )
    mixed = _new(Mixed)
    for name, value in (
        ("rows", built),
        ("input_ids", DeviceOnly(ids_side)),
        ("positions", DeviceOnly(positions_side)),
        ("out_cache_loc", DeviceOnly(locs_side)),
        ("prefix_lens", frozen(prefix)),
        ("extend_lens", frozen(extend_lens)),
        ("num_extend_rows", num_extend),
        ("num_extend_tokens", sum(chunks.extend_lens)),
        ("partial", partial),
    ):
        _put(mixed, name, value)  # NOTE: skips the checks: columns built row for row above
    return MixStep(mixed, after)


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


def _problem(item: Req | Chunked[C], pools: Pools) -> NotHeld | EmptyPrompt | ContextTooLong | None:
    req, cached = (item.req, item.cached) if isinstance(item, Chunked) else (item, 0)
    if isinstance(item, Chunked):
        slot = item.slot
        owned = int(pools.slot_tokens[slot]) if 1 <= slot <= pools.max_reqs else 0
        if not owned or owned != cached:
            return NotHeld(req.rid, slot, cached, owned)
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
        if not np.array_equal(tokens.rids, rows.rids):
            raise BatchConflict(
                f"sampled tokens are for requests {tokens.rids.tolist()}, the running rows are"
                f" {rows.rids.tolist()}: follow() them to the running batch first"
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


def _extend_columns(admit: Sequence[Req | Chunked[C]], chunks: _Chunks, columns: C) -> list[C]:
    # The admitted rows' columns, in admit order: a chunk's own row, or the next
    # new request's row of `columns`. Views: `_build` joins them in its one upload.
    if type(columns) is NoColumns:
        return []
    parts: list[C] = []
    next_new = 0
    for item in admit[: len(chunks.reqs)]:
        if isinstance(item, Chunked):
            parts.append(item.columns)
        else:
            parts.append(slice_columns(columns, next_new, next_new + 1))
            next_new += 1
    return parts


_new = object.__new__
_put = object.__setattr__  # what attrs' frozen __init__ does
