"""The checks `extend` and `prebuilt` run on their inputs before anything is allocated."""

from __future__ import annotations

from collections.abc import Sequence

from batchstate._chunked import Chunked
from batchstate._column_checks import check_column_set
from batchstate._columns import C
from batchstate._errors import BatchConflict, ColumnError, ContextTooLong, EmptyPrompt
from batchstate._phases import Idle
from batchstate._rows import Req


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
