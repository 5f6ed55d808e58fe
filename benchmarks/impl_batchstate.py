"""(a) batchstate: the step as its public transitions, threading records and pools."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from returns.result import Result

from batchstate import (
    Decoding,
    Departed,
    Extended,
    ExtendError,
    Filtered,
    Idle,
    Pools,
    Req,
    Sampling,
    SamplingParams,
    Step,
    decode,
    extend,
    idle,
    make_pools,
    merge,
    release,
    split,
)
from benchmarks.scenario import Join, Outcome, Plan

__all__ = ["BatchstateStep"]


class BatchstateStep:
    """The harness holds the newest record and pools; each phase replaces them.

    With `sampling`, the batch carries the standard `Sampling` column set:
    every request joins with its own parameters, and every transition moves
    them with the other columns.
    """

    def __init__(self, plan: Plan, *, sampling: bool = False) -> None:
        self.name = "batchstate+sampling" if sampling else "batchstate"
        self._sampling = sampling
        self._device = plan.device
        pools = make_pools(
            plan.config.batch_size + 1,
            plan.max_context_len,
            plan.num_kv_tokens,
            plan.device,
            plan.config.page_size,
        )
        self._idle: Idle[Any] = idle(plan.device, Sampling) if sampling else idle(plan.device)
        reqs = [Req(rid, input_ids) for rid, input_ids in plan.initial]
        extended, self.pools = self._admit(reqs, pools).unwrap()
        self.batch: Decoding[Any] | Filtered[Any] = merge(self._idle, extended)
        self._left: Departed | None = None
        self._incoming: Extended[Any] | None = None

    def _admit(self, reqs: list[Req], pools: Pools) -> Result[Step[Extended[Any]], ExtendError]:
        if not self._sampling:
            return extend(self._idle, reqs, pools)
        # What a scheduler pays per admission: its requests' parameters as columns.
        params = [SamplingParams(0.7, top_p=0.9, top_k=40, seed=req.rid) for req in reqs]
        return extend(self._idle, reqs, pools, Sampling.of(params, self._device))

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
        )
