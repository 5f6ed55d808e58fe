"""(b) A mutable baseline in the style of today's engines (a `ScheduleBatch`-like object).

Written clean-room from a description of such an engine's batch, not from its code.

One batch object whose lifecycle methods update each device tensor and its
CPU mirror in place, by hand; a lazily computed `seq_lens_sum`; a Python
list of requests; a request-slot free list and a KV page free list.

It is a fair baseline, not a straw man: it converts Python lists with the
same `array` + `frombuffer` trick batchstate uses, and skips the checks an
engine would not make, so the gap to batchstate measures immutability and
validation, not list conversion.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt
import torch

from benchmarks.scenario import Join, Outcome, Plan
from benchmarks.torch_host import host_int64, to_device

__all__ = ["MutableStep"]


class _Req:
    """A request, as engines keep it: a mutable object."""

    __slots__ = ("input_ids", "rid")

    def __init__(self, rid: int, input_ids: tuple[int, ...]) -> None:
        self.rid = rid
        self.input_ids = input_ids


class _Allocator:
    """Request slots (a Python free list) and KV pages (a tensor free list), mutated in place."""

    def __init__(self, plan: Plan) -> None:
        self.device = plan.device
        self.page_size = plan.config.page_size
        max_reqs = plan.config.batch_size + 1
        self.free_slots = list(range(1, max_reqs + 1))
        self.free_pages = torch.arange(1, plan.num_kv_tokens // self.page_size + 1)
        shape = (max_reqs + 1, plan.max_context_len)
        self.table_cpu = torch.zeros(shape, dtype=torch.int32)
        self.table = torch.zeros(shape, dtype=torch.int32, device=self.device)

    def alloc_pages(self, num_pages: int) -> torch.Tensor:
        pages = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        return pages

    def free(self, slot: int, seq_len: int) -> None:
        self.free_slots.append(slot)
        locs = self.table_cpu[slot, : seq_len : self.page_size].to(torch.int64)
        self.free_pages = torch.cat((self.free_pages, locs // self.page_size))


class _Batch:
    """The batch object: every field and its mirror, updated by hand in each method."""

    def __init__(self, allocator: _Allocator) -> None:
        self.device = allocator.device
        self.allocator = allocator
        self.reqs: list[_Req] = []
        self.req_pool_indices = torch.empty(0, dtype=torch.int64, device=self.device)
        self.req_pool_indices_cpu = torch.empty(0, dtype=torch.int64)
        self.seq_lens = torch.empty(0, dtype=torch.int64, device=self.device)
        self.seq_lens_cpu = torch.empty(0, dtype=torch.int64)
        self.orig_seq_lens = torch.empty(0, dtype=torch.int32, device=self.device)
        self.out_cache_loc = torch.empty(0, dtype=torch.int64, device=self.device)
        self.input_ids = torch.empty(0, dtype=torch.int64, device=self.device)
        self.prefix_lens: list[int] = []
        self.extend_lens: list[int] = []
        self._seq_lens_sum: int | None = 0

    @property
    def seq_lens_sum(self) -> int:
        # Computed lazily from the host mirror, then cached until a method invalidates it.
        if self._seq_lens_sum is None:
            self._seq_lens_sum = int(self.seq_lens_cpu.sum())
        return self._seq_lens_sum

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
        self.reqs = reqs
        self.req_pool_indices_cpu = host_int64(slots)
        self.req_pool_indices = to_device(self.req_pool_indices_cpu, self.device)
        self.seq_lens_cpu = host_int64(seq_lens)
        self.seq_lens = to_device(self.seq_lens_cpu, self.device)
        self.orig_seq_lens = self.seq_lens.to(torch.int32)
        self.out_cache_loc = to_device(torch.cat(locs), self.device)
        ids = [token for req in reqs for token in req.input_ids]
        self.input_ids = to_device(host_int64(ids), self.device)
        self.prefix_lens = [0] * len(reqs)
        self.extend_lens = seq_lens
        self._seq_lens_sum = sum(seq_lens)

    def prepare_for_decode(self) -> None:
        alloc = self.allocator
        page_size = alloc.page_size
        positions = self.seq_lens_cpu  # each new token's position: the old length
        if page_size == 1:
            locs = alloc.alloc_pages(len(self.reqs))
        else:
            is_new = positions % page_size == 0
            new_pages = alloc.alloc_pages(int(is_new.sum()))
            locs = alloc.table_cpu[self.req_pool_indices_cpu, (positions - 1).clamp(min=0)]
            locs = locs.to(torch.int64) + 1
            locs[is_new] = new_pages * page_size
        alloc.table_cpu[self.req_pool_indices_cpu, positions] = locs.to(torch.int32)
        self.out_cache_loc = to_device(locs, self.device)
        alloc.table[self.req_pool_indices, self.seq_lens] = self.out_cache_loc.to(torch.int32)
        # Host mirror out of place, first: on a CPU "device" the two may share storage.
        self.seq_lens_cpu = self.seq_lens_cpu + 1
        self.seq_lens.add_(1)
        self.orig_seq_lens.add_(1)
        if self._seq_lens_sum is not None:
            self._seq_lens_sum += len(self.reqs)

    def filter_batch(self, keep: list[int]) -> None:
        keep_cpu = host_int64(keep)
        keep_device = to_device(keep_cpu, self.device)
        self.reqs = [self.reqs[i] for i in keep]
        self.req_pool_indices = self.req_pool_indices[keep_device]
        self.req_pool_indices_cpu = self.req_pool_indices_cpu[keep_cpu]
        self.seq_lens = self.seq_lens[keep_device]
        self.seq_lens_cpu = self.seq_lens_cpu[keep_cpu]
        self.orig_seq_lens = self.orig_seq_lens[keep_device]
        self.out_cache_loc = torch.empty(0, dtype=torch.int64, device=self.device)
        self._seq_lens_sum = None

    def merge_batch(self, other: _Batch) -> None:
        self.reqs.extend(other.reqs)
        self.req_pool_indices = torch.cat((self.req_pool_indices, other.req_pool_indices))
        self.req_pool_indices_cpu = torch.cat(
            (self.req_pool_indices_cpu, other.req_pool_indices_cpu)
        )
        self.seq_lens = torch.cat((self.seq_lens, other.seq_lens))
        self.seq_lens_cpu = torch.cat((self.seq_lens_cpu, other.seq_lens_cpu))
        self.orig_seq_lens = torch.cat((self.orig_seq_lens, other.orig_seq_lens))
        if self._seq_lens_sum is not None and other._seq_lens_sum is not None:
            self._seq_lens_sum += other._seq_lens_sum
        else:
            self._seq_lens_sum = None


class MutableStep:
    """The step as an engine writes it today: one batch object, mutated."""

    name: Final = "mutable"

    def __init__(self, plan: Plan) -> None:
        self.allocator = _Allocator(plan)
        self.batch = _Batch(self.allocator)
        self.batch.prepare_for_extend([_Req(rid, ids) for rid, ids in plan.initial])
        self._finished: tuple[int, int] = (0, 0)
        self._incoming = self.batch

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
        self._incoming = _Batch(self.allocator)
        self._incoming.prepare_for_extend([_Req(join.rid, join.input_ids)])

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
        )
