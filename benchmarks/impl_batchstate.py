"""(a) batchstate: the step as its public transitions, threading records and pools."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Literal

import attrs
import numpy as np
import numpy.typing as npt
import torch
from returns.result import Result

from batchstate import (
    BatchAndPools,
    Columns,
    Decoding,
    Departed,
    Extended,
    ExtendError,
    Filtered,
    Idle,
    Mirrored,
    Pools,
    Req,
    Sampling,
    build_columns,
    decode,
    extend,
    idle,
    make_pools,
    merge,
    release,
    split,
)
from benchmarks.sampling_values import request_sampling, sampling_rows
from benchmarks.scenario import Join, Outcome, Plan

__all__ = ["BatchstateStep", "ColumnChoice", "EightColumns"]

# The column set the batch carries: none, the standard `Sampling` set (five
# columns, built from `SamplingParams`), or `EightColumns` (built from host lists).
ColumnChoice = Literal["none", "sampling", "eight"]


@attrs.frozen(eq=False)
class EightColumns(Columns):
    """Eight mirrored columns of three dtypes: what a scheduler with many per-row knobs carries."""

    temperature: Mirrored[np.float32]
    top_p: Mirrored[np.float32]
    min_p: Mirrored[np.float32]
    penalty: Mirrored[np.float32]
    top_k: Mirrored[np.int32]
    adapter: Mirrored[np.int32]
    seed: Mirrored[np.int64]
    priority: Mirrored[np.int64]


_EIGHT_VALUES: Final = {"temperature": 0.7, "top_p": 0.9, "min_p": 0.0, "penalty": 1.1}
_EIGHT_IDS: Final = ("top_k", "adapter", "seed", "priority")


class BatchstateStep:
    """The harness holds the newest record and pools; each phase replaces them.

    With `columns` other than "none", the batch carries that column set:
    every request joins with its own values, and every transition moves
    them with the other columns.
    """

    def __init__(self, plan: Plan, *, columns: ColumnChoice = "none") -> None:
        self.name = "batchstate" if columns == "none" else f"batchstate+{columns}"
        self._columns = columns
        self._device = plan.device
        pools = make_pools(
            plan.config.batch_size + 1,
            plan.max_context_len,
            plan.num_kv_tokens,
            plan.device,
            plan.config.page_size,
        )
        column_set = {"none": None, "sampling": Sampling, "eight": EightColumns}[columns]
        self._idle: Idle[Any] = (
            idle(plan.device) if column_set is None else idle(plan.device, column_set)
        )
        reqs = [Req(rid, input_ids) for rid, input_ids in plan.initial]
        extended, self.pools = self._admit(reqs, pools).unwrap()
        self.batch: Decoding[Any] | Filtered[Any] = merge(self._idle, extended)
        self._left: Departed | None = None
        self._incoming: Extended[Any] | None = None

    def _admit(
        self, reqs: list[Req], pools: Pools
    ) -> Result[BatchAndPools[Extended[Any]], ExtendError]:
        # What a scheduler pays per admission: its requests' parameters as columns.
        if self._columns == "sampling":
            params = [request_sampling(req.rid) for req in reqs]
            return extend(self._idle, reqs, pools, Sampling.of(params, self._device))
        if self._columns == "eight":
            values: dict[str, list[float] | list[int]] = {
                name: [value] * len(reqs) for name, value in _EIGHT_VALUES.items()
            }
            values.update((name, [req.rid for req in reqs]) for name in _EIGHT_IDS)
            eight = build_columns(EightColumns, values, self._device)
            return extend(self._idle, reqs, pools, eight)
        return extend(self._idle, reqs, pools)

    def decode(self) -> None:
        self.batch, self.pools = decode(self.batch, self.pools).unwrap()

    def filter(self, join: Join) -> None:
        self.batch, self._left = split(self.batch, join.keep)

    def release(self) -> None:
        assert self._left is not None
        self.pools = release(self._left, self.batch, self.pools).unwrap()

    def extend(self, join: Join) -> None:
        req = Req(join.rid, join.input_ids)
        self._incoming, self.pools = self._admit([req], self.pools).unwrap()

    def merge(self) -> None:
        assert self._incoming is not None
        self.batch = merge(self.batch, self._incoming)

    def row_tensors(self) -> list[tuple[torch.Tensor | npt.NDArray[np.generic], bool]]:
        rows = self.batch.rows
        tensors: list[tuple[torch.Tensor | npt.NDArray[np.generic], bool]] = [
            (rows.rids, False),
            (rows.req_pool_indices.host, False),
            (rows.req_pool_indices.device, True),
            (rows.seq_lens.host, False),
            (rows.seq_lens.device, True),
            (rows.orig_seq_lens.device, True),
        ]
        if isinstance(self.batch, Decoding):
            tensors.append((self.batch.out_cache_loc.device, True))
        for field in attrs.fields(type(rows.columns)):
            column = getattr(rows.columns, field.name)
            tensors += [(column.host, False), (column.device, True)]
        return tensors

    def row_objects(self) -> Sequence[object]:
        return self.batch.rows.reqs

    def outcome(self) -> Outcome:
        rows = self.batch.rows
        pools: Pools = self.pools
        slots = rows.req_pool_indices.host.tolist()
        seq_lens = rows.seq_lens.host.tolist()
        table = pools.table.device
        out = self.batch.out_cache_loc.device if isinstance(self.batch, Decoding) else None
        return Outcome(
            rows.rids.tolist(),
            slots,
            rows.req_pool_indices.device.tolist(),
            seq_lens,
            rows.seq_lens.device.tolist(),
            rows.seq_lens_sum,
            [] if out is None else out.tolist(),
            [table[slot, :length].tolist() for slot, length in zip(slots, seq_lens, strict=True)],
            pools.num_free_slots,
            pools.num_free_tokens,
            sampling_rows(rows.columns),
        )
