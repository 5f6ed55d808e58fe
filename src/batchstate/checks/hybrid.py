"""Conservation of a hybrid model's other kinds of memory: window pages and state slots."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from batchstate.base.errors import InvariantViolation
from batchstate.base.mirrored import HostArray

if TYPE_CHECKING:
    from batchstate.pools.pools import Pools

__all__ = ["check_hybrid", "unheld_hybrid"]


def check_hybrid(pools: Pools, owned_slots: HostArray) -> None:
    """Per kind: free + held by owned slots + held by the cache's anchors = capacity.

    Nothing held twice or by a free slot; each anchor a cached prefix of
    whole pages holding its window tail and a state, locked by exactly the
    pending copies that name it, which only owned slots have.

    Raises:
        InvariantViolation: naming the kind and the numbers.
    """
    owned = owned_slots.tolist()
    free_slots = np.setdiff1d(np.arange(1, pools.max_reqs + 1), owned_slots)
    cached = pools.memory.cached
    if cached.anchors or cached.pending:
        _check_anchors(pools, owned)
    anchor_pages = [
        np.array(anchor.window_pages, dtype=np.int64) for anchor in cached.anchors.values()
    ]
    anchor_states = np.array([anchor.state for anchor in cached.anchors.values()], dtype=np.int64)
    for window in pools.memory.windows:
        held = [window.row_pages(slot, int(pools.slot_tokens[slot])) for slot in owned]
        _conserved(
            "window pages", window.page_list.ids, held + anchor_pages, window.num_pages, len(owned)
        )
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
        _conserved(
            "state slots",
            state.free.ids,
            [held_states, anchor_states],
            state.kind.num_states,
            len(owned),
        )


def _check_anchors(pools: Pools, owned: list[int]) -> None:
    # Each anchor: a cached prefix of whole pages, its tail's window pages, a state where
    # the pools keep states, and as many locks as pending copies name it.
    memory, page_size = pools.memory, pools.page_size
    cached = memory.cached
    names: dict[tuple[int, ...], int] = {}
    for slot, copies in cached.pending.items():
        _expect(slot in owned, f"prefix cache anchors: free slot {slot} has pending copies")
        for prefix in (copies.resume, copies.publish):
            _expect(
                not prefix or prefix in cached.anchors,
                f"slot {slot}'s pending copy names no anchor",
            )
        if copies.resume:
            names[copies.resume] = names.get(copies.resume, 0) + 1
    lengths: dict[int, int] = {}
    for prefix, anchor in cached.anchors.items():
        end = len(prefix)
        lengths[end] = lengths.get(end, 0) + 1
        _expect(
            end > 0 and end % page_size == 0 and pools.cache.cached_prefix(prefix)[0] == end,
            f"prefix cache anchor at {end} tokens: not a cached prefix of whole pages",
        )
        if memory.windows:
            tail_pages = memory.windows[0].num_tail_pages(end)
            _expect(
                len(anchor.window_pages) == tail_pages,
                f"prefix cache anchor at {end} tokens: {len(anchor.window_pages)} window pages"
                f" for a tail of {tail_pages} pages",
            )
        _expect(
            bool(anchor.state) == bool(memory.states),
            f"prefix cache anchor at {end} tokens: a state slot iff the pools keep states",
        )
        _expect(
            anchor.locks == names.get(prefix, 0),
            f"prefix cache anchor at {end} tokens: {anchor.locks} locks,"
            f" {names.get(prefix, 0)} rows resume from it",
        )
    _expect(lengths == dict(cached.lengths), "prefix cache anchors: lengths miscounted")


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
    every = np.concatenate((free, *held)).astype(np.int64) if held else free
    uses = np.bincount(every.astype(np.int64), minlength=capacity + 1)
    _expect(
        uses.shape[0] == capacity + 1 and int(uses[0]) == 0 and bool((uses[1:] == 1).all()),
        f"{kind}: {free.shape[0]} free + {every.shape[0] - free.shape[0]} held by"
        f" {num_owned} owned slots != {capacity}, or one is held twice or lost",
    )


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantViolation(message)
