"""What a value exposes stays read-only after the library wrote the memory under it.

`writing` opens a buffer for one write and closes it again: the ids a
FreeList exposes after a give, and the pools' free lists after a free, are
read-only views like before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchstate import FreeList, make_pools

CPU = torch.device("cpu")


def test_free_list_views_are_read_only_after_a_give_in_place() -> None:
    free = FreeList.of(np.arange(4), 4)
    taken, rest = free.take(2)
    given = rest.give(taken.copy())  # fits: written in place
    assert given.ids.base is free.ids.base
    taken_again, _ = given.take(1)
    for view in (given.ids, free.ids, taken_again):
        assert not view.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 99


def test_pools_free_lists_are_read_only_after_a_free() -> None:
    pools = make_pools(4, 16, 16, CPU)
    slots, pools = pools.allocate_slots(2).unwrap()
    allocation = pools.allocate_fresh(slots, [3, 2]).unwrap()
    freed = allocation.pools.free(slots).unwrap()
    assert not freed.free_slots.flags.writeable
    assert not freed.free_pages.flags.writeable
