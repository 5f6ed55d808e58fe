"""`forward_inputs`' extra arguments, checked against the record they describe.

The table, page size and (for a verify window) per-slot lengths come from
the pools, not the record, so a caller can hand over the wrong ones: a
table of other pools, a page size of other pools, lengths read before
`verify`. Each would give another request's pages to the forward with no
error. Everything here is host work on values the record and table
already hold, a few microseconds per call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from batchstate._columns import C
from batchstate._errors import PhaseError
from batchstate._lineage import GENERATION_BITS
from batchstate._mirrored import HostArray
from batchstate._token_table import TokenTable
from batchstate._verifying import Verifying, holds_window

if TYPE_CHECKING:
    from batchstate._forward_inputs import ForwardPhase

__all__ = ["ForwardInputsError", "expect_table_of", "window_seq_lens"]


class ForwardInputsError(ValueError):
    """Arguments to `forward_inputs` that do not describe the record.

    A page size other than the pools', a table of other pools, or (for a
    verify window) `slot_tokens` that do not hold the window's drafts.
    """


def expect_table_of(
    batch: ForwardPhase[C] | Verifying[C], table: TokenTable, page_size: int
) -> None:
    """Raise `ForwardInputsError` unless `table` and `page_size` are the pools' of `batch`.

    A record's generations were issued by its pools' lineage, which counts
    from the base the table carries: two reductions over the host gens.
    """
    given: object = page_size  # callers without mypy may pass anything
    if not isinstance(given, int) or isinstance(given, bool) or page_size < 1:
        raise ForwardInputsError(f"page_size must be an int >= 1, got {page_size!r}")
    if page_size != table.page_size:
        raise ForwardInputsError(
            f"page_size={page_size}, but the table's pools have pages of {table.page_size}:"
            f" pass pools.page_size"
        )
    gens = batch.gens if isinstance(batch, Verifying) else batch.rows.gens
    if gens.shape[0]:
        lineage = table.first_gen >> GENERATION_BITS
        if int(np.minimum.reduce(gens)) >> GENERATION_BITS != lineage or (
            int(np.maximum.reduce(gens)) >> GENERATION_BITS != lineage
        ):
            raise ForwardInputsError(
                "the table is another pools' than the record's: pass the table of the pools"
                " the record was built with (pools.table)"
            )


def window_seq_lens(
    batch: Verifying[C], table: TokenTable, slot_tokens: HostArray | None
) -> HostArray:
    """Each window row's KV length (its slot's tokens, drafts included), checked against `table`."""
    if slot_tokens is None:
        raise PhaseError("forward_inputs of a Verifying window takes slot_tokens=pools.slot_tokens")
    given: object = slot_tokens  # callers without mypy may pass anything
    if not isinstance(given, np.ndarray) or slot_tokens.ndim != 1 or slot_tokens.dtype != np.int64:
        raise ForwardInputsError("slot_tokens must be the pools' int64 tokens per slot")
    slots = batch.req_pool_indices.host
    if slots.shape[0] and int(slots.max()) >= slot_tokens.shape[0]:
        raise ForwardInputsError("slot_tokens must be the pools' int64 tokens per slot")
    seq = slot_tokens[slots]
    if not holds_window(table, seq, batch):
        raise ForwardInputsError(
            "slot_tokens do not hold this window's drafts: pass pools.slot_tokens of the pools"
            " verify returned (or their successors), read after verify"
        )
    return seq
