"""(b) A mutable baseline in the style of today's engines (a `ScheduleBatch`-like object).

Written clean-room from a description of such an engine's batch, not from its code.

One batch object whose lifecycle methods update each device tensor and its
CPU mirror in place, by hand; a lazily computed `seq_lens_sum`; a Python
list of requests; a request-slot free list and a KV page free list. The
batch and its allocator are `benchmarks.mutable_batch`'s, shared with the
production baseline; this step adds its extend, its in-place decode and
its free.

It is a fair baseline, not a straw man: it converts Python lists with the
same `array` + `frombuffer` trick batchstate uses, and skips the checks an
engine would not make, so the gap to batchstate measures immutability and
validation, not list conversion.

With `sampling`, every request carries its sampling parameters and the batch
keeps them as SGLang's `SamplingBatchInfo` does (`benchmarks.mutable_sampling`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt
import torch

from batchstate import GREEDY, SamplingParams
from benchmarks.mutable_batch import MutableAllocator, MutableBatch
from benchmarks.sampling_values import request_sampling
from benchmarks.scenario import Join, Outcome, Plan
from benchmarks.torch_host import to_device

__all__ = ["MutableStep"]


class _Req:
    """A request, as engines keep it: a mutable object."""

    __slots__ = ("input_ids", "rid", "sampling_params")

    def __init__(
        self, rid: int, input_ids: tuple[int, ...], sampling_params: SamplingParams
    ) -> None:
        self.rid = rid
        self.input_ids = input_ids
        self.sampling_params = sampling_params


class _Allocator(MutableAllocator):
    """Request slots and KV pages, mutated in place; a finished row gives its pages back."""

    def __init__(self, plan: Plan) -> None:
        config = plan.config
        max_reqs = config.batch_size + 1
        super().__init__(
            plan.device, config.page_size, max_reqs, plan.num_kv_tokens, plan.max_context_len
        )

    def free(self, slot: int, seq_len: int) -> None:
        self.free_slots.append(slot)
        locs = self.table_cpu[slot, : seq_len : self.page_size].to(torch.int64)
        self.free_pages = torch.cat((self.free_pages, locs // self.page_size))


class _Batch(MutableBatch[_Req]):
    """The batch object of a step without a prefix cache or overlap."""

    def prepare_for_extend(self, reqs: list[_Req]) -> None:
        alloc = self.allocator
        page_size = alloc.page_size
        slots = [alloc.free_slots.pop(0) for _ in reqs]
        seq_lens = [len(req.input_ids) for req in reqs]
        locs = []
        for slot, seq_len in zip(slots, seq_lens, strict=True):
            pages = alloc.alloc_pages(-(-seq_len // page_size))
            slot_locs = (pages * page_size).repeat_interleave(page_size)[:seq_len]
            if page_size > 1:
                slot_locs = slot_locs + torch.arange(seq_len) % page_size
            alloc.table_cpu[slot, :seq_len] = slot_locs.to(torch.int32)
            alloc.table[slot, :seq_len] = to_device(slot_locs, self.device).to(torch.int32)
            locs.append(slot_locs)
        ids = [token for req in reqs for token in req.input_ids]
        self._set_extend_rows(reqs, slots, seq_lens, locs, ids, [0] * len(reqs), seq_lens)

    def prepare_for_decode(self) -> None:
        self._write_decode_locs()
        # Host mirror out of place, first: on a CPU "device" the two may share storage.
        self.seq_lens_cpu = self.seq_lens_cpu + 1
        self.seq_lens.add_(1)
        self.orig_seq_lens.add_(1)
        if self._seq_lens_sum is not None:
            self._seq_lens_sum += len(self.reqs)


class MutableStep:
    """The step as an engine writes it today: one batch object, mutated."""

    name: Final = "mutable"

    def __init__(self, plan: Plan, *, sampling: bool = False) -> None:
        self.allocator = _Allocator(plan)
        self.sampling = sampling
        self.batch = _Batch(self.allocator, sampling=sampling)
        self.batch.prepare_for_extend([self._req(rid, ids) for rid, ids in plan.initial])
        self._finished: tuple[int, int] = (0, 0)
        self._incoming = self.batch

    def _req(self, rid: int, input_ids: tuple[int, ...]) -> _Req:
        # What a scheduler pays per admission: the request's parameters, when it has them.
        return _Req(rid, input_ids, request_sampling(rid) if self.sampling else GREEDY)

    def decode(self) -> None:
        self.batch.prepare_for_decode()

    def filter(self, join: Join) -> None:
        row = join.finished_row
        self._finished = (
            int(self.batch.req_pool_indices_cpu[row]),
            int(self.batch.seq_lens_cpu[row]),
        )
        self.batch.filter_batch(join.keep)

    def release(self) -> None:
        self.allocator.free(*self._finished)

    def extend(self, join: Join) -> None:
        self._incoming = _Batch(self.allocator, sampling=self.sampling)
        self._incoming.prepare_for_extend([self._req(join.rid, join.input_ids)])

    def merge(self) -> None:
        self.batch.merge_batch(self._incoming)

    def row_tensors(self) -> list[tuple[torch.Tensor | npt.NDArray[np.generic], bool]]:
        batch = self.batch
        return [
            (batch.req_pool_indices_cpu, False),
            (batch.req_pool_indices, True),
            (batch.seq_lens_cpu, False),
            (batch.seq_lens, True),
            (batch.orig_seq_lens, True),
            (batch.out_cache_loc, True),
            *((tensor, True) for tensor in batch.sampling_info.row_tensors()),
        ]

    def row_objects(self) -> Sequence[object]:
        return self.batch.reqs

    def outcome(self) -> Outcome:
        batch = self.batch
        slots = batch.req_pool_indices_cpu.tolist()
        seq_lens = batch.seq_lens_cpu.tolist()
        table = self.allocator.table
        return Outcome(
            [req.rid for req in batch.reqs],
            slots,
            batch.req_pool_indices.tolist(),
            seq_lens,
            batch.seq_lens.tolist(),
            batch.seq_lens_sum,
            batch.out_cache_loc.tolist(),
            [table[slot, :length].tolist() for slot, length in zip(slots, seq_lens, strict=True)],
            len(self.allocator.free_slots),
            self.allocator.free_pages.shape[0] * self.allocator.page_size,
            batch.sampling_info.values(),
        )
