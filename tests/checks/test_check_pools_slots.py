"""check_pools refuses a request slot that is both free and owned, or neither."""

from __future__ import annotations

import re

import attrs
import numpy as np
import pytest
import torch

from batchstate import FreeList, InvariantViolation, check_pools, make_pools

CPU = torch.device("cpu")


def _message(free: int, owned: int) -> str:
    return re.escape(
        f"request slots: {free} free + {owned} owned != 4, or a slot is both or neither"
    )


def test_a_slot_both_free_and_owned_is_a_violation() -> None:
    pools = make_pools(4, 32, 64, CPU)
    slots, with_slot = pools.allocate_slots(1).unwrap()
    assert slots.tolist() == [1]
    owning = with_slot.allocate_fresh(slots, [2]).unwrap().pools  # table not written: slots only
    both = attrs.evolve(owning, slot_list=pools.slot_list)  # slot 1 free again, still owned
    with pytest.raises(InvariantViolation, match=_message(4, 1)):
        check_pools(both)


@pytest.mark.parametrize("lost", [1, 2, 4])
def test_a_slot_neither_free_nor_owned_is_a_violation(lost: int) -> None:
    pools = make_pools(4, 32, 64, CPU)
    free = FreeList.of(np.array([slot for slot in range(1, 5) if slot != lost]))
    with pytest.raises(InvariantViolation, match=_message(3, 0)):
        check_pools(attrs.evolve(pools, slot_list=free))
