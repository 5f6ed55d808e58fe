"""`gather_sampled`'s host index: rows a split kept in order, rows reordered, rows missing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from batchstate import BatchConflict, Req, Sampled, extend, gather_sampled, idle, merge, split
from batchstate.transitions.sampled import _positions
from tests.builders import make_test_pools


@given(
    rids=st.lists(st.integers(0, 10**12), unique=True, max_size=40),
    data=st.data(),
)
def test_positions_find_each_wanted_rid_kept_in_order_or_not(
    rids: list[int], data: st.DataObject
) -> None:
    kept = data.draw(st.lists(st.booleans(), min_size=len(rids), max_size=len(rids)))
    wanted = [rid for rid, keep in zip(rids, kept, strict=True) if keep]
    if data.draw(st.booleans()):
        wanted = data.draw(st.permutations(wanted))
    have = np.array(rids, dtype=np.int64)
    index = _positions(have, np.array(wanted, dtype=np.int64))
    assert index.dtype == np.int64
    assert have[index].tolist() == wanted


def test_follow_gathers_the_tokens_of_the_rows_a_split_kept() -> None:
    pools = make_test_pools(max_reqs=16)
    reqs = [Req(rid, (1, 2, 3)) for rid in range(12)]
    extended, pools = extend(idle("cpu"), reqs, pools).unwrap()
    batch = merge(idle("cpu"), extended)
    sampled = Sampled.of(batch.rows, torch.arange(100, 112))
    kept, _ = split(batch, [0, 2, 3, 5, 6, 7, 8, 11])
    assert gather_sampled(sampled, kept).tokens.device.tolist() == [
        100,
        102,
        103,
        105,
        106,
        107,
        108,
        111,
    ]


def test_follow_refuses_a_row_with_no_token() -> None:
    pools = make_test_pools(max_reqs=4)
    first, pools = extend(idle("cpu"), [Req(0, (1,)), Req(1, (2,))], pools).unwrap()
    sampled = Sampled.of(first.rows, torch.tensor([7, 8]))
    other, pools = extend(idle("cpu"), [Req(2, (3,))], pools).unwrap()
    with pytest.raises(BatchConflict, match=r"no sampled token for requests \[2\]"):
        gather_sampled(sampled, merge(idle("cpu"), other))
