"""Branches taken only on one side of a size threshold, run on both sides.

Each fast path below is chosen by a size (`_MAX_ROW_READS` slots freed,
`_MAX_PAIRS` compared pairs, `_MAX_ROW_WRITES` rows admitted,
`_MAX_PYTHON_CHECK` keep positions, `_MAX_ONE_BY_ONE` rows picked, a free
list's buffer filling up). Every test runs sizes just below, at and just
above the threshold and compares the result with a plain-Python computation,
so a wrong branch fails whichever side it is on. Host values are compared
through `.tolist()` only.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import batchstate.base.intersection
import batchstate.pools.pools
import batchstate.records.rows
import batchstate.transitions.admission
import batchstate.transitions.filtering
from batchstate import (
    BatchConflict,
    Chunked,
    Extended,
    FreeList,
    KeepIndicesError,
    Pools,
    Req,
    check_batch,
    check_pools,
    decode,
    extend,
    filter_batch,
    idle,
    make_pools,
    merge,
    release,
    split,
)
from batchstate.base.mirrored import host_int64
from tests.builders import CPU, make_reqs

ROW_READS = batchstate.pools.pools._MAX_ROW_READS
PAIRS = batchstate.base.intersection._MAX_PAIRS
ROW_WRITES = batchstate.transitions.admission._MAX_ROW_WRITES
PYTHON_CHECK = batchstate.transitions.filtering._MAX_PYTHON_CHECK
ONE_BY_ONE = batchstate.records.rows._MAX_ONE_BY_ONE


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _lengths(num_rows: int, page_size: int) -> list[int]:
    # Varied lengths, most ending in a partly filled page.
    return [1 + (7 * row + 3) % (3 * page_size + 2) for row in range(num_rows)]


def _owned_pages(pools: Pools, slots: list[int]) -> list[int]:
    """Plain Python: the pages each slot owns, slot by slot, from the host table."""
    table, tokens, page_size = (
        pools.table.host.tolist(),
        pools.slot_tokens.tolist(),
        pools.page_size,
    )
    return [
        table[slot][page * page_size] // page_size
        for slot in slots
        for page in range(_pages(tokens[slot], page_size))
    ]


# ---- Pools.free: one row read per slot, or index tensors ------------------------------------


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("num_freed", [1, ROW_READS, ROW_READS + 1, 3 * ROW_READS])
def test_free_gives_back_every_page_of_every_slot(page_size: int, num_freed: int) -> None:
    """Freeing few or many slots gives back exactly their pages, partial last pages included."""
    num_rows = num_freed + 2
    pools = make_pools(num_rows, 64, 64 * num_rows, CPU, page_size)
    batch, pools = extend(idle(CPU), make_reqs(_lengths(num_rows, page_size)), pools).unwrap()
    decoded, pools = decode(batch, pools).unwrap()  # a row may have started a new page
    slots = decoded.rows.req_pool_indices.host.tolist()
    keep = list(range(num_freed, num_rows))
    kept, left = split(decoded, keep)
    freed_slots = slots[:num_freed]
    expected_pages = _owned_pages(pools, freed_slots)
    assert len(expected_pages) == sum(
        _pages(length, page_size) for length in decoded.rows.seq_lens.host.tolist()[:num_freed]
    )
    free_slots, free_pages = pools.free_slots.tolist(), pools.free_pages.tolist()

    # The same through Pools.free directly, with no lengths to check, on a copy: pools
    # are linear, and a deep copy is a lineage of its own.
    direct = copy.deepcopy(pools).free(left.slots).unwrap()
    after = release(left, kept, pools).unwrap()

    assert after.free_slots.tolist() == free_slots + freed_slots
    assert after.free_pages.tolist() == free_pages + expected_pages
    tokens = after.slot_tokens.tolist()
    assert [tokens[slot] for slot in freed_slots] == [0] * num_freed
    assert [tokens[slot] for slot in slots[num_freed:]] == decoded.rows.seq_lens.host.tolist()[
        num_freed:
    ]
    check_pools(after, [kept], compare_device=True)
    assert direct.free_pages.tolist() == free_pages + expected_pages


# ---- overlap: every pair, or torch.isin ------------------------------------------------------


@pytest.mark.parametrize(
    ("num_values", "num_among"),
    [(1, 1), (3, 5), (256, 256), (256, 257), (300, 300), (1, PAIRS + 1), (PAIRS + 1, 1)],
)
@pytest.mark.parametrize("shared", ["none", "some", "all"])
def test_overlap_matches_python_on_both_sides_of_the_pair_limit(
    num_values: int, num_among: int, shared: str
) -> None:
    """The elements of `values` also in `among`, in order, whichever comparison runs."""
    values = [3 * i + 1 for i in range(num_values)][::-1]  # not sorted
    offset = {"none": 10**6, "some": 3 * (num_values // 2), "all": 0}[shared]
    among = [3 * i + 1 + offset for i in range(num_among)]
    got = batchstate.base.intersection.overlap(host_int64(values), host_int64(among)).tolist()
    members = set(among)
    assert got == [value for value in values if value in members]
    assert (num_values * num_among > PAIRS) == (
        (num_values, num_among) in {(256, 257), (300, 300), (1, PAIRS + 1), (PAIRS + 1, 1)}
    )


@pytest.mark.parametrize("num_rows", [8, 256, 257, 300])  # 256 x 256 pairs is the limit
def test_merge_of_large_batches(num_rows: int) -> None:
    """Disjoint large batches merge; a shared slot or rid is a conflict, at every size."""
    pools = make_pools(2 * num_rows, 4, 2 * num_rows, CPU)
    running, pools = extend(idle(CPU), make_reqs([1] * num_rows), pools).unwrap()
    incoming, pools = extend(idle(CPU), make_reqs([1] * num_rows, num_rows), pools).unwrap()
    base = merge(idle(CPU), running)
    merged = merge(base, incoming)
    slots = running.rows.req_pool_indices.host.tolist()
    assert merged.rows.req_pool_indices.host.tolist() == slots + list(
        incoming.rows.req_pool_indices.host.tolist()
    )
    assert merged.rows.rids.tolist() == list(range(2 * num_rows))
    check_batch(merged, compare_device=True)
    with pytest.raises(BatchConflict, match=r"request ids \[0, 1, 2"):
        merge(base, running)
    # The same slots under other rids: pools of their own hand out slots 1.. again.
    others, _ = extend(
        idle(CPU), make_reqs([1] * num_rows, 10 * num_rows), make_pools(num_rows, 4, num_rows, CPU)
    ).unwrap()
    with pytest.raises(BatchConflict, match=r"request slots \[1, 2, 3"):
        merge(base, others)


# ---- extend: one table slice per fresh row, or the general path ------------------------------


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("num_reqs", [1, ROW_WRITES, ROW_WRITES + 1])
@pytest.mark.parametrize("chunked", [False, True])
def test_extend_places_rows_as_python_would(page_size: int, num_reqs: int, chunked: bool) -> None:
    """Fresh rows take whole pages in order, a continued chunk fills its last page first."""
    pools = make_pools(num_reqs + 2, 64, 1024, CPU, page_size)
    cached = 5
    items: list[Req | Chunked] = []
    prefixes = [0] * num_reqs
    held_slot, held_row, held_gen = 0, [], 0  # a chunked request's slot, locations, generation
    if chunked:
        held, pools = extend(idle(CPU), [Req(999, tuple(range(cached)))], pools).unwrap()
        held_slot = held.rows.req_pool_indices.host.tolist()[0]
        held_gen = int(held.rows.gens[0])
        held_row = pools.table.host.tolist()[held_slot][:cached]
    lengths = _lengths(num_reqs, page_size)
    items += make_reqs(lengths)
    if chunked:
        items.append(Chunked(Req(999, tuple(range(cached + 9))), held_slot, cached, gen=held_gen))
        lengths.append(cached + 9)
        prefixes.append(cached)
    free_slots, free_pages = pools.free_slots.tolist(), pools.free_pages.tolist()

    batch, after = extend(idle(CPU), items, pools).unwrap()

    assert isinstance(batch, Extended)
    new_slots = free_slots[:num_reqs]
    slots = new_slots + ([held_slot] if chunked else [])
    assert batch.rows.req_pool_indices.host.tolist() == slots
    assert batch.rows.seq_lens.host.tolist() == lengths
    assert batch.prefix_lens.tolist() == list(prefixes)
    assert batch.extend_lens.tolist() == [n - p for n, p in zip(lengths, prefixes, strict=True)]
    # The model: new pages from the front of the free list, row by row; a chunked
    # row continues in its partly filled last page.
    pages = iter(free_pages)
    table = after.table.host.tolist()
    expected_locs: list[int] = []
    for slot, length, prefix in zip(slots, lengths, prefixes, strict=True):
        row = held_row if prefix else []
        for position in range(prefix, length):
            if position % page_size == 0:
                row.append(next(pages) * page_size)
            else:
                row.append(row[-1] + 1)
        expected_locs += row[prefix:length]
        assert table[slot][:length] == row, f"slot {slot}"
    assert batch.out_cache_loc.device.tolist() == expected_locs
    ids = [i for item, p in zip(items, prefixes, strict=True) for i in _req(item).input_ids[p:]]
    assert batch.input_ids.device.tolist() == ids
    assert after.free_pages.tolist() == list(pages)
    check_batch(batch, compare_device=True)
    check_pools(after, [batch], compare_device=True)


def _req(item: Req | Chunked) -> Req:
    return item.req if isinstance(item, Chunked) else item


# ---- keep indices: checked in Python, or with tensor ops -------------------------------------


def _batch(num_rows: int) -> Extended:
    pools = make_pools(num_rows, 4, num_rows, CPU)
    return extend(idle(CPU), make_reqs([1] * num_rows), pools).unwrap().batch


@pytest.mark.parametrize("num_kept", [2, PYTHON_CHECK, PYTHON_CHECK + 1])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_keep_checks_on_both_sides_of_the_python_limit(num_kept: int, as_tensor: bool) -> None:
    """Valid positions pass; a duplicate or an inversion at the very end is named."""
    batch = _batch(num_kept + 1)
    keep = list(range(num_kept))

    def run(positions: list[int]) -> object:
        return filter_batch(batch, torch.tensor(positions) if as_tensor else positions)

    kept = run(keep)
    assert kept.rows.rids.tolist() == keep  # type: ignore[attr-defined]  # a Filtered
    duplicate = [*keep[:-1], keep[-2]]
    with pytest.raises(KeepIndicesError, match=f"a duplicate at position {num_kept - 1}"):
        run(duplicate)
    swapped = [*keep[:-2], keep[-1], keep[-2]]
    with pytest.raises(KeepIndicesError, match=f"out of order at position {num_kept - 1}"):
        run(swapped)
    with pytest.raises(KeepIndicesError, match="out of range"):
        run([*keep[:-1], num_kept + 1])


# ---- picking requests: one by one, or itemgetter; take or without ----------------------------


@pytest.mark.parametrize("num_kept", [0, 1, ONE_BY_ONE, ONE_BY_ONE + 1, 15, 19])
@pytest.mark.parametrize("longest_leaves", [False, True])
def test_split_picks_rows_as_python_would(num_kept: int, longest_leaves: bool) -> None:
    """Few kept (summed over) or many kept (derived from those that left): the same rows."""
    num_rows = 20
    lengths = [1 + (5 * row) % 11 for row in range(num_rows)]
    longest = lengths.index(max(lengths))
    pools = make_pools(num_rows, 16, 16 * num_rows, CPU)
    batch, _ = extend(idle(CPU), make_reqs(lengths), pools).unwrap()
    others = [row for row in range(num_rows) if row != longest]
    keep = sorted(others[:num_kept] if longest_leaves else [longest, *others][:num_kept])
    kept, left = split(batch, keep)
    gone = [row for row in range(num_rows) if row not in keep]
    reqs = batch.rows.reqs
    assert kept.rows.reqs == tuple(reqs[row] for row in keep)
    assert kept.rows.rids.tolist() == keep
    assert kept.rows.seq_lens.host.tolist() == [lengths[row] for row in keep]
    assert kept.rows.seq_lens_sum == sum(lengths[row] for row in keep)
    assert kept.rows.max_seq_len == max((lengths[row] for row in keep), default=0)
    assert left.reqs == tuple(reqs[row] for row in gone)
    assert left.seq_lens.tolist() == [lengths[row] for row in gone]
    check_batch(kept, compare_device=True)


# ---- FreeList: giving back past the buffer's end ---------------------------------------------


@pytest.mark.parametrize("capacity", [1, 3, 8])
def test_free_list_growth_keeps_every_value(capacity: int) -> None:
    """Gives up to, at and past the buffer's end: ids in order, earlier values untouched."""
    free = FreeList.of(np.arange(capacity), capacity)
    model = list(range(capacity))
    history = [(free, list(model))]
    buffers = {id(free._buffer)}
    for round_ in range(4 * capacity + 2):
        count = 1 + round_ % capacity
        taken, free = free.take(count)
        assert taken.tolist() == model[:count]
        model = model[count:] + model[:count]
        free = free.give(taken[::-1][::-1])  # a view of the taken ids, as a caller might pass
        assert free.ids.tolist() == model, f"round {round_}"
        assert len(free) == capacity
        history.append((free, list(model)))
        buffers.add(id(free._buffer))
    assert len(buffers) > 1, "the buffer never filled up: the growth path did not run"
    for value, ids in history:
        assert value.ids.tolist() == ids
