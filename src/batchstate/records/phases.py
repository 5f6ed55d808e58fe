"""The four phases of a batch, as frozen records."""

from __future__ import annotations

from typing import Final, Generic, NamedTuple, TypeAlias, final

import attrs
import numpy as np
import torch
from typing_extensions import TypeVar

from batchstate.base.errors import RecordShapeError
from batchstate.base.mirrored import DeviceOnly, HostArray
from batchstate.base.read_only import read_only_copies
from batchstate.base.setters import new_record, put_field
from batchstate.columns.columns import C
from batchstate.pools.pools import Pools
from batchstate.records.rows import Rows, check_host

__all__ = [
    "RUNNING_PHASES",
    "Batch",
    "BatchAndPools",
    "Decoding",
    "Extended",
    "Filtered",
    "Idle",
    "Running",
]


@final
@attrs.frozen(eq=False)
class Idle(Generic[C]):
    """The canonical empty batch: nothing to run. Build it with `idle(device)`."""

    rows: Rows[C]  # always zero rows

    def __attrs_post_init__(self) -> None:
        if len(self.rows):
            raise RecordShapeError(f"Idle holds no rows, got {len(self.rows)}")

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def _held_slots(self) -> list[tuple[int, int, int]]:
        # (slot, tokens it holds) per row: what `find_leaks` compares with the pools.
        return _rows_held(self.rows)


@final
@read_only_copies
@attrs.frozen(eq=False)
class Extended(Generic[C]):
    """Ready for an extend (prefill) forward: each row computes its uncached tokens.

    Rows are laid out back to back in `input_ids` and `out_cache_loc`:

        row i:  positions [prefix_lens[i], prefix_lens[i] + extend_lens[i])
                tokens    [sum(extend_lens[:i]), sum(extend_lens[:i + 1]))
    """

    rows: Rows[C]  # seq_lens = prefix_lens + extend_lens
    input_ids: DeviceOnly  # int64 [extend_num_tokens], the tokens to compute
    out_cache_loc: DeviceOnly  # int64 [extend_num_tokens], token -> KV location it writes
    prefix_lens: HostArray  # read-only int64 [num_reqs]: tokens already in the KV cache
    extend_lens: HostArray  # read-only int64 [num_reqs]: tokens this forward computes
    extend_num_tokens: int  # host only: equals extend_lens.sum()

    def __attrs_post_init__(self) -> None:
        num_reqs = len(self.rows)
        for name, host in (("prefix_lens", self.prefix_lens), ("extend_lens", self.extend_lens)):
            check_host(f"Extended.{name}", host, np.int64, num_reqs)
        if int(self.extend_lens.sum()) != self.extend_num_tokens:
            raise RecordShapeError(
                f"Extended: extend_lens sum to {int(self.extend_lens.sum())},"
                f" extend_num_tokens is {self.extend_num_tokens}"
            )
        for name, column in (("input_ids", self.input_ids), ("out_cache_loc", self.out_cache_loc)):
            if (
                len(column) != self.extend_num_tokens
                or column.dtype != torch.int64
                or column.device.device != self.rows.device
            ):
                raise RecordShapeError(
                    f"Extended.{name}: expected int64 [{self.extend_num_tokens}] on"
                    f" {self.rows.device}, got {column.dtype} [{len(column)}] on"
                    f" {column.device.device}"
                )

    @classmethod
    def trusted(  # noqa: PLR0917  # the attrs __init__ it stands in for is positional too
        cls,
        rows: Rows[C],
        input_ids: DeviceOnly,
        out_cache_loc: DeviceOnly,
        prefix_lens: HostArray,
        extend_lens: HostArray,
        extend_num_tokens: int,
    ) -> Extended[C]:
        # NOTE: skips the checks: only for columns `extend` built row for row.
        batch = new_record(cls)
        put_field(batch, "rows", rows)
        put_field(batch, "input_ids", input_ids)
        put_field(batch, "out_cache_loc", out_cache_loc)
        put_field(batch, "prefix_lens", prefix_lens)
        put_field(batch, "extend_lens", extend_lens)
        put_field(batch, "extend_num_tokens", extend_num_tokens)
        return batch

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def _held_slots(self) -> list[tuple[int, int, int]]:
        # (slot, tokens it holds) per row: what `find_leaks` compares with the pools.
        return _rows_held(self.rows)


@final
@attrs.frozen(eq=False)
class Decoding(Generic[C]):
    """Ready for a decode forward: one new token per row."""

    rows: Rows[C]  # seq_lens counts the token this forward writes
    out_cache_loc: DeviceOnly  # int64 [num_reqs], row -> KV location of its new token

    def __attrs_post_init__(self) -> None:
        locs = self.out_cache_loc
        if (
            len(locs) != len(self.rows)
            or locs.dtype != torch.int64
            or locs.device.device != self.rows.device
        ):
            raise RecordShapeError(
                f"Decoding.out_cache_loc: expected int64 [{len(self.rows)}] on {self.rows.device},"
                f" got {locs.dtype} [{len(locs)}] on {locs.device.device}"
            )

    @classmethod
    def trusted(cls, rows: Rows[C], out_cache_loc: DeviceOnly) -> Decoding[C]:
        # NOTE: skips the checks: only for columns `decode` built row for row.
        batch = new_record(cls)
        put_field(batch, "rows", rows)
        put_field(batch, "out_cache_loc", out_cache_loc)
        return batch

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def _held_slots(self) -> list[tuple[int, int, int]]:
        # (slot, tokens it holds) per row: what `find_leaks` compares with the pools.
        return _rows_held(self.rows)


@final
@attrs.frozen(eq=False)
class Filtered(Generic[C]):
    """A running batch between steps: rows removed or merged in, nothing to run yet."""

    rows: Rows[C]

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def _held_slots(self) -> list[tuple[int, int, int]]:
        # (slot, tokens it holds) per row: what `find_leaks` compares with the pools.
        return _rows_held(self.rows)


def _rows_held(rows: Rows[C]) -> list[tuple[int, int, int]]:
    # (slot, tokens it holds, generation) per row: what `find_leaks` compares with the pools.
    slots, lens = rows.req_pool_indices.host.tolist(), rows.seq_lens.host.tolist()
    return list(zip(slots, lens, rows.gens.tolist(), strict=True))


Batch: TypeAlias = Idle[C] | Extended[C] | Decoding[C] | Filtered[C]
# The phases that hold rows to decode or filter.
Running: TypeAlias = Extended[C] | Decoding[C] | Filtered[C]
# `Running`'s classes: isinstance against a tuple costs a third of building a union per call.
RUNNING_PHASES: Final = (Extended, Decoding, Filtered)

_Phase_co = TypeVar("_Phase_co", covariant=True)


class BatchAndPools(NamedTuple, Generic[_Phase_co]):
    """What an allocating transition returns: the new record and the pools it left."""

    batch: _Phase_co
    pools: Pools
