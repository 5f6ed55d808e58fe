"""State slots: one recurrent state per live request, taken and given back with its slot.

A state-space or linear-attention layer keeps a fixed-size state per
request instead of KV. The engine owns the state buffer
(`[num_states + 1, state_size]`, slot 0 padding); the pools own which state
slot each request slot holds. Everything here is host arithmetic.
"""

from __future__ import annotations

from typing import final

import attrs
import numpy as np

from batchstate.base.mirrored import HostArray, frozen
from batchstate.base.read_only import read_only_copies
from batchstate.memory.free_list import FreeList
from batchstate.memory.kinds import RecurrentState

__all__ = ["StateSlots"]


@read_only_copies
@final
@attrs.frozen(eq=False, repr=False)
class StateSlots:
    """Which state slot each request slot holds, and the free ones, as a value.

    A request slot holds a state slot from its allocation to its release:
    `of_slot[slot]` (0 while the request slot is free). A held `Chunked`,
    which keeps its request slot, keeps its state with it.
    """

    kind: RecurrentState
    free: FreeList  # free state slots, 1..num_states, handed out from the front
    of_slot: HostArray  # read-only int64 [max_reqs + 1]: request slot -> state slot (0: none)

    @classmethod
    def empty(cls, kind: RecurrentState, max_reqs: int) -> StateSlots:
        """Every state slot free, no request slot holding one."""
        ids = np.arange(1, kind.num_states + 1, dtype=np.int64)
        return cls(kind, FreeList.of(ids), frozen(np.zeros(max_reqs + 1, dtype=np.int64)))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, slots: HostArray) -> StateSlots:
        """A state slot for each request slot of `slots` (there must be enough free)."""
        states, rest = self.free.take(slots.shape[0])
        of_slot = self.of_slot.copy()
        of_slot[slots] = states
        return StateSlots(self.kind, rest, frozen(of_slot))

    def with_free(self, free: FreeList) -> StateSlots:
        """The same request slots' states with another free list (the prefix cache's)."""
        return StateSlots(self.kind, free, self.of_slot)

    def handed_over(self, slots: HostArray) -> StateSlots:
        """`slots` hold no state slot any more, theirs not freed: the prefix cache keeps them."""
        of_slot = self.of_slot.copy()
        of_slot[slots] = 0
        return StateSlots(self.kind, self.free, frozen(of_slot))

    def give_back(self, slots: HostArray) -> StateSlots:
        """The state slots `slots` hold, free again."""
        of_slot = self.of_slot.copy()
        states = of_slot[slots]
        of_slot[slots] = 0
        return StateSlots(self.kind, self.free.give(states), frozen(of_slot))

    def __repr__(self) -> str:
        return (
            f"StateSlots({self.num_free}/{self.kind.num_states} free,"
            f" state_size={self.kind.state_size})"
        )
