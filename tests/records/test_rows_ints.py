"""`Rows.ints`: the four int64 host columns in one read-only array, the fields its rows.

Every transition that builds rows builds one `[4, num_reqs]` array (taken,
joined or grown once) and shows its rows as `seq_lens.host`,
`req_pool_indices.host`, `rids` and `gens`; rows built by hand pack theirs
from the fields. `check_batch` refuses an `ints` that disagrees with them.
"""

from __future__ import annotations

import copy
import pickle

import attrs
import numpy as np
import pytest
import torch

from batchstate import (
    BatchConflict,
    Filtered,
    InvariantViolation,
    Req,
    Rows,
    check_batch,
    decode,
    extend,
    idle,
    make_pools,
    merge,
    split,
)
from batchstate.base.mirrored import Mirrored, host_int64
from batchstate.columns.columns import NO_COLUMNS
from batchstate.records.rows import GENS, NUM_INTS, RIDS, SEQ_LENS, SLOTS, pack_ints

CPU = torch.device("cpu")


def _fields(rows: Rows) -> dict[int, np.ndarray]:
    return {
        SEQ_LENS: rows.seq_lens.host,
        SLOTS: rows.req_pool_indices.host,
        RIDS: rows.rids,
        GENS: rows.gens,
    }


def _expect_packed(
    rows: Rows, *, views_of: tuple[int, ...] = (SEQ_LENS, SLOTS, RIDS, GENS)
) -> None:
    assert rows.ints.shape == (NUM_INTS, len(rows))
    assert rows.ints.dtype == np.int64
    assert not rows.ints.flags.writeable
    for row, host in _fields(rows).items():
        assert host.tolist() == rows.ints[row].tolist()
        assert not host.flags.writeable
        if row in views_of:
            assert np.shares_memory(host, rows.ints), row


def test_every_transition_builds_one_array_whose_rows_are_the_host_sides() -> None:
    pools = make_pools(8, 64, 256, CPU)
    reqs = [Req(10 + row, (1,) * (3 + row)) for row in range(4)]
    extended, pools = extend(idle(CPU), reqs, pools).unwrap()
    _expect_packed(extended.rows)
    decoded, pools = decode(extended, pools).unwrap()
    # decode keeps the slots' pair: equal to the new array's row, not a view of it
    _expect_packed(decoded.rows, views_of=(SEQ_LENS, RIDS, GENS))
    assert decoded.rows.ints[SEQ_LENS].tolist() == [4, 5, 6, 7]
    kept, left = split(decoded, [0, 2, 3])
    _expect_packed(kept.rows)
    assert left.slots.tolist() == [decoded.rows.req_pool_indices.host[1]]
    assert left.seq_lens.tolist() == [5]
    for host in (left.slots, left.seq_lens, left.gens):
        assert not host.flags.writeable
    few, _ = split(decoded, [3])  # more rows leave than stay: the other path
    _expect_packed(few.rows)
    joining, pools = extend(idle(CPU), [Req(99, (7, 7))], pools).unwrap()
    merged = merge(kept, joining)
    _expect_packed(merged.rows)
    assert merged.rows.rids.tolist() == [10, 12, 13, 99]
    check_batch(merged, compare_device=True)


def test_the_array_and_its_rows_cannot_be_written() -> None:
    rows = Rows.from_host(CPU, [Req(1, (1, 2))], [1], [2], NO_COLUMNS)
    with pytest.raises(ValueError, match="read-only"):
        rows.ints[SEQ_LENS, 0] = 5
    with pytest.raises(ValueError, match="read-only"):
        rows.seq_lens.host[0] = 5
    assert rows.seq_lens.host.tolist() == [2]


