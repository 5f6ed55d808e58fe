"""The prefix-cache state machine on hybrid pools: window pages and a state per request.

`HybridCacheMachine` runs every rule of `CacheMachine` (extend and
`prebuilt` with shared headers, chunks, mixed steps, finishing rows into
the cache, eviction, double releases) on pools with the cache on, a
sliding window of a drawn length and a state slot per request slot. The
cache keeps full-attention pages only, so its model is the same but for
one rule: a new request reads no cached prefix (`_hit` is 0, and every
`extend`, `mix` is checked to compute from position 0), while rows of
one step still share the full-attention pages an earlier row published.
The window pool is large enough never to fall short, so the model's
predictions of every failure stay exact; after every step `check_pools`
checks conservation of window pages and states too, and no released
row's window page or state is held by anything.
"""

from __future__ import annotations

from typing import Final

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

import tests.test_prefix_cache_machine as plain
from batchstate import Holder, MemoryKinds, RecurrentState, SlidingWindow, find_leaks, make_pools
from tests.strategies import CPU, LONG
from tests.test_prefix_cache_machine import MAX_CONTEXT, CacheMachine, Prefix

MAX_EXAMPLES: Final = 600 if LONG else 50


class HybridCacheMachine(CacheMachine):
    """`CacheMachine` on hybrid pools: the cache keeps full pages, never windows or states."""

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        num_pages=st.integers(4, 24),
        max_reqs=st.integers(1, 5),
        window=st.integers(1, MAX_CONTEXT),
    )
    def start_hybrid(self, page_size: int, num_pages: int, max_reqs: int, window: int) -> None:
        """Hybrid pools with the cache on; enough window pages for every row's whole context."""
        self.page_size = page_size
        row_pages = -(-MAX_CONTEXT // page_size) + 1
        kinds = MemoryKinds(
            (
                SlidingWindow(window, max_reqs * row_pages * page_size),
                RecurrentState(state_size=4, num_states=max_reqs),
            )
        )
        self.pools = make_pools(
            max_reqs, MAX_CONTEXT, num_pages * page_size, CPU, page_size,
            prefix_cache=True, memory=kinds,
        )  # fmt: skip

    def start(self, page_size: int, num_pages: int, max_reqs: int) -> None:
        """Replaced by `start_hybrid` (not a rule here)."""
        raise AssertionError("the hybrid machine starts with start_hybrid")

    def _hit(self, ids: Prefix) -> int:
        return 0  # no window pages nor state are cached: every prompt computes from 0

    @invariant()
    def windows_and_states_follow_the_rows(self) -> None:
        """A state per live row; the cache holds no window page or state; nothing leaks."""
        pools = self.pools
        if not pools.memory.states:
            return  # before start_hybrid
        assert pools.cache.match(tuple(range(MAX_CONTEXT)))[0] == 0
        rows = self._every_row()
        assert pools.memory.states[0].num_free == pools.max_reqs - len(rows)
        windows = pools.memory.windows[0]
        held = sum(windows.row_pages(row.slot, row.seq_len).shape[0] for row in rows)
        assert len(windows.page_list) + held == windows.num_pages
        assert not find_leaks(pools, self._holders())

    def _holders(self) -> list[Holder]:
        return [self.running, *(item for item, _ in self.held)]


def test_prefix_cache_machine_on_hybrid_pools() -> None:
    """No sequence of transitions on hybrid pools with the cache on breaks an invariant."""
    plain._seen.clear()
    plain.run_machine(
        HybridCacheMachine,
        settings=settings(
            max_examples=MAX_EXAMPLES,
            stateful_step_count=plain.STEP_COUNT,
            deadline=None,
            derandomize=not LONG,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    print(f"\nhybrid prefix cache machine: {plain._seen}")
    expected = {
        "eviction",
        "published",
        "read the cache's copy",
        "chunk held",
        "OutOfKVTokens",
        "OutOfReqSlots",
        "NotOwned",
    }
    assert expected <= set(plain._seen), f"never reached: {expected - set(plain._seen)}"
    assert "hit" not in plain._seen
