"""(b) The production step as SGLang's scheduler does it: a mutable batch and a radix tree.

Written from a description of SGLang's `ScheduleBatch` and scheduler (not from
their code): `prepare_for_decode` takes its input ids from the last forward's
`output_ids` (overlap) and evicts from the tree when free pages run short;
the prefill matches the new request's prefix (`match_prefix`), locks it
(`inc_lock_ref`), truncates it to its chunk and runs `prepare_for_extend`
over the held chunk and it (writing each row's cached prefix into its table
row, as SGLang does every chunk); after the forward `cache_unfinished_req`
caches each chunk's whole pages, the finished request goes through
`cache_finished_req`, and `filter_batch` and `merge_batch` carry
`output_ids` along on the device. The batch and its allocator are
`benchmarks.mutable_batch`'s, shared with the plain mutable baseline; this
step adds its prefix-aware extend, its out-of-place decode, `output_ids`
and eviction. Two facts differ from some SGLang versions and
are chosen to match batchstate's bookkeeping: eviction frees the shortfall
(newer SGLang; older ones evict a whole request's worth), and a held chunk
keeps its request slot (older SGLang frees it and takes a new one).

With `sampling`, every request carries its sampling parameters and each
prefill batch builds SGLang's `SamplingBatchInfo` of its rows (the held chunk's
included), which the settle's and release's filters and the merge carry
(`benchmarks.mutable_sampling`).
"""

from __future__ import annotations

from typing import Final

import torch

from batchstate import GREEDY, SamplingParams
from benchmarks.mutable_batch import MutableAllocator, MutableBatch
from benchmarks.production_plan import FIRST_CHUNK, ProductionPlan, Turn, generated
from benchmarks.production_state import ProductionOutcome
from benchmarks.radix_tree import MutableReq, RadixCache, TreeNode
from benchmarks.sampling_values import request_sampling
from benchmarks.torch_host import to_device

__all__ = ["MutableProduction"]


class _Pools(MutableAllocator):
    """The shared allocator, with a radix tree: a short free list evicts from the tree first."""

    def __init__(self, plan: ProductionPlan) -> None:
        super().__init__(
            plan.device, plan.page_size, plan.max_reqs, plan.num_kv_tokens, plan.max_context_len
        )
        self.tree = RadixCache(self, plan.page_size)

    def alloc_pages(self, num_pages: int) -> torch.Tensor:
        short = num_pages - self.free_pages.shape[0]
        if short > 0:
            self.tree.evict(short)
        return super().alloc_pages(num_pages)

    def free(self, locs: torch.Tensor) -> None:
        # KV token locations, starting at a page boundary: give back their pages.
        if not locs.shape[0]:
            return
        pages = locs[:: self.page_size].to(torch.int64)
        if self.page_size > 1:
            pages = pages // self.page_size
        self.free_pages = torch.cat((self.free_pages, pages))


class _Req(MutableReq):
    """SGLang's request, with its sampling parameters."""

    __slots__ = ("sampling_params",)

    def __init__(
        self, rid: int, origin_input_ids: list[int], root: TreeNode, params: SamplingParams
    ) -> None:
        super().__init__(rid, origin_input_ids, root)
        self.sampling_params = params