def test_rows_built_by_hand_pack_their_fields() -> None:
    rows = Rows.from_host(CPU, [Req(1, (1, 2)), Req(2, (3,))], [3, 4], [2, 1], NO_COLUMNS)
    other = attrs.evolve(rows, rids=host_int64([5, 6]))
    assert other.ints.tolist() == [[2, 1], [3, 4], [5, 6], [0, 0]]
    _expect_packed(other)
    empty = Rows.empty(CPU, type(NO_COLUMNS))
    assert empty.ints.shape == (NUM_INTS, 0)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_the_array_read_only_and_equal(how: str) -> None:
    rows = Rows.from_host(CPU, [Req(1, (1, 2)), Req(2, (3,))], [3, 4], [2, 1], NO_COLUMNS)
    copied = (
        copy.deepcopy(rows) if how == "deepcopy" else pickle.loads(pickle.dumps(rows))
    )  # our own bytes
    assert copied.ints.tolist() == rows.ints.tolist()
    _expect_packed(copied)  # the copy's fields are its own array's rows again
    check_batch(Filtered(copied))


def test_rows_built_by_hand_copy_what_their_caller_can_still_write() -> None:
    # A read-only view of a writable array passes the host checks; writing that array
    # must change neither the fields nor `ints`, or a merge's one-row check (which
    # compares `ints`) would take a request id the fields say is already running.
    base = np.array([0], dtype=np.int64)
    view = base.view()
    view.setflags(write=False)
    lens = np.array([1], dtype=np.int64)
    lens_view = lens.view()
    lens_view.setflags(write=False)
    built = Rows.from_host(CPU, [Req(0, (1,))], [1], [1], NO_COLUMNS)
    seq_lens = Mirrored.trusted(lens_view, built.seq_lens.device)
    running = attrs.evolve(built, rids=view, seq_lens=seq_lens)
    base[0] = 1
    lens[0] = 7
    _expect_packed(running)
    assert running.rids.tolist() == [0]
    assert running.seq_lens.host.tolist() == [1]
    joining = Filtered(Rows.from_host(CPU, [Req(1, (3,))], [2], [1], NO_COLUMNS))
    merged = merge(Filtered(running), joining)
    assert merged.rows.rids.tolist() == [0, 1]
    check_batch(merged)


def test_pack_ints_hands_out_no_writable_base() -> None:
    packed = pack_ints(host_int64([1]), host_int64([2]), host_int64([3]), host_int64([4]))
    assert not packed.flags.writeable
    assert isinstance(packed.base, np.ndarray)
    assert not packed.base.flags.writeable


def test_check_batch_refuses_an_array_that_disagrees_with_the_fields() -> None:
    rows = Rows.from_host(CPU, [Req(1, (1, 2))], [1], [2], NO_COLUMNS)
    stale = np.array([[3], [1], [1], [0]], dtype=np.int64)
    stale.setflags(write=False)
    object.__setattr__(rows, "ints", stale)  # what no transition does
    with pytest.raises(InvariantViolation, match=r"row 0 differs from seq_lens\.host"):
        check_batch(Filtered(rows))
    object.__setattr__(rows, "ints", np.zeros((NUM_INTS, 1), dtype=np.int64))  # writable
    with pytest.raises(InvariantViolation, match="read-only int64 array"):
        check_batch(Filtered(rows))


@pytest.mark.parametrize(
    ("rid", "slot", "message"),
    [
        (1, 9, r"request ids \[1\] are in both batches"),
        (9, 2, r"request slots \[2\] are in both batches"),
        (2, 1, r"request ids \[2\] are in both batches"),  # both shared: ids named first
    ],
)
def test_a_joining_row_that_shares_a_request_id_or_slot_is_refused(
    rid: int, slot: int, message: str
) -> None:
    running = Filtered(
        Rows.from_host(CPU, [Req(1, (1,)), Req(2, (2,))], [1, 2], [1, 1], NO_COLUMNS)
    )
    joining = Filtered(Rows.from_host(CPU, [Req(rid, (3,))], [slot], [1], NO_COLUMNS))
    before = running.rows.ints.tolist(), joining.rows.ints.tolist()
    with pytest.raises(BatchConflict, match=message):
        merge(running, joining)
    assert (running.rows.ints.tolist(), joining.rows.ints.tolist()) == before
    apart = Filtered(Rows.from_host(CPU, [Req(9, (3,))], [9], [1], NO_COLUMNS))
    assert merge(running, apart).rows.rids.tolist() == [1, 2, 9]
