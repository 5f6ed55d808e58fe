"""A FreeList writes gives in place until its buffer is full, and moves once per `capacity` ids.

Whether two values share one buffer shows through their read-only `ids`
views (views of the buffer): a give that fits writes past the old value's
end, in the same buffer; one that does not moves the live ids to a new one.
"""

from __future__ import annotations

import numpy as np

from batchstate import FreeList


def _same_buffer(first: FreeList, second: FreeList) -> bool:
    return first.ids.base is second.ids.base


def test_a_give_that_exactly_fills_the_buffer_writes_in_place() -> None:
    free = FreeList.of(np.arange(4), 4)  # room for 8 ids
    taken, rest = free.take(4)
    full = rest.give(taken.copy())  # cells 4..7 of 8: exactly full
    assert full.ids.tolist() == [0, 1, 2, 3]
    assert _same_buffer(full, free)
    moved = full.give(np.array([9]))  # one more does not fit
    assert moved.ids.tolist() == [0, 1, 2, 3, 9]
    assert not _same_buffer(moved, free)


def test_after_a_move_capacity_more_ids_are_given_back_in_place() -> None:
    free = FreeList.of(np.arange(4), 4)  # a pool of 4 ids, room for 8
    taken, free = free.take(3)
    free = free.give(taken.copy())  # cells 3..6 hold ids [3, 0, 1, 2]
    taken, free = free.take(3)  # id 2 left free, at cell 6
    moved = free.give(taken[:2].copy())  # cells 7..8: past the end, so 3 live ids move
    assert moved.ids.tolist() == [2, 3, 0]
    assert not _same_buffer(moved, free)
    # The new buffer is sized for the pool's 4 ids, not the 3 it holds now:
    # 4 more ids come back before the next move.
    current = moved
    for _ in range(4):
        one, current = current.take(1)
        current = current.give(one.copy())
        assert _same_buffer(current, moved)
    assert current.ids.tolist() == [3, 0, 2]  # each round moves the first id to the back


def test_a_list_built_for_a_larger_pool_has_room_for_all_of_it() -> None:
    free = FreeList.of(np.arange(2), 4)  # 2 of a pool of 4 ids free: room for 8
    full = free.give(np.array([2, 3]))
    taken, rest = full.take(4)
    back = rest.give(taken.copy())  # cells 4..7: still in the first buffer
    assert back.ids.tolist() == [0, 1, 2, 3]
    assert _same_buffer(back, free)


def test_views_of_a_new_list_are_read_only() -> None:
    free = FreeList.of(np.arange(3))
    taken, rest = free.take(1)
    for view in (free.ids, taken, rest.ids):
        assert not view.flags.writeable
