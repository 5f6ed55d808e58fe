"""The prefix-cache state machine on hybrid pools: window pages and a state per request.

`HybridCacheMachine` runs every rule of `CacheMachine` (extend and
`admit_prefilled` with shared headers, chunks, mixed steps, finishing rows into
the cache, eviction, double releases) on pools with the cache on, a
sliding window of a drawn length and recurrent states. Its model is the
same but for one rule: a new request reads a cached prefix only up to
the longest anchor (a window tail and a state the cache keeps) at or
before the model's full-attention match, so `_hit` cuts the model's
match back to the anchors the pools hold, and a prefix whose anchor was
evicted is never read. The window and state pools have room for a row
and an anchor per request slot, so no row falls short and the model's
predictions of every failure stay exact; `TightHybridCacheMachine` gives
them exactly that room (an anchor's tail, not a whole row, per slot), so
anchors are evicted for window pages and states (when rows take state
slots or anchors are published) while their full-attention pages stay
cached.
`flush` drops every anchor no new row resumes from, with the pages no row
reads. After every step `check_pools`
checks conservation of window pages and states (the anchors' counted),
every anchor ends a prefix the model caches, and no released row's
window page or state is held by anything.
"""

from __future__ import annotations

from typing import Final

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

import tests.properties.test_prefix_cache_machine as plain
from batchstate import (
    MemoryKinds,
    RecurrentState,
    SlidingWindow,
    SlotHolder,
    check_pools,
    find_leaks,
    flush,
    make_pools,
)
from tests.properties.test_prefix_cache_machine import MAX_CONTEXT, CacheMachine, Prefix
from tests.strategies import CPU, LONG

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
        self.anchors_seen: frozenset[Prefix] = frozenset()
        row_pages = -(-MAX_CONTEXT // page_size) + 1
        # A page-aligned anchor's tail: positions [end - window + 1, end), whole pages.
        anchor_pages = -(-(window - 1) // page_size) if self.tight else row_pages
        self.num_states = 2 * max_reqs  # a row's and the anchor it may lock, per slot
        if self.tight:  # full-attention pages to spare: anchors go for window pages and states
            num_pages *= 4
        kinds = MemoryKinds(
            (
                SlidingWindow(window, max_reqs * (row_pages + anchor_pages) * page_size),
                RecurrentState(state_size=4, num_states=self.num_states),
            )
        )
        self.pools = make_pools(
            max_reqs, MAX_CONTEXT, num_pages * page_size, CPU, page_size,
            prefix_cache=True, memory=kinds,
        )  # fmt: skip

    @property
    def tight(self) -> bool:
        """Whether window pages leave room for an anchor's tail per slot, no more."""
        return False

    def start(self, page_size: int, num_pages: int, max_reqs: int) -> None:
        """Replaced by `start_hybrid` (not a rule here)."""
        raise AssertionError("the hybrid machine starts with start_hybrid")

    def _hit(self, ids: Prefix) -> int:
        # The model's full-attention hit, cut back to the longest anchor the pools keep.
        matched = super()._hit(ids)
        anchors = self.pools.memory.cached.anchors
        page = self.page_size
        return next((end for end in range(matched, 0, -page) if tuple(ids[:end]) in anchors), 0)

    @rule()
    def flush_all(self) -> None:
        """`flush`: pages no row reads evicted, anchors no new row resumes from dropped."""
        before = self.pools
        if not before.memory.states:
            return  # before start_hybrid
        after = flush(before)
        check_pools(after, [self.running], compare_device=True)
        self.cache = {prefix: page for prefix, page in self.cache.items() if self.locks.get(prefix)}
        anchors = after.memory.cached.anchors
        locked = {prefix for prefix, anchor in before.memory.cached.anchors.items() if anchor.locks}
        assert set(anchors) == locked
        assert after.retired.shape[0] == 0
        if len(before.memory.cached.anchors) > len(anchors):
            self._seen("flushed anchors")
        self.pools, self.anchors_seen = after, frozenset(anchors)

    @invariant()
    def anchors_gone_under_pressure(self) -> None:
        """Anchors dropped while their full-attention pages stay cached: window, state pressure."""
        if not self.pools.memory.states:
            return
        anchors = frozenset(self.pools.memory.cached.anchors)
        if any(prefix in self.cache for prefix in self.anchors_seen - anchors):
            self._seen("anchor evicted, pages kept")
        self.anchors_seen = anchors

    @invariant()
    def windows_and_states_follow_the_rows(self) -> None:
        """A state per live row, the rest free or an anchor's; anchors end cached prefixes."""
        pools = self.pools
        if not pools.memory.states:
            return  # before start_hybrid
        assert pools.cache.match(tuple(range(MAX_CONTEXT)))[0] == 0  # the cache alone: never
        rows = self._every_row()
        cached = pools.memory.cached
        assert pools.memory.states[0].num_free + cached.num_states == self.num_states - len(rows)
        windows = pools.memory.windows[0]
        held = sum(windows.row_pages(row.slot, row.seq_len).shape[0] for row in rows)
        assert len(windows.page_list) + held + cached.num_window_pages == windows.num_pages
        assert all(prefix in self.cache for prefix in cached.anchors)
        assert not find_leaks(pools, self._holders())

    def _holders(self) -> list[SlotHolder]:
        return [self.running, *(item for item, _ in self.held)]


class TightHybridCacheMachine(HybridCacheMachine):
    """`HybridCacheMachine` whose window pages fit a row and one anchor's tail per slot.

    And four times the drawn full-attention pages, so anchors are rarely
    dropped with their pages. Live rows and the anchors they lock still
    always fit (a locked anchor has a live row resuming from it), so every
    failure stays predicted; the other anchors compete for window pages and
    states, and are evicted as anchors are published and rows admitted.
    With two states per slot rows and anchors cannot crowd the window pages
    a growing row needs: that eviction is `tests/cache/test_hybrid_cache.py`'s.
    """

    @property
    def tight(self) -> bool:
        """Always: window pages for a row and an anchor's tail per slot."""
        return True


def _run(machine: type[HybridCacheMachine]) -> None:
    plain._seen.clear()
    plain.run_machine(
        machine,
        settings=settings(
            max_examples=MAX_EXAMPLES,
            stateful_step_count=plain.STEP_COUNT,
            deadline=None,
            derandomize=not LONG,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    print(f"\n{machine.__name__}: {plain._seen}")


def test_prefix_cache_machine_on_hybrid_pools() -> None:
    """No sequence of transitions on hybrid pools with the cache on breaks an invariant."""
    _run(HybridCacheMachine)
    expected = {
        "flushed anchors",
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


def test_prefix_cache_machine_on_tight_hybrid_pools() -> None:
    """Anchors evicted for window pages and states: no invariant breaks, no row falls short."""
    _run(TightHybridCacheMachine)
    expected = {"anchor evicted, pages kept", "flushed anchors", "hit", "published"}
    assert expected <= set(plain._seen), f"never reached: {expected - set(plain._seen)}"
