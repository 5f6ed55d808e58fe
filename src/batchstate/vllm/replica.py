"""batchstate's side of a vLLM shadow: each block allocation and free replayed as transitions.

A `Replica` owns one `Pools` (prefix cache on, one page per vLLM block) and
one batchstate record per request that holds vLLM blocks: a one-row running
batch once its prompt is computed, a `Chunked` between the chunks of its
prefill. vLLM's `KVCacheManager.allocate_slots` for a request that holds no
blocks is `mix` of a new `Req` reading at most vLLM's prefix hit; for a held
chunk it is `mix` continuing it; for a running row, `decode` (one token).
`KVCacheManager.free` is `split` + `release`, keeping cached the whole pages
vLLM keeps cached for it. It needs no vLLM: `replay` runs it from a trace.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch
from returns.result import Failure

from batchstate import (
    Chunked,
    Decoding,
    Filtered,
    Pools,
    Req,
    decode,
    finish_mixed,
    idle,
    make_pools,
    mix,
    release,
    split,
)
from batchstate.errors import Error
from batchstate.pools.eviction import evict_leaves, unlocked_leaves

Running = Filtered | Decoding
"""A request whose prompt is computed: a one-row batch."""


@attrs.frozen
class Allocation:
    """One successful `allocate_slots`: the request, its tokens when it held no block
    (a new or resumed request: prompt and any output), the tokens it computes and the
    tokens it read from the prefix cache (vLLM's hit, 0 for a request holding blocks)."""

    rid: str
    tokens: tuple[int, ...]
    computed: int
    hit: int


@attrs.frozen
class Free:
    """One `KVCacheManager.free`: the request, and the tokens whose whole blocks vLLM
    keeps cached for it (its `num_cached_block` blocks)."""

    rid: str
    cached: tuple[int, ...]


@attrs.frozen
class Evict:
    """vLLM's block pool evicted the cached block that ends `tokens` (a prefix, whole
    blocks) to hand it out again: from there on, that prefix is no longer hit."""

    tokens: tuple[int, ...]


Event = Allocation | Free | Evict
"""What vLLM's KV cache manager did, in its order."""


@attrs.frozen
class Row:
    """What one side holds for a request with blocks: tokens computed (KV written or
    being written), its blocks (vLLM's ids, or batchstate's pages) and its prefix hit."""

    rid: str
    computed: int
    blocks: tuple[int, ...]
    hit: int


@attrs.frozen
class State:
    """What one side holds after a step: each request with blocks (by rid) and the
    blocks a new allocation may take (free, or cached and read by no request)."""

    rows: tuple[Row, ...]
    free_blocks: int


class ReplicaError(Error, RuntimeError):
    """batchstate refused what vLLM did: `rid` the request, the message batchstate's reason."""

    def __init__(self, rid: str, message: str) -> None:
        self.rid = rid
        super().__init__(message)


class Replica:
    """batchstate pools and records mirroring one vLLM `KVCacheManager` (`num_blocks`
    counts vLLM's null block 0, as batchstate's page 0 is padding)."""

    def __init__(self, *, num_blocks: int, block_size: int, max_reqs: int, context: int) -> None:
        self.device = torch.device("cpu")
        self.block_size = block_size
        self.pools: Pools = make_pools(
            max_reqs,
            context,
            (num_blocks - 1) * block_size,
            self.device,
            block_size,
            prefix_cache=True,
        )
        self.running: dict[str, Running] = {}
        self.held: dict[str, Chunked] = {}
        self.hits: dict[str, int] = {}
        self._ids: dict[str, int] = {}
        self._names: list[str] = []

    def _id(self, rid: str) -> int:
        number = self._ids.get(rid)
        if number is None:
            number = self._ids[rid] = len(self._names)
            self._names.append(rid)
        return number

    def allocate(self, event: Allocation) -> None:
        """Replay one `allocate_slots`."""
        rid = event.rid
        if rid in self.running:
            if event.computed != 1 or event.hit:
                raise ReplicaError(
                    rid,
                    f"allocate_slots({rid}): {event.computed} tokens for a running request;"
                    " batchstate's decode computes one",
                )
            step = decode(self.running[rid], self.pools)
            if isinstance(step, Failure):
                raise ReplicaError(
                    rid, f"allocate_slots({rid}): batchstate refused: {step.failure()}"
                )
            self.running[rid], self.pools = step.unwrap()
            return
        chunk = self.held.pop(rid, None)
        if chunk is None:
            if not event.tokens:
                raise ReplicaError(rid, f"allocate_slots({rid}): batchstate holds no row for it")
            admit: Req | Chunked = Req(self._id(rid), event.tokens)
        else:
            admit = chunk
        caps = {self._id(rid): event.hit} if chunk is None else {}
        mixed = mix(idle(self.device), [admit], event.computed, self.pools, read_at_most=caps)
        if isinstance(mixed, Failure):
            raise ReplicaError(rid, f"allocate_slots({rid}): batchstate refused: {mixed.failure()}")
        batch, self.pools = mixed.unwrap()
        if batch.num_extend_rows != 1 or int(batch.extend_lens[0]) != event.computed:
            computes = int(batch.extend_lens[0]) if batch.num_extend_rows else 0
            raise ReplicaError(
                rid,
                f"allocate_slots({rid}): vLLM computes {event.computed} tokens,"
                f" batchstate {computes}",
            )
        if chunk is None:
            self.hits[rid] = int(batch.prefix_lens[0])
        running, held = finish_mixed(batch)
        if held:
            self.held[rid] = held[0]
        else:
            self.running[rid] = running

    def free(self, event: Free) -> None:
        """Replay one `free`: the request's slot and pages go back, the whole pages of
        `event.cached` stay cached."""
        rid = event.rid
        self.hits.pop(rid, None)
        chunk = self.held.pop(rid, None)
        if chunk is not None:
            result = release(
                chunk, idle(self.device), self.pools, [self._covering(event, chunk.req)]
            )
        else:
            record = self.running.pop(rid, None)
            if record is None:
                raise ReplicaError(rid, f"free({rid}): batchstate holds no row for it")
            _, left = split(record, [])
            result = release(
                left, idle(self.device), self.pools, [self._covering(event, left.reqs[0])]
            )
        if isinstance(result, Failure):
            raise ReplicaError(rid, f"free({rid}): batchstate refused: {result.failure()}")
        self.pools = result.unwrap()

    @staticmethod
    def _covering(event: Free, req: Req) -> tuple[int, ...]:
        # batchstate published the prompt's whole pages as each chunk ended; `release` is
        # given at least those tokens, as vLLM cached them too (at allocation).
        return event.cached if len(event.cached) >= len(req.input_ids) else req.input_ids

    def evict(self, event: Evict) -> None:
        """Replay one eviction: the cached leaf holding `event.tokens` loses the block
        that ends them and anything cached below it. Which cached blocks go is policy
        (vLLM's free queue, batchstate's least-recently-used leaves): batchstate takes
        what vLLM took, so each later allocation finds the same free pages."""
        prefix = event.tokens
        start = len(prefix) - self.block_size
        for leaf, _ in unlocked_leaves(self.pools):
            if leaf[: len(prefix)] == prefix:
                self.pools = evict_leaves(self.pools, [(leaf, start)])
                return

    def state(self) -> State:
        """What batchstate holds: each request's row, and the pages an allocation may take."""
        pools = self.pools
        table = pools.table.host
        size = self.block_size
        rows: list[Row] = []
        for rid, record in self.running.items():
            slot = int(record.rows.req_pool_indices.host[0])
            length = int(record.rows.seq_lens.host[0])
            rows.append(Row(rid, length, _pages(table, slot, length, size), self.hits.get(rid, 0)))
        for rid, chunk in self.held.items():
            pages = _pages(table, chunk.slot, chunk.cached, size)
            rows.append(Row(rid, chunk.cached, pages, self.hits.get(rid, 0)))
        free = pools.num_free_tokens // size + pools.cache.num_evictable
        return State(tuple(sorted(rows, key=lambda row: row.rid)), free)


def _pages(table: np.ndarray, slot: int, length: int, size: int) -> tuple[int, ...]:
    return tuple(int(cell) // size for cell in table[slot, 0:length:size].tolist())


def names(rows: Sequence[Row]) -> tuple[str, ...]:
    """The rids of `rows`, in order."""
    return tuple(row.rid for row in rows)
