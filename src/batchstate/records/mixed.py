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
last one taken may stop part way. `finish_mixed` then hands back the running
batch (decode rows, then every row whose prompt is done) and a `Chunked`
for each row whose prompt goes on.
"""

from __future__ import annotations

from typing import Generic, NamedTuple, final

import attrs
import numpy as np
import torch

from batchstate.base.errors import (
    PhaseError,
    RecordShapeError,
)
from batchstate.base.mirrored import DeviceOnly, HostArray, frozen, host_int64
from batchstate.base.read_only import read_only_copies
from batchstate.base.setters import new_record, put_field
from batchstate.columns.columns import C
from batchstate.columns.rows import slice_columns
from batchstate.pools.pools import Pools
from batchstate.records.chunked import Chunked
from batchstate.records.phases import Filtered, _rows_held
from batchstate.records.rows import Rows, check_host

__all__ = ["FinishedMixed", "MixStep", "Mixed", "finish_mixed"]


@read_only_copies
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

    @classmethod
    def trusted(  # noqa: PLR0917  # the attrs __init__ it stands in for
        cls,
        rows: Rows[C],
        input_ids: DeviceOnly,
        positions: DeviceOnly,
        out_cache_loc: DeviceOnly,
        prefix_lens: HostArray,
        extend_lens: HostArray,
        num_extend_rows: int,
        num_extend_tokens: int,
        partial: tuple[int, ...],
    ) -> Mixed[C]:
        # NOTE: skips the checks: only for columns `mix` and `decode_sampled` built row
        # for row (the table tests check every such result).
        batch = new_record(cls)
        put_field(batch, "rows", rows)
        put_field(batch, "input_ids", input_ids)
        put_field(batch, "positions", positions)
        put_field(batch, "out_cache_loc", out_cache_loc)
        put_field(batch, "prefix_lens", prefix_lens)
        put_field(batch, "extend_lens", extend_lens)
        put_field(batch, "num_extend_rows", num_extend_rows)
        put_field(batch, "num_extend_tokens", num_extend_tokens)
        put_field(batch, "partial", partial)
        return batch

    @property
    def device(self) -> torch.device:
        return self.rows.device

    @property
    def num_tokens(self) -> int:
        """Tokens in the forward: the extend tokens, then one per decode row."""
        return self.num_extend_tokens + len(self.rows) - self.num_extend_rows

    def _held_slots(self) -> list[tuple[int, int, int]]:
        # (slot, tokens it holds) per row: what `find_leaks` compares with the pools.
        return _rows_held(self.rows)

    @property
    def sample_index(self) -> HostArray:
        """Each row's last token in the flat token dimension, where its logits are taken."""
        return frozen(np.cumsum(self.extend_lens) - 1)


class MixStep(NamedTuple, Generic[C]):
    """What `mix` and `decode_sampled` return: the mixed forward and the pools holding its KV."""

    batch: Mixed[C]
    pools: Pools


class FinishedMixed(NamedTuple, Generic[C]):
    """A mixed forward after it ran: the running rows, and the requests held between chunks."""

    running: Filtered[C]
    held: tuple[Chunked[C], ...]


def finish_mixed(batch: Mixed[C]) -> FinishedMixed[C]:
    """After the forward: the running rows as `Filtered`, and a `Chunked` per partial row.

    The running batch holds the decode rows first, then each extend row
    whose prompt is done (its sampled token is its first output), in
    order. Host work and one upload; no read.

    Raises:
        PhaseError: `batch` is not `Mixed`.
    """
    if not isinstance(batch, Mixed):
        raise PhaseError(f"finish_mixed takes Mixed, got {type(batch).__name__}")
    rows, num_extend = batch.rows, batch.num_extend_rows
    if not num_extend:
        return FinishedMixed(Filtered(rows), ())
    partial = set(batch.partial)
    order = host_int64(
        [*range(num_extend, len(rows)), *(row for row in range(num_extend) if row not in partial)]
    )
    settled = rows.gather(order)  # decode rows first, then the prompts that are done
    slots, lens, gens = rows.req_pool_indices.host, rows.seq_lens.host, rows.gens
    held = tuple(
        Chunked(
            rows.reqs[row],
            int(slots[row]),
            int(lens[row]),
            slice_columns(rows.columns, row, row + 1),  # a view of its row: no copy
            gen=int(gens[row]),
        )
        for row in batch.partial
    )
    return FinishedMixed(Filtered(settled), held)
