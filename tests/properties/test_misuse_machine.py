"""A state machine mixing legal steps with misuse: no live slot or page is ever handed out twice.

Legal rules admit, decode and release requests, with the prefix cache off
or on. Misuse rules hand the public doors what a careless caller would: a
released record again, a record of another pools lineage, stale pools,
lengths that shrink a live slot, counts below zero, a consumed verify
window. Each must be refused with every input unchanged. After every
step, each live row's slot is its own and its pages are its own (neither
free nor another row's), and the pools pass their invariants.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from returns.result import Failure, Success

from batchstate import (
    Decoding,
    DraftError,
    Filtered,
    Idle,
    PoolsArgumentError,
    Req,
    StalePools,
    StaleRecord,
    check_pools,
    decode,
    extend,
    filter_batch,
    idle,
    make_pools,
    merge,
    release,
    sync,
    verify,
)
from batchstate.base.mirrored import host_int64
from tests.strategies import assert_unchanged, snapshot

CPU: Final = torch.device("cpu")
PAGE: Final = 4


class MisuseMachine(RuleBasedStateMachine):
    """Legal steps and misuse, interleaved; the pools' memory stays one owner per page."""

    def __init__(self) -> None:
        super().__init__()
        self.pools = make_pools(6, 48, 96, CPU, PAGE)
        self.running: Filtered | Decoding | Idle = idle(CPU)
        self.released: list[Filtered] = []  # records already given back
        self.next_rid = 0

    @initialize(cache=st.booleans())
    def start(self, cache: bool) -> None:
        self.pools = make_pools(6, 48, 96, CPU, PAGE, prefix_cache=cache)

    # ---- legal steps ----

    @rule(length=st.integers(1, 12))
    def admit(self, length: int) -> None:
        req = Req(self.next_rid, tuple(range(1, length + 1)))
        result = extend(idle(CPU), [req], self.pools)
        if isinstance(result, Success):
            self.next_rid += 1
            extended, self.pools = result.unwrap()
            decoded, self.pools = decode(extended, self.pools).unwrap()
            incoming = filter_batch(decoded, [0])
            running = self.running
            if isinstance(running, Idle):
                self.running = incoming
            else:
                base = (
                    running
                    if isinstance(running, Filtered)
                    else filter_batch(running, list(range(len(running.rows.reqs))))
                )
                self.running = merge(base, incoming)

    @precondition(lambda self: not isinstance(self.running, Idle))
    @rule()
    def step(self) -> None:
        running = self.running
        assert not isinstance(running, Idle)
        result = decode(running, self.pools)
        if isinstance(result, Success):
            self.running, self.pools = result.unwrap()

    @precondition(lambda self: not isinstance(self.running, Idle))
    @rule(data=st.data())
    def finish_one(self, data: st.DataObject) -> None:
        running = self.running
        assert not isinstance(running, Idle)
        rows = len(running.rows.reqs)
        leaving = data.draw(st.integers(0, rows - 1))
        keep = [row for row in range(rows) if row != leaving]
        left = filter_batch(running, [leaving])
        staying = filter_batch(running, keep)
        self.pools = release(left, staying, self.pools).unwrap()
        self.running = staying if keep else idle(CPU)
        self.released.append(left)

    # ---- misuse: each refused, nothing changed ----

    @precondition(lambda self: bool(self.released))
    @rule(data=st.data())
    def release_again(self, data: st.DataObject) -> None:
        left = data.draw(st.sampled_from(self.released))
        self._refused(lambda: release(left, idle(CPU), self.pools))

    @precondition(lambda self: bool(self.released))
    @rule(data=st.data())
    def decode_a_released_record(self, data: st.DataObject) -> None:
        left = data.draw(st.sampled_from(self.released))
        self._refused(lambda: decode(left, self.pools), StaleRecord)

    @precondition(lambda self: not isinstance(self.running, Idle))
    @rule()
    def decode_in_another_lineage(self) -> None:
        other = make_pools(6, 48, 96, CPU, PAGE)
        before = snapshot(other)
        running = self.running
        assert not isinstance(running, Idle)
        with pytest.raises(StaleRecord):
            decode(running, other)
        assert_unchanged(before, other)

    @precondition(lambda self: not isinstance(self.running, Idle))
    @rule(shrink_by=st.integers(1, 3))
    def allocate_over_a_live_slot(self, shrink_by: int) -> None:
        rows = self.running.rows
        slot, held = int(rows.req_pool_indices.host[0]), int(rows.seq_lens.host[0])
        old, new = host_int64([max(held - shrink_by, 0)]), host_int64([held])
        self._refused(
            lambda: self.pools.allocate_tokens(host_int64([slot]), old, new), PoolsArgumentError
        )

    @rule(count=st.integers(-5, -1))
    def negative_slot_count(self, count: int) -> None:
        self._refused(lambda: self.pools.allocate_slots(count), PoolsArgumentError)

    @precondition(lambda self: isinstance(self.running, Decoding))
    @rule()
    def sync_a_window_twice(self) -> None:
        running = self.running
        assert isinstance(running, Decoding)
        result = verify(running, [0] * len(running.rows.reqs), self.pools)
        if not isinstance(result, Success):
            return
        window, pools = result.unwrap()
        self.running, self.pools = sync(window, np.zeros(len(window.reqs), np.int64), pools)
        self._refused(lambda: release(window, idle(CPU), self.pools))
        self._refused(
            lambda: sync(window, np.zeros(len(window.reqs), np.int64), self.pools), DraftError
        )

    @rule()
    def stale_pools(self) -> None:
        older = self.pools
        result = extend(idle(CPU), [Req(10_000 + self.next_rid, (1,))], older)
        if not isinstance(result, Success):
            return
        extended, newer = result.unwrap()
        with pytest.raises(StalePools):
            older.allocate_slots(1)
        self.pools = release(extended, idle(CPU), newer).unwrap()

    def _refused(self, call: object, error: type[Exception] | None = None) -> None:
        assert callable(call)
        before = snapshot((self.pools, self.running))
        if error is None:
            assert isinstance(call(), Failure)
        else:
            with pytest.raises(error):
                call()
        assert_unchanged(before, (self.pools, self.running))
        assert self.pools.is_newest

    # ---- no live slot or page handed out twice ----

    @invariant()
    def every_live_slot_and_page_has_one_owner(self) -> None:
        pools, rows = self.pools, self.running.rows
        slots = rows.req_pool_indices.host
        assert np.unique(slots).shape[0] == slots.shape[0]
        assert not np.isin(slots, pools.free_slots).any()
        pages = [
            pools.table.host[slot, :length:PAGE] // PAGE
            for slot, length in zip(slots.tolist(), rows.seq_lens.host.tolist(), strict=True)
        ]
        private = np.concatenate(pages) if pages else np.empty(0, np.int64)
        if not pools.cache.enabled:
            assert np.unique(private).shape[0] == private.shape[0], "a page in two rows"
        assert not np.isin(private, pools.free_pages).any(), "a live row's page is free"
        check_pools(pools, [self.running], compare_device=True)


MisuseMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_misuse_machine = MisuseMachine.TestCase
