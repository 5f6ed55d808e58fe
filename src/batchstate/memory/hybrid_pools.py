"""The memory of a hybrid model's other layers, held by `Pools` beside full-attention pages.

`Pools.memory` is a `HybridPools`: the described kinds and, per kind, the
value that allocates it. For a full-attention model both tuples are empty
(`NO_HYBRID`, shared), and every pool function skips this module after
one truthiness test. Each function here returns a new value or a failure,
and changes nothing it is given: the pools functions that call them
commit the pools that hold the result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Final, final

import attrs
import numpy as np

from batchstate.base.errors import OutOfKVTokens
from batchstate.base.mirrored import HostArray, frozen, writing
from batchstate.base.read_only import read_only_copies
from batchstate.cache.anchors import NO_ANCHORS, HybridCache, tail_start
from batchstate.cache.radix import Tokens
from batchstate.memory.kinds import FULL_ATTENTION, MemoryKinds
from batchstate.memory.state_slots import StateSlots
from batchstate.memory.window_pages import WindowPages

__all__ = ["NO_HYBRID", "HybridPools", "hybrid_pools"]


@read_only_copies
@final
@attrs.frozen(eq=False, repr=False)
class HybridPools:
    """Window pages and state slots of a hybrid model's pools: empty for full attention.

    `windows` holds one `WindowPages` if the model has sliding-window layers,
    `states` one `StateSlots` if it keeps recurrent states; a request slot
    holds its window pages and its state slot from allocation to release.
    With the prefix cache on, `cached` holds the cache's anchors (window
    tails and states a request may resume from, `cache.anchors`), drawn
    from the same window pages and state slots.
    """

    kinds: MemoryKinds
    windows: tuple[WindowPages, ...]
    states: tuple[StateSlots, ...]
    cached: HybridCache = NO_ANCHORS

    def free_states(self) -> int:
        """State slots free now (the most requests a new allocation may admit)."""
        return self.states[0].num_free if self.states else 0

    @contextmanager
    def probing(self) -> Iterator[None]:
        """Allocations tried and dropped inside leave the window tables bit for bit as they were.

        Growing a row writes its new window pages into cells past every row's
        end, which no value reads; a failure that counts what would fit tries
        allocations it never commits, so it puts those cells back.
        """
        kept = [window.table.copy() for window in self.windows]
        try:
            yield
        finally:
            for window, table in zip(self.windows, kept, strict=True):
                with writing(window.table):
                    window.table[...] = table

    def free_or_evictable_states(self) -> int:
        """State slots free now or held by anchors eviction may drop."""
        return self.free_states() + (self.cached.evictable()[1] if self.cached.anchors else 0)

    def take_slots(self, slots: HostArray) -> HybridPools:
        """A state slot for each new request slot (enough free or evictable: anchors evicted)."""
        if not self.states:
            return self
        short = slots.shape[0] - self.free_states()
        pools = self._evicted(0, short) if short > 0 else self
        states = (pools.states[0].take(slots),)
        return HybridPools(self.kinds, pools.windows, states, pools.cached)

    def admit(self, slots: HostArray) -> HybridPools:
        """New request slots, pending until they grow: none leaves unwritten memory cached."""
        return HybridPools(self.kinds, self.windows, self.states, self.cached.admit(slots.tolist()))

    def settle(self, slots: list[int]) -> HybridPools:
        """The copies `slots` had pending ran: the anchors they name are unlocked."""
        if not any(slot in self.cached.pending for slot in slots):
            return self
        return HybridPools(self.kinds, self.windows, self.states, self.cached.copies_ran(slots))

    def hold(self, prefixes: list[Tokens]) -> HybridPools:
        """Anchors matched by new rows, locked before their slots are taken: none is evicted."""
        cached = self.cached
        for prefix in prefixes:
            cached = cached.hold(prefix)
        return HybridPools(self.kinds, self.windows, self.states, cached)

    def resume(self, slots: list[int], prefixes: list[Tokens], page_size: int) -> HybridPools:
        """New rows that read the cached `prefixes` (anchors): window starts at their tails.

        Each row's forward copies the anchor's window tail into window pages
        of its own (the allocation that follows takes them from the tail on)
        and its state into its state slot.
        """
        cached = self.cached
        for slot, prefix in zip(slots, prefixes, strict=True):
            cached = cached.resume(slot, prefix)
        windows = self.windows
        if windows:
            window = windows[0]
            starts = window.starts.copy()
            for slot, prefix in zip(slots, prefixes, strict=True):
                starts[slot] = tail_start(len(prefix), window.window, page_size)
            windows = (window.moved(frozen(starts)),)
        return HybridPools(self.kinds, windows, self.states, cached)

    def publish(self, slot: int, prefix: Tokens) -> HybridPools:
        """A new anchor at `prefix`, filled by the forward of the row in `slot`.

        Unchanged if there is no room for it, free or held by unlocked
        anchors (evicted then, least recently used first).
        """
        num_pages = self.windows[0].num_tail_pages(len(prefix)) if self.windows else 0
        num_states = 1 if self.states else 0
        free_pages = len(self.windows[0].page_list) if self.windows else 0
        short_pages, short_states = num_pages - free_pages, num_states - self.free_states()
        pools = self
        if short_pages > 0 or short_states > 0:
            pages, states = self.cached.evictable()
            if short_pages > pages or short_states > states:
                return self
            pools = self._evicted(max(short_pages, 0), max(short_states, 0))
        windows, states_out = pools.windows, pools.states
        taken: tuple[int, ...] = ()
        state = 0
        if windows:
            pages_taken, rest = windows[0].page_list.take(num_pages)
            taken = tuple(pages_taken.tolist())
            windows = (windows[0].with_free(rest),)
        if states_out:
            state_taken, left = states_out[0].free.take(1)
            state = int(state_taken[0])
            states_out = (states_out[0].with_free(left),)
        cached = pools.cached.add_anchor(slot, prefix, taken, state)
        return HybridPools(self.kinds, windows, states_out, cached)

    def drop_uncached(self, keep: Callable[[Tokens], bool]) -> HybridPools:
        """Anchors whose prefix `keep` refuses (its pages evicted), dropped with their tails."""
        cached, pages, states = self.cached.evict(0, 0, keep=keep)
        return self._given(cached, pages, states)

    def _evicted(self, num_pages: int, num_states: int) -> HybridPools:
        # Unlocked anchors dropped, least recently used first, until enough are out.
        cached, pages, states = self.cached.evict(num_pages, num_states)
        return self._given(cached, pages, states)

    def _given(self, cached: HybridCache, pages: list[int], states: list[int]) -> HybridPools:
        windows, kept = self.windows, self.states
        if pages:
            window = windows[0]
            windows = (window.with_free(window.page_list.give(np.array(pages, dtype=np.int64))),)
        if states:
            state = kept[0]
            kept = (state.with_free(state.free.give(np.array(states, dtype=np.int64))),)
        return HybridPools(self.kinds, windows, kept, cached)

    def grow(  # the rows, their lengths, what their forward reads, the pages
        self,
        slots: HostArray,
        old_lens: HostArray,
        new_lens: HostArray,
        reads_from: HostArray,
        page_size: int,
    ) -> HybridPools | OutOfKVTokens:
        """Rows grown from `old_lens` to `new_lens` tokens: window pages taken and given back.

        `reads_from`: the first position each row's forward queries.
        """
        if not self.windows:
            return self
        grown = self.windows[0].grow(slots, old_lens, new_lens, reads_from)
        pools = self
        if isinstance(grown, tuple) and self.cached.anchors:  # evict anchors' window tails
            evictable = self.cached.evictable()[0]
            if grown[0] > grown[1] + evictable:
                return OutOfKVTokens(grown[0], grown[1] + evictable, page_size)
            pools = self._evicted(grown[0] - grown[1], 0)
            grown = pools.windows[0].grow(slots, old_lens, new_lens, reads_from)
        if isinstance(grown, tuple):
            return OutOfKVTokens(grown[0], grown[1], page_size)
        return HybridPools(self.kinds, (grown,), pools.states, pools.cached)

    def shrink(self, slots: HostArray, held: HostArray, new_lens: HostArray) -> HybridPools:
        """Rows cut back from `held` to `new_lens` tokens: window pages past them freed."""
        if not self.windows:
            return self
        return HybridPools(
            self.kinds, (self.windows[0].shrink(slots, held, new_lens),), self.states, self.cached
        )

    def give_back(
        self, slots: HostArray, held: HostArray, kept: Sequence[tuple[int, Tokens]] = ()
    ) -> HybridPools:
        """Released request slots holding `held` tokens: their window pages and states freed.

        `kept`: (slot, prefix) of released rows whose tokens end at the end of
        `prefix` (whole pages, cached): their window tail and their state,
        after exactly those tokens, become an anchor there instead of being
        freed (SGLang keeps a finished request's window and state at its node).
        """
        cached = self.cached
        if cached.pending:  # rows that leave have run their forwards: their copies are done
            cached = cached.copies_ran(slots.tolist())
        windows, states = self.windows, self.states
        handed = [slot for slot, _ in kept]
        if kept:
            held = held.copy()
            at = {slot: index for index, slot in enumerate(slots.tolist())}
            for slot, prefix in kept:
                end, pages = len(prefix), ()
                if windows:  # the tail's pages stay the anchor's: free only those before it
                    window = windows[0]
                    pages = tuple(window.tail_pages(slot, end).tolist())
                    held[at[slot]] = tail_start(end, window.window, window.page_size)
                state = int(states[0].of_slot[slot]) if states else 0
                cached = cached.keep_anchor(prefix, pages, state)
        windows = tuple(window.give_back(slots, held) for window in windows)
        if handed:
            freed = np.setdiff1d(slots, handed)
            states = tuple(s.give_back(freed).handed_over(np.array(handed)) for s in states)
        else:
            states = tuple(state.give_back(slots) for state in states)
        return HybridPools(self.kinds, windows, states, cached)

    def __repr__(self) -> str:
        cached = (self.cached,) if self.cached.anchors else ()
        return f"HybridPools({', '.join(map(repr, (*self.windows, *self.states, *cached)))})"


NO_HYBRID: Final = HybridPools(FULL_ATTENTION, (), ())


def hybrid_pools(
    kinds: MemoryKinds, page_size: int, max_reqs: int, max_context_len: int
) -> HybridPools:
    """Empty allocators for each kind of `kinds` (checked already): `NO_HYBRID` for none."""
    if not kinds.is_hybrid:
        return NO_HYBRID
    windows = tuple(
        WindowPages.empty(kind, page_size, max_reqs, max_context_len) for kind in kinds.windows
    )
    states = tuple(StateSlots.empty(kind, max_reqs) for kind in kinds.states)
    return HybridPools(kinds, windows, states)
