"""The memory of a hybrid model's other layers, held by `Pools` beside full-attention pages.

`Pools.memory` is a `HybridPools`: the described kinds and, per kind, the
value that allocates it. For a full-attention model both tuples are empty
(`NO_HYBRID`, shared), and every pool function skips this module after
one truthiness test. Each function here returns a new value or a failure,
and changes nothing it is given: the pools functions that call them
commit the pools that hold the result.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final, final

import attrs

from batchstate._copies import read_only_copies
from batchstate._errors import OutOfKVTokens
from batchstate._memory_kinds import FULL_ATTENTION, MemoryKinds
from batchstate._mirrored import HostArray, writing
from batchstate._state_slots import StateSlots
from batchstate._window_pages import WindowPages

__all__ = ["NO_HYBRID", "HybridPools", "hybrid_pools"]


@read_only_copies
@final
@attrs.frozen(eq=False, repr=False)
class HybridPools:
    """Window pages and state slots of a hybrid model's pools: empty for full attention.

    `windows` holds one `WindowPages` if the model has sliding-window layers,
    `states` one `StateSlots` if it keeps recurrent states; a request slot
    holds its window pages and its state slot from allocation to release.
    """

    kinds: MemoryKinds
    windows: tuple[WindowPages, ...]
    states: tuple[StateSlots, ...]

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

    def take_slots(self, slots: HostArray) -> HybridPools:
        """A state slot for each new request slot (enough must be free)."""
        if not self.states:
            return self
        return HybridPools(self.kinds, self.windows, (self.states[0].take(slots),))

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
        if isinstance(grown, tuple):
            return OutOfKVTokens(grown[0], grown[1], page_size)
        return HybridPools(self.kinds, (grown,), self.states)

    def shrink(self, slots: HostArray, held: HostArray, new_lens: HostArray) -> HybridPools:
        """Rows cut back from `held` to `new_lens` tokens: window pages past them freed."""
        if not self.windows:
            return self
        return HybridPools(
            self.kinds, (self.windows[0].shrink(slots, held, new_lens),), self.states
        )

    def give_back(self, slots: HostArray, held: HostArray) -> HybridPools:
        """Released request slots holding `held` tokens: their window pages and states freed."""
        windows = tuple(window.give_back(slots, held) for window in self.windows)
        states = tuple(state.give_back(slots) for state in self.states)
        return HybridPools(self.kinds, windows, states)

    def __repr__(self) -> str:
        return f"HybridPools({', '.join(map(repr, (*self.windows, *self.states)))})"


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
