"""The speculative state machine on hybrid pools: window pages and a state per request.

`HybridMachine` runs every rule of `SpeculativeMachine` (admission, chunks,
mixed steps, decode, filter, merge, split, release, verify and sync) on
pools made with a sliding window of a drawn length and one state slot per
request slot. The window pool is at least as large as the full-attention
pool, and a row's window pages are always a subset of its pages, so the
model's predictions of every failure stay exact; `check_pools` then checks,
after every step, conservation of window pages and state slots too.
"""

from __future__ import annotations

from typing import Final

from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from batchstate import MemoryKinds, RecurrentState, SlidingWindow, find_leaks, make_pools
from tests.strategies import CPU, LONG, PoolShape, pool_shapes
from tests.test_state_machine import _counts, _failures, run_timed
from tests.test_state_machine_split import SpeculativeMachine, _roomy_shapes

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
