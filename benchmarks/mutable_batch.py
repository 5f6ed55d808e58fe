"""The mutable baselines' shared base: a `ScheduleBatch`-like batch and its allocator.

Written clean-room from a description of such an engine's batch, not from
its code. Both mutable baselines (the plain step in `benchmarks.impl_mutable`,
SGLang's production step in `benchmarks.production_mutable`) build on these
two classes, so the work they share (the decode's page locations and table
writes, filtering and merging every field and its mirror) is one code and
cannot drift apart; each adds only what its step does differently (its
extend, the device lengths in place or not, the last forward's output ids,
eviction).

With `sampling`, a batch also carries its requests' sampling parameters as
SGLang's `SamplingBatchInfo` does (`benchmarks.mutable_sampling`): built at
extend, filtered and merged with the other fields.

Host mirrors are CPU tensors, converted with the same `array` + `frombuffer`
trick as batchstate's (`benchmarks.torch_host`).
"""

from __future__ import annotations

from typing import Generic, TypeVar

import torch

from benchmarks.mutable_sampling import (
    NO_SAMPLING_INFO,
    SampledReq,
    SamplingBatchInfo,
    SamplingInfo,
)
from benchmarks.torch_host import host_int64, to_device

__all__ = ["MutableAllocator", "MutableBatch"]

R = TypeVar("R", bound=SampledReq)  # the baseline's request object


class MutableAllocator:
    """Request slots (a Python free list), KV pages (a tensor free list), the table (both sides)."""

    def __init__(
        self,
        device: torch.device,
        page_size: int,
        max_reqs: int,
        num_kv_tokens: int,
        max_context_len: int,
    ) -> None:
        self.device = device
        self.page_size = page_size
        self.free_slots = list(range(1, max_reqs + 1))
        self.free_pages = torch.arange(1, num_kv_tokens // page_size + 1)
        shape = (max_reqs + 1, max_context_len)
        self.table_cpu = torch.zeros(shape, dtype=torch.int32)
        self.table = torch.zeros(shape, dtype=torch.int32, device=device)

    def alloc_pages(self, num_pages: int) -> torch.Tensor:
        """The first `num_pages` free pages, taken off the free list."""
        pages = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        return pages


class MutableBatch(Generic[R]):
    """The batch object: every field and its mirror, updated by hand in each method."""

    def __init__(self, allocator: MutableAllocator, *, sampling: bool = False) -> None:
        self.allocator = allocator
        self.sampling = sampling
        # Built by the extend when `sampling` (as SGLang's `prepare_for_extend` does).
        self.sampling_info: SamplingInfo = NO_SAMPLING_INFO
        device = self.device = allocator.device
        self.reqs: list[R] = []
        self.req_pool_indices = torch.empty(0, dtype=torch.int64, device=device)
        self.req_pool_indices_cpu = torch.empty(0, dtype=torch.int64)
        self.seq_lens = torch.empty(0, dtype=torch.int64, device=device)
        self.seq_lens_cpu = torch.empty(0, dtype=torch.int64)
        self.orig_seq_lens = torch.empty(0, dtype=torch.int32, device=device)
        self.out_cache_loc = torch.empty(0, dtype=torch.int64, device=device)
        self.input_ids = torch.empty(0, dtype=torch.int64, device=device)
        self.prefix_lens: list[int] = []
        self.extend_lens: list[int] = []
        self._seq_lens_sum: int | None = 0

    @property
    def seq_lens_sum(self) -> int:
        """Computed lazily from the host mirror, then cached until a method invalidates it."""
        if self._seq_lens_sum is None:
            self._seq_lens_sum = int(self.seq_lens_cpu.sum())
        return self._seq_lens_sum

    def _set_extend_rows(  # noqa: PLR0917  # every field an extend sets
        self,
        reqs: list[R],
        slots: list[int],
        seq_lens: list[int],
        locs: list[torch.Tensor],
        ids: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
    ) -> None:
        # The fields of a freshly extended batch, each device side uploaded from its mirror.
        self.reqs = reqs
        self.req_pool_indices_cpu = host_int64(slots)
        self.req_pool_indices = to_device(self.req_pool_indices_cpu, self.device)
        self.seq_lens_cpu = host_int64(seq_lens)
        self.seq_lens = to_device(self.seq_lens_cpu, self.device)
        self.orig_seq_lens = self.seq_lens.to(torch.int32)
        self.out_cache_loc = to_device(torch.cat(locs), self.device)
        self.input_ids = to_device(host_int64(ids), self.device)
        self.prefix_lens = prefix_lens
        self.extend_lens = extend_lens
        self._seq_lens_sum = sum(seq_lens)
        if self.sampling:
            params = [req.sampling_params for req in reqs]
            self.sampling_info = SamplingBatchInfo(params, self.device)

    def _write_decode_locs(self) -> None:
        # Each row's next KV location (a new page where it crosses a page boundary),
        # written into both sides of the table and into out_cache_loc.
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

    def filter_batch(self, keep: list[int]) -> torch.Tensor:
        """Keep the rows at `keep`, every field and its mirror; the device-side indices."""
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
        self.sampling_info.filter_batch(keep, keep_device)
        return keep_device

    def merge_batch(self, other: MutableBatch[R]) -> None:
        """Append `other`'s rows, every field and its mirror."""
        self.sampling_info.merge_batch(other.sampling_info)
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