class _Batch(MutableBatch[_Req]):
    """A `ScheduleBatch`-like batch: the shared one, with the last forward's `output_ids`."""

    def __init__(self, pools: _Pools, *, sampling: bool) -> None:
        super().__init__(pools, sampling=sampling)
        self.output_ids: torch.Tensor | None = None

    def prepare_for_extend(self, reqs: list[_Req]) -> None:
        pools, page_size = self.allocator, self.allocator.page_size
        slots: list[int] = []
        for req in reqs:
            if req.req_pool_idx is None:  # a held chunk keeps its slot
                req.req_pool_idx = pools.free_slots.pop(0)
            slots.append(req.req_pool_idx)
        seq_lens = [len(req.fill_ids) for req in reqs]
        prefix_lens = [len(req.prefix_indices) for req in reqs]
        extend_lens = [req.extend_input_len for req in reqs]
        for slot, req, pre_len in zip(slots, reqs, prefix_lens, strict=True):
            if pre_len:
                cells = req.prefix_indices.to(torch.int32)
                pools.table_cpu[slot, :pre_len] = cells
                pools.table[slot, :pre_len] = to_device(cells, self.device)
        # Pages: a row fills its partly filled last page first, then takes new ones.
        new_pages = [
            -(-seq_len // page_size) - -(-pre_len // page_size)
            for seq_len, pre_len in zip(seq_lens, prefix_lens, strict=True)
        ]
        pages = pools.alloc_pages(sum(new_pages))
        locs, first = [], 0
        for slot, pre_len, seq_len, num in zip(
            slots, prefix_lens, seq_lens, new_pages, strict=True
        ):
            own = pages[first : first + num]
            first += num
            if page_size == 1:
                row = own
            else:
                lanes = (own * page_size).repeat_interleave(page_size)
                lanes = lanes + torch.arange(lanes.shape[0]) % page_size
                start = pre_len % page_size
                if start:  # continue the last page
                    last = int(pools.table_cpu[slot, pre_len - 1])
                    head = torch.arange(last + 1, last + 1 + page_size - start)
                    lanes = torch.cat((head, lanes))
                row = lanes[: seq_len - pre_len]
            cells = row.to(torch.int32)
            pools.table_cpu[slot, pre_len:seq_len] = cells
            pools.table[slot, pre_len:seq_len] = to_device(cells, self.device)
            locs.append(row)
        ids = [
            token
            for req, pre in zip(reqs, prefix_lens, strict=True)
            for token in req.fill_ids[pre:]
        ]
        self._set_extend_rows(reqs, slots, seq_lens, locs, ids, prefix_lens, extend_lens)

    def prepare_for_decode(self) -> None:
        assert self.output_ids is not None
        self.input_ids, self.output_ids = self.output_ids, None  # overlap: the last forward's
        self._write_decode_locs()
        # Overlap mode: not in place (the last forward may still read them).
        self.seq_lens_cpu = self.seq_lens_cpu + 1
        self.seq_lens = self.seq_lens + 1
        self.orig_seq_lens = self.orig_seq_lens + 1
        if self._seq_lens_sum is not None:
            self._seq_lens_sum += len(self.reqs)

    def filter_batch(self, keep: list[int]) -> torch.Tensor:
        keep_device = super().filter_batch(keep)
        if self.output_ids is not None:
            self.output_ids = self.output_ids[keep_device]
        return keep_device

    def merge_batch(self, other: MutableBatch[_Req]) -> None:
        super().merge_batch(other)
        assert isinstance(other, _Batch)
        if self.output_ids is not None and other.output_ids is not None:
            self.output_ids = torch.cat((self.output_ids, other.output_ids))


class MutableProduction:
    """The production step as SGLang's scheduler runs it, one phase per method."""

    name: Final = "mutable"

    def __init__(self, plan: ProductionPlan, *, sampling: bool = False) -> None:
        self.pools = pools = _Pools(plan)
        self.sampling = sampling
        tree = pools.tree
        running: _Batch | None = None
        for rid, ids in plan.initial:
            req = self._req(rid, ids)
            batch = self._admit(req, len(ids))
            tree.cache_unfinished_req(req)
            if running is None:
                running = batch
            else:
                running.merge_batch(batch)
        assert running is not None
        self.running = running
        self.running.output_ids = _sample(running)
        rid, ids = plan.held
        self.chunked_req = self._req(rid, ids)
        self._admit(self.chunked_req, FIRST_CHUNK)
        tree.cache_unfinished_req(self.chunked_req)
        self.hits = 0
        self._prefill = running
        self._done = self.chunked_req

    def _req(self, rid: int, input_ids: tuple[int, ...]) -> _Req:
        # What a scheduler pays per admission: the request's parameters, when it has them.
        params = request_sampling(rid) if self.sampling else GREEDY
        return _Req(rid, list(input_ids), self.pools.tree.root, params)

    def _admit(self, req: _Req, budget: int) -> _Batch:
        # A new request: match and lock its cached prefix, truncate it to its chunk, prefill.
        tree = self.pools.tree
        req.init_next_round_input(tree)
        tree.inc_lock_ref(req.last_node)
        self._truncate(req, budget)
        batch = _Batch(self.pools, sampling=self.sampling)
        batch.prepare_for_extend([req])
        return batch

    @staticmethod
    def _truncate(req: MutableReq, budget: int) -> int:
        take = min(req.extend_input_len, budget)
        req.extend_input_len = take
        req.fill_ids = req.fill_ids[: len(req.prefix_indices) + take]
        return budget - take

    def decode(self) -> None:
        self.running.prepare_for_decode()

    def prefill(self, turn: Turn) -> None:
        tree = self.pools.tree
        chunked = self.chunked_req
        chunked.init_next_round_input()  # it reads its own prefix: no match
        left = self._truncate(chunked, chunked.extend_input_len + FIRST_CHUNK)
        new = self._req(turn.rid, turn.input_ids)
        new.init_next_round_input(tree)
        tree.inc_lock_ref(new.last_node)
        self._truncate(new, left)
        batch = _Batch(self.pools, sampling=self.sampling)
        batch.prepare_for_extend([chunked, new])
        self._prefill = batch

    def forward(self, turn: Turn) -> None:
        """Untimed: the two forwards sample, and the host learns what the finished row made."""
        self.running.output_ids = _sample(self.running)
        self._prefill.output_ids = _sample(self._prefill)
        self.hits += self._prefill.prefix_lens[1] > 0
        req = self.running.reqs[turn.finished_row]
        seq_len = int(self.running.seq_lens_cpu[turn.finished_row])
        start = len(req.origin_input_ids)
        req.output_ids = [generated(req.rid, p) for p in range(start, seq_len)]

    def settle(self) -> None:
        tree = self.pools.tree
        done, chunked = self._prefill.reqs
        tree.cache_unfinished_req(done)
        tree.cache_unfinished_req(chunked)
        self._prefill.filter_batch([0])  # the held chunk waits out of the batch
        self.chunked_req = chunked

    def release(self, turn: Turn) -> None:
        running = self.running
        row = turn.finished_row
        req = running.reqs[row]
        self.pools.tree.cache_finished_req(req, int(running.seq_lens_cpu[row]))
        assert req.req_pool_idx is not None
        self.pools.free_slots.append(req.req_pool_idx)
        running.filter_batch(turn.keep)

    def merge(self) -> None:
        self.running.merge_batch(self._prefill)

    def outcome(self) -> ProductionOutcome:
        """The state after a decode, as host data."""
        batch, pools = self.running, self.pools
        slots = batch.req_pool_indices_cpu.tolist()
        seq_lens = batch.seq_lens_cpu.tolist()
        chunked = self.chunked_req
        assert chunked.req_pool_idx is not None
        return ProductionOutcome(
            [req.rid for req in batch.reqs],
            slots,
            batch.req_pool_indices.tolist(),
            seq_lens,
            batch.seq_lens.tolist(),
            batch.input_ids.tolist(),
            [
                pools.table[slot, :length].tolist()
                for slot, length in zip(slots, seq_lens, strict=True)
            ],
            (chunked.rid, chunked.req_pool_idx, len(chunked.fill_ids)),
            list(pools.free_slots),
            pools.free_pages.tolist(),
            pools.tree.entries(),
            pools.tree.num_evicted,
            self.hits,
            batch.sampling_info.values(),
        )


def _sample(batch: _Batch) -> torch.Tensor:
    # The fake forward: each row's next token, on the batch's device.
    tokens = [
        generated(req.rid, seq_len)
        for req, seq_len in zip(batch.reqs, batch.seq_lens_cpu.tolist(), strict=True)
    ]
    return torch.tensor(tokens, dtype=torch.int64, device=batch.device)
