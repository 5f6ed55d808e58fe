"""(a) batchstate's production step: public transitions only, the prefix cache on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from batchstate import (
    Chunked,
    Filtered,
    Idle,
    Mixed,
    Pools,
    Req,
    Rows,
    Sampled,
    Sampling,
    decode_sampled,
    extend,
    finish_mixed,
    gather_sampled,
    idle,
    join_sampled,
    make_pools,
    merge,
    mix,
    release,
    split,
)
from benchmarks.production_plan import FIRST_CHUNK, ProductionPlan, Turn, generated
from benchmarks.production_state import ProductionOutcome
from benchmarks.sampling_values import request_sampling, sampling_rows

__all__ = ["BatchstateProduction"]


class BatchstateProduction:
    """The harness holds the newest records, sampled tokens and pools; each phase replaces them.

    With `sampling`, the batch carries the standard `Sampling` columns: every
    request joins with its own parameters, and every transition moves them.
    """

    def __init__(self, plan: ProductionPlan, *, sampling: bool = False) -> None:
        self.name = "batchstate+sampling" if sampling else "batchstate"
        self._device = plan.device
        self._sampling = sampling
        self._idle: Idle[Any] = idle(plan.device, Sampling) if sampling else idle(plan.device)
        pools = make_pools(
            plan.max_reqs,
            plan.max_context_len,
            plan.num_kv_tokens,
            plan.device,
            plan.page_size,
            prefix_cache=True,
        )
        running: Filtered[Any] | None = None
        # One request at a time, so that each reads the system prompt the ones before cached.
        for rid, ids in plan.initial:
            reqs = [Req(rid, ids)]
            extended, pools = extend(self._idle, reqs, pools, *self._columns(reqs)).unwrap()
            running = merge(self._idle if running is None else running, extended)
        assert running is not None
        rid, ids = plan.held
        reqs = [Req(rid, ids)]
        first: Mixed[Any]
        first, pools = mix(self._idle, reqs, FIRST_CHUNK, pools, (), *self._columns(reqs)).unwrap()
        # mypy cannot solve finish_mixed's column set from Any; the set is the batch's either way.
        (self.held,) = finish_mixed(cast("Mixed[Sampling]", first)).held
        self.running: Filtered[Any] = running
        self.pools: Pools = pools
        self.sampled = Sampled.of(running.rows, _sample(running.rows))
        self.hits = 0  # new requests that read a cached prefix
        self._decoded: Mixed[Any] | None = None
        self._prefill: Mixed[Any] | None = None
        self._decoded_sampled = self._prefill_sampled = self.sampled
        self._after_decode = self._joined = running
        self._generated: tuple[int, ...] = ()
        self._kept = running

    def _columns(self, reqs: Sequence[Req]) -> tuple[Sampling, ...]:
        # What a scheduler pays per admission: its requests' parameters as columns.
        if not self._sampling:
            return ()
        params = [request_sampling(req.rid) for req in reqs]
        return (Sampling.of(params, self._device),)

    def decode(self) -> None:
        self._decoded, self.pools = decode_sampled(self.running, self.sampled, self.pools).unwrap()

    def prefill(self, turn: Turn) -> None:
        # The budget finishes the held chunk and gives the new request its first chunk.
        new = Req(turn.rid, turn.input_ids)
        admit: list[Req | Chunked[Any]] = [self.held, new]
        budget = self.held.remaining + FIRST_CHUNK
        self._prefill, self.pools = mix(
            self._idle, admit, budget, self.pools, (), *self._columns([new])
        ).unwrap()

    def forward(self, turn: Turn) -> None:
        """Untimed: the two forwards sample, and the host learns what the finished row made."""
        assert self._decoded is not None and self._prefill is not None
        rows = self._decoded.rows
        self._decoded_sampled = Sampled.of(rows, _sample(rows))
        self._prefill_sampled = Sampled.of(self._prefill.rows, _sample(self._prefill.rows))
        self.hits += int(self._prefill.prefix_lens[1] > 0)
        row = turn.finished_row
        rid, seq_len = int(rows.rids[row]), int(rows.seq_lens.host[row])
        start = len(rows.reqs[row].input_ids)
        self._generated = tuple(generated(rid, p) for p in range(start, seq_len))

    def settle(self) -> None:
        assert self._decoded is not None and self._prefill is not None
        self._after_decode = finish_mixed(self._decoded).running
        joined, (self.held,) = finish_mixed(self._prefill)
        self._joined = joined

    def release(self, turn: Turn) -> None:
        kept, left = split(self._after_decode, turn.keep)
        tokens = [left.reqs[0].input_ids + self._generated]
        self.pools = release(left, kept, self.pools, tokens).unwrap()
        self._kept = kept

    def merge(self) -> None:
        kept, joined = self._kept, self._joined
        self.running = merge(kept, joined)
        # Both forwards' tokens joined, then one gather in the merged batch's order.
        both = join_sampled(self._decoded_sampled, self._prefill_sampled)
        self.sampled = gather_sampled(both, self.running)

    def outcome(self) -> ProductionOutcome:
        """The state after a decode, as host data."""
        assert self._decoded is not None
        rows, pools = self._decoded.rows, self.pools
        slots = rows.req_pool_indices.host.tolist()
        seq_lens = rows.seq_lens.host.tolist()
        table = pools.table.device
        cache = pools.cache
        return ProductionOutcome(
            rows.rids.tolist(),
            slots,
            rows.req_pool_indices.device.tolist(),
            seq_lens,
            rows.seq_lens.device.tolist(),
            self._decoded.input_ids.device.tolist(),
            [table[slot, :length].tolist() for slot, length in zip(slots, seq_lens, strict=True)],
            (self.held.req.rid, self.held.slot, self.held.cached),
            pools.free_slots.tolist(),
            pools.free_pages.tolist(),
            dict(cache.entries()),
            cache.num_evicted,
            self.hits,
            sampling_rows(rows.columns),
        )


def _sample(rows: Rows[Any]) -> torch.Tensor:
    # The fake forward: each row's next token, on the rows' device.
    tokens = [
        generated(rid, seq_len)
        for rid, seq_len in zip(rows.rids.tolist(), rows.seq_lens.host.tolist(), strict=True)
    ]
    return torch.tensor(tokens, dtype=torch.int64, device=rows.device)
