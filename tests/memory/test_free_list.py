"""FreeList: a free list as a value, given back to without copying, and compacted."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from batchstate import FreeList


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60))
def test_take_and_give_match_a_python_list_and_keep_old_values(counts: list[int]) -> None:
    """Any take/give sequence gives the ids a Python deque would, and no earlier value changes."""
    capacity = 8
    free = FreeList.of(np.arange(capacity), capacity)
    model = list(range(capacity))
    owned: list[int] = []
    history: list[tuple[FreeList, list[int]]] = []
    for step, count in enumerate(counts):
        if step % 2 == 0 and count <= len(model):
            taken, free = free.take(count)
            assert taken.tolist() == model[:count]
            owned += model[:count]
            model = model[count:]
        else:
            back = owned[:count]
            owned = owned[count:]
            free = free.give(np.array(back, dtype=np.int64))
            model += back
        assert free.ids.tolist() == model
        history.append((free, list(model)))
    # Persistence: gives write only past every earlier value's end, or into a new buffer.
    for value, ids in history:
        assert value.ids.tolist() == ids


def test_give_past_the_buffer_moves_the_ids_to_a_new_buffer() -> None:
    """Once the buffer's end is reached, the live ids move to a new buffer, none lost."""
    free = FreeList.of(np.arange(4), 4)
    buffer = free._buffer
    for _ in range(5):  # each round takes and gives back two ids
        taken, free = free.take(2)
        free = free.give(taken.copy())
    assert free._buffer is not buffer
    assert sorted(free.ids.tolist()) == [0, 1, 2, 3]
    assert len(free) == 4
