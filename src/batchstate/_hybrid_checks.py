"""Conservation of a hybrid model's other kinds of memory: window pages and state slots."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from batchstate._errors import InvariantViolation
from batchstate._mirrored import HostArray

if TYPE_CHECKING:
    from batchstate._pools import Pools

__all__ = ["check_hybrid", "unheld_hybrid"]


def check_hybrid(pools: Pools, owned_slots: HostArray) -> None:
    """Per kind: free + held by owned slots = capacity, nothing held twice or by a free slot.

    Raises:
        InvariantViolation: naming the kind and the numbers.
    """
    owned = owned_slots.tolist()
    free_slots = np.setdiff1d(np.arange(1, pools.max_reqs + 1), owned_slots)
    for window in pools.memory.windows:
        held = [window.row_pages(slot, int(pools.slot_tokens[slot])) for slot in owned]
        _conserved("window pages", window.page_list.ids, held, window.num_pages, len(owned))
        starts = window.starts
        _expect(
            not starts[free_slots].any() and not starts[0],
            "window pages: a free slot has a window start",
        )
        ends = pools.slot_tokens[owned_slots]
        _expect(
            bool((starts[owned_slots] % pools.page_size == 0).all())
            and bool((starts[owned_slots] <= np.maximum(ends - window.window + 1, 0)).all()),
            "window pages: a window start is not a page start at or before the row's window",
        )
    for state in pools.memory.states:
        held_states = state.of_slot[owned_slots]
        _expect(
            bool((held_states > 0).all()),
            "state slots: an owned request slot holds no state slot",
        )
        _expect(
            not state.of_slot[free_slots].any() and not state.of_slot[0],
            "state slots: a free request slot holds a state slot",
        )
        _conserved("state slots", state.free.ids, [held_states], state.kind.num_states, len(owned))


def unheld_hybrid(pools: Pools, unheld: list[int]) -> tuple[int, int]:
    """(window pages, state slots) the `unheld` owned request slots hold: what leaked with them."""
    pages = sum(
        window.row_pages(slot, int(pools.slot_tokens[slot])).shape[0]
        for window in pools.memory.windows
        for slot in unheld
    )
    states = len(unheld) if pools.memory.states else 0
    return pages, states


def _conserved(
    kind: str, free: HostArray, held: list[HostArray], capacity: int, num_owned: int
) -> None:
    every = np.concatenate((free, *held)) if held else free
    uses = np.bincount(every.astype(np.int64), minlength=capacity + 1)
    _expect(
        uses.shape[0] == capacity + 1 and int(uses[0]) == 0 and bool((uses[1:] == 1).all()),
        f"{kind}: {free.shape[0]} free + {every.shape[0] - free.shape[0]} held by"
        f" {num_owned} owned slots != {capacity}, or one is held twice or lost",
    )


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantViolation(message)
