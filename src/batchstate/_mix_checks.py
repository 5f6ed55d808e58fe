"""The checks `mix` and `decode_sampled` run on their inputs before anything is allocated."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from batchstate._chunked import Chunked
from batchstate._column_checks import check_column_set
from batchstate._columns import C
from batchstate._errors import BatchConflict, ColumnError, ContextTooLong, EmptyPrompt, NotHeld
from batchstate._mirrored import same
from batchstate._mix_forward import Tokens
from batchstate._pools import Pools
from batchstate._rows import Req, Rows
from batchstate._sampled import Sampled


def _problem(item: Req | Chunked[C], pools: Pools) -> NotHeld | EmptyPrompt | ContextTooLong | None:
    req, cached = (item.req, item.cached) if isinstance(item, Chunked) else (item, 0)
    if isinstance(item, Chunked):
        problem = item._not_held(pools)
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
