"""(c) The floor: only the tensor operations the step needs, with no records and no checks.

Each field is a bare tensor (device side and host mirror), updated with the
fewest torch ops that reach the same state as the other two implementations.
With `sampling`, each row's sampling parameters live in one device tensor of
24 bytes a row (temperature, top-p and min-p as float32, top-k int32, seed
int64; each a dtype view of it): one upload per extend, one gather per filter
and one concatenation per merge, whatever the number of parameters.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt
import torch

from benchmarks.sampling_values import SamplingRow, request_sampling
from benchmarks.scenario import Join, Outcome, Plan
from benchmarks.torch_host import host_int64, to_device

__all__ = ["FloorStep"]

# One row of sampling parameters: temperature, top-p, min-p, top-k, seed (24 bytes, aligned).
_ROW: Final = struct.Struct("<fffiq")


def _packed_row(rid: int) -> bytes:
    params = request_sampling(rid)
    return _ROW.pack(params.temperature, params.top_p, params.min_p, params.top_k, params.seed)


class FloorStep:
    """Bare tensors held by the harness; no object stands for the batch."""

    name: Final = "floor"

    def __init__(self, plan: Plan, *, sampling: bool = False) -> None:
        self.device = plan.device
        self.sampling = sampling
        page_size = self.page_size = plan.config.page_size
        max_reqs = plan.config.batch_size + 1
        shape = (max_reqs + 1, plan.max_context_len)
        self.table_cpu = torch.zeros(shape, dtype=torch.int32)
        self.table = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.free_slots = list(range(1, max_reqs + 1))
        self.free_pages = torch.arange(1, plan.num_kv_tokens // page_size + 1)
        self.rids: list[int] = []
        slots, seq_lens = [], []
        for rid, input_ids in plan.initial:
            slot, seq_len = self._place(input_ids)
            self.rids.append(rid)
            slots.append(slot)
            seq_lens.append(seq_len)
        self.slots_cpu = host_int64(slots)
        self.slots = to_device(self.slots_cpu, self.device)
        self.seq_lens_cpu = host_int64(seq_lens)
        self.seq_lens = to_device(self.seq_lens_cpu, self.device)
        self.orig_seq_lens = self.seq_lens.to(torch.int32)
        self.seq_lens_sum = sum(seq_lens)
        self.out_cache_loc = torch.empty(0, dtype=torch.int64, device=self.device)
        self._finished = (0, 0)
        self._new = (0, 0, 0)
        rows = b"".join(_packed_row(rid) for rid, _ in plan.initial) if sampling else b""
        self.params = self._upload_params(rows)
        self._new_params = self.params

    def _upload_params(self, rows: bytes) -> torch.Tensor:
        # Rows of packed parameters, in one host-to-device copy.
        if not rows:
            return torch.empty((0, _ROW.size), dtype=torch.uint8, device=self.device)
        host = torch.frombuffer(bytearray(rows), dtype=torch.uint8)
        return to_device(host, self.device).view(-1, _ROW.size)

    def _place(self, input_ids: tuple[int, ...]) -> tuple[int, int]:
        # Take a slot and the pages for `input_ids`, write the table, copy the ids.
        page_size, seq_len = self.page_size, len(input_ids)
        slot = self.free_slots.pop(0)
        num_pages = -(-seq_len // page_size)
        pages = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        if page_size == 1:
            locs = pages.to(torch.int32)
        else:
            offsets = torch.arange(num_pages * page_size, dtype=torch.int32) % page_size
            locs = ((pages * page_size).to(torch.int32).repeat_interleave(page_size) + offsets)[
                :seq_len
            ]
        self.table_cpu[slot, :seq_len] = locs
        self.table[slot, :seq_len] = to_device(locs, self.device)
        self.input_ids = to_device(host_int64(input_ids), self.device)
        return slot, seq_len

    def decode(self) -> None:
        page_size, positions = self.page_size, self.seq_lens_cpu
        if page_size == 1:
            locs = self.free_pages[: positions.shape[0]]
            self.free_pages = self.free_pages[positions.shape[0] :]
        else:
            is_new = positions % page_size == 0
            num_new = int(is_new.sum())
            new_pages = self.free_pages[:num_new]
            self.free_pages = self.free_pages[num_new:]
            locs = self.table_cpu[self.slots_cpu, (positions - 1).clamp(min=0)].to(torch.int64) + 1
            locs[is_new] = new_pages * page_size
        locs32 = locs.to(torch.int32)
        self.table_cpu[self.slots_cpu, positions] = locs32
        self.table[self.slots, self.seq_lens] = to_device(locs32, self.device)
        self.out_cache_loc = to_device(locs, self.device)
        self.seq_lens_cpu = positions + 1
        self.seq_lens = self.seq_lens + 1
        self.orig_seq_lens = self.orig_seq_lens + 1
        self.seq_lens_sum += positions.shape[0]

    def filter(self, join: Join) -> None:
        row = join.finished_row
        self._finished = (int(self.slots_cpu[row]), int(self.seq_lens_cpu[row]))
        keep_cpu = host_int64(join.keep)
        keep = to_device(keep_cpu, self.device)
        del self.rids[row]
        self.slots_cpu = self.slots_cpu[keep_cpu]
        self.slots = self.slots[keep]
        self.seq_lens_cpu = self.seq_lens_cpu[keep_cpu]
        self.seq_lens = self.seq_lens[keep]
        self.orig_seq_lens = self.orig_seq_lens[keep]
        self.seq_lens_sum -= self._finished[1]
        if self.sampling:
            self.params = self.params[keep]

    def release(self) -> None:
        slot, seq_len = self._finished
        self.free_slots.append(slot)
        pages = self.table_cpu[slot, : seq_len : self.page_size].to(torch.int64)
        if self.page_size > 1:
            pages = pages // self.page_size
        self.free_pages = torch.cat((self.free_pages, pages))

    def extend(self, join: Join) -> None:
        slot, seq_len = self._place(join.input_ids)
        self._new = (join.rid, slot, seq_len)
        if self.sampling:
            self._new_params = self._upload_params(_packed_row(join.rid))

    def merge(self) -> None:
        rid, slot, seq_len = self._new
        new_cpu = host_int64((slot, seq_len))
        new = to_device(new_cpu, self.device)
        self.rids.append(rid)
        self.slots_cpu = torch.cat((self.slots_cpu, new_cpu[:1]))
        self.slots = torch.cat((self.slots, new[:1]))
        self.seq_lens_cpu = torch.cat((self.seq_lens_cpu, new_cpu[1:]))
        self.seq_lens = torch.cat((self.seq_lens, new[1:]))
        self.orig_seq_lens = torch.cat((self.orig_seq_lens, new[1:].to(torch.int32)))
        self.seq_lens_sum += seq_len
        if self.sampling:
            self.params = torch.cat((self.params, self._new_params))

    def row_tensors(self) -> list[tuple[torch.Tensor | npt.NDArray[np.generic], bool]]:
        return [
            (self.slots_cpu, False),
            (self.slots, True),
            (self.seq_lens_cpu, False),
            (self.seq_lens, True),
            (self.orig_seq_lens, True),
            (self.out_cache_loc, True),
            *([(self.params, True)] if self.sampling else []),
        ]

    def row_objects(self) -> Sequence[object]:
        return self.rids

    def outcome(self) -> Outcome:
        slots = self.slots_cpu.tolist()
        seq_lens = self.seq_lens_cpu.tolist()
        return Outcome(
            list(self.rids),
            slots,
            self.slots.tolist(),
            seq_lens,
            self.seq_lens.tolist(),
            self.seq_lens_sum,
            self.out_cache_loc.tolist(),
            [
                self.table[slot, :length].tolist()
                for slot, length in zip(slots, seq_lens, strict=True)
            ],
            len(self.free_slots),
            self.free_pages.shape[0] * self.page_size,
            self._sampling_values(),
        )

    def _sampling_values(self) -> list[SamplingRow]:
        # The packed rows read through their dtype views, in the other sides' order.
        if not self.sampling:
            return []
        floats = self.params[:, :12].view(torch.float32)
        temperature, top_p, min_p = (floats[:, i].tolist() for i in range(3))
        top_k = self.params[:, 12:16].view(torch.int32).view(-1).tolist()
        seed = self.params[:, 16:].view(torch.int64).view(-1).tolist()
        return list(zip(temperature, top_p, top_k, min_p, seed, strict=True))
