"""The speculative and misuse state machines on hybrid pools: window pages and a state per request.

`HybridMachine` runs every rule of `SpeculativeMachine` (admission, chunks,
mixed steps, decode, filter, merge, split, release, verify and sync) on
pools made with a sliding window of a drawn length and one state slot per
request slot. The window pool is at least as large as the full-attention
pool, and a row's window pages are always a subset of its pages, so the
model's predictions of every failure stay exact; `check_pools` then checks,
after every step, conservation of window pages and state slots too.
`HybridMisuseMachine` runs the misuse machine on hybrid pools: every misuse
refused with every input unchanged, and no live window page or state slot
ever free or another row's.
"""

from __future__ import annotations

from typing import Final

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from batchstate import MemoryKinds, RecurrentState, SlidingWindow, find_leaks, make_pools
from tests.properties.test_misuse_machine import PAGE, MisuseMachine
from tests.properties.test_state_machine import _counts, _failures, run_timed
from tests.properties.test_state_machine_split import SpeculativeMachine, _roomy_shapes
from tests.strategies import CPU, LONG, PoolShape, pool_shapes

MAX_EXAMPLES: Final = 1000 if LONG else 60


class HybridMachine(SpeculativeMachine):
    """`SpeculativeMachine` on pools with window pages and state slots."""

    @initialize(shape=st.one_of(pool_shapes(), _roomy_shapes()), window=st.integers(1, 64))
    def start(self, shape: PoolShape, window: int) -> None:
        """Hybrid pools of a drawn shape and window (cut to the context)."""
        super().start(shape)
        page = shape.page_size
        window = min(window, shape.max_context_len)
        one_row = (-(-window // page) + 1) * page
        kinds = MemoryKinds(
            (
                SlidingWindow(window, max(shape.num_kv_tokens, one_row)),
                RecurrentState(state_size=4, num_states=shape.max_reqs),
            )
        )
        self.pools = make_pools(*shape[:3], CPU, page, memory=kinds)

    @invariant()
    def hybrid_memory_follows_the_slots(self) -> None:
        """Every owned slot holds a state; leaked slots name their window pages and states."""
        pools = self.pools
        if not pools.is_newest or not pools.memory.states:
            return
        states = pools.memory.states[0]
        owned = pools.slot_gens.nonzero()[0]
        assert states.num_free == pools.max_reqs - owned.shape[0]
        leaks = find_leaks(pools, self._holders())
        assert leaks.unheld_states == (len(leaks.unheld) if leaks.unheld else 0)
        _counts["hybrid_steps"] = _counts.get("hybrid_steps", 0) + 1


def test_hybrid_state_machine() -> None:
    """No sequence of transitions on hybrid pools breaks conservation of any kind."""
    _counts.update(examples=0, steps=0, continued=0, synced=0, hybrid_steps=0)
    _failures.clear()
    elapsed = run_timed(HybridMachine, MAX_EXAMPLES)
    print(
        f"\nhybrid state machine: {_counts['examples']} runs, {_counts['hybrid_steps']} checked"
        f" states, {_counts['synced']} syncs in {elapsed:.1f} s; failures seen: {_failures}"
    )
    assert _counts["hybrid_steps"] > _counts["examples"], "the machine ran no steps"
    assert {"OutOfKVTokens", "OutOfReqSlots"} <= set(_failures)


class HybridMisuseMachine(MisuseMachine):
    """The misuse machine on hybrid pools: every misuse refused, window pages and states too."""

    @initialize()
    def start(self) -> None:  # no cache to draw: hybrid pools refuse it
        kinds = MemoryKinds((SlidingWindow(6, 96), RecurrentState(state_size=4, num_states=6)))
        self.pools = make_pools(6, 48, 96, CPU, PAGE, memory=kinds)

    @invariant()
    def every_live_window_page_and_state_has_one_owner(self) -> None:
        pools, rows = self.pools, self.running.rows
        if not pools.memory.windows:
            return  # before start
        windows, states = pools.memory.windows[0], pools.memory.states[0]
        slots, lens = rows.req_pool_indices.host.tolist(), rows.seq_lens.host.tolist()
        held = [windows.row_pages(slot, length) for slot, length in zip(slots, lens, strict=True)]
        pages = np.concatenate(held) if held else np.empty(0, np.int64)
        assert np.unique(pages).shape[0] == pages.shape[0], "a window page in two rows"
        assert not np.isin(pages, windows.page_list.ids).any(), "a live row's window page is free"
        owned = states.of_slot[rows.req_pool_indices.host]
        assert (owned > 0).all() and not np.isin(owned, states.free.ids).any()


HybridMisuseMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_hybrid_misuse_machine = HybridMisuseMachine.TestCase
