"""The prefix-cache state machine on hybrid pools: window pages and a state per request.

`HybridCacheMachine` runs every rule of `CacheMachine` (extend and
`prebuilt` with shared headers, chunks, mixed steps, finishing rows into
the cache, eviction, double releases) on pools with the cache on, a
sliding window of a drawn length and recurrent states. Its model is the
same but for one rule: a new request reads a cached prefix only up to
the longest anchor (a window tail and a state the cache keeps) at or
before the model's full-attention match, so `_hit` cuts the model's
match back to the anchors the pools hold, and a prefix whose anchor was
evicted is never read. The window and state pools have room for a row
and an anchor per request slot, so neither falls short and the model's
predictions of every failure stay exact; after every step `check_pools`
checks conservation of window pages and states (the anchors' counted),
every anchor ends a prefix the model caches, and no released row's
window page or state is held by anything.
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
    """`CacheMachine` on hybrid pools: the cache keeps full pages, and anchors to resume from."""

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        num_pages=st.integers(4, 24),
        max_reqs=st.integers(1, 5),
        window=st.integers(1, MAX_CONTEXT),
    )
    def start_hybrid(self, page_size: int, num_pages: int, max_reqs: int, window: int) -> None:
        """Hybrid pools with the cache on; window pages and states for a row and an anchor each."""
        self.page_size = page_size
        row_pages = -(-MAX_CONTEXT // page_size) + 1
        kinds = MemoryKinds(
            (
                SlidingWindow(window, 2 * max_reqs * row_pages * page_size),
                RecurrentState(state_size=4, num_states=2 * max_reqs),
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
        # The model's full-attention hit, cut back to the longest anchor the pools keep.
        matched = super()._hit(ids)
        anchors = self.pools.memory.cached.anchors
        page = self.page_size
        return next((end for end in range(matched, 0, -page) if tuple(ids[:end]) in anchors), 0)

    @invariant()
    def windows_and_states_follow_the_rows(self) -> None:
        """A state per live row, the rest free or an anchor's; anchors end cached prefixes."""
        pools = self.pools
        if not pools.memory.states:
            return  # before start_hybrid
        assert pools.cache.match(tuple(range(MAX_CONTEXT)))[0] == 0  # the cache alone: never
        rows = self._every_row()
        cached = pools.memory.cached
        assert pools.memory.states[0].num_free + cached.num_states == 2 * pools.max_reqs - len(rows)
        windows = pools.memory.windows[0]
        held = sum(windows.row_pages(row.slot, row.seq_len).shape[0] for row in rows)
        assert len(windows.page_list) + held + cached.num_window_pages == windows.num_pages
        assert all(prefix in self.cache for prefix in cached.anchors)
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
    assert "hit" in plain._seen  # rows resumed from anchors
