"""check_pools names what is broken: pages lost or twice owned, a row's slot, partial pages."""

from __future__ import annotations

import numpy as np
import torch

from batchstate import (
    Mirrored,
    Req,
    check_pools,
    extend,
    filter_batch,
    idle,
    make_pools,
)
from tests.strategies import raises_exactly

CPU = torch.device("cpu")


def test_owned_pages_the_table_does_not_hold_are_counted_in_the_message() -> None:
    pools = make_pools(4, 32, 64, CPU)
    slots, pools = pools.allocate_slots(1).unwrap()
    owning = pools.allocate_fresh(slots, [2]).unwrap().pools  # the table is not written
    with raises_exactly("KV pages: 62 free + 2 owned != 64, or a page is owned twice or lost"):
        check_pools(owning)


def test_token_locations_that_do_not_fill_whole_pages() -> None:
    pools = make_pools(4, 32, 64, CPU, page_size=2)
    slots, pools = pools.allocate_slots(1).unwrap()
    allocation = pools.allocate_fresh(slots, [2]).unwrap()
    assert allocation.locs.tolist() == [2, 3]
    wrong = Mirrored.from_host(np.array([2, 9], dtype=np.int32), CPU)  # 9 is not 3
    allocation.pools.table.write_rows(slots.tolist(), [2], wrong)
    with raises_exactly(f"slot {int(slots[0])}: token locations do not fill whole pages"):
        check_pools(allocation.pools)


def test_a_slot_in_two_rows() -> None:
    batch, pools = extend(idle(CPU), [Req(0, (1, 2))], make_pools(4, 32, 64, CPU)).unwrap()
    check_pools(pools, [batch])
    with raises_exactly("slot 1 is in two rows"):
        check_pools(pools, [batch, batch])


def test_a_row_whose_slot_the_pools_do_not_have() -> None:
    reqs = [Req(rid, (1, 2, 3)) for rid in range(5)]
    batch, _ = extend(idle(CPU), reqs, make_pools(8, 32, 64, CPU)).unwrap()
    fifth = filter_batch(batch, [4])  # slot 5
    with raises_exactly("slot 5: row has 3 tokens, the pools hold none"):
        check_pools(make_pools(4, 32, 64, CPU), [fifth])
