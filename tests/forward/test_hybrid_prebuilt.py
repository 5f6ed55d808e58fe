"""`admit_prefilled` on hybrid pools: a window tail and a state per row, named by
`transfer_targets`.

A prebuilt row's prompt was computed elsewhere; its next forward is the
decode at `seq_len`, which reads window positions from `seq_len - window
+ 1` on. So the row takes window pages from that position's page on (the
tail a transfer fills) and a state slot, and a row released since is
refused by every transition and by `transfer_targets`, changing nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from returns.result import Failure

from batchstate import (
    Chunked,
    MemoryKinds,
    NotHeld,
    OutOfKVTokens,
    Pools,
    RecurrentState,
    Req,
    SlidingWindow,
    StaleRecord,
    admit_prefilled,
    check_pools,
    decode,
    extend,
    forward_inputs,
    hybrid_inputs,
    idle,
    make_pools,
    release,
    split,
    transfer_targets,
    unwrap,
)
from tests.strategies import assert_unchanged, snapshot

CPU = torch.device("cpu")
WINDOW = 8
LENGTHS = (1, 7, 8, 9, 15, 16, 17, 30, 41)


def _pools(page_size: int, window_tokens: int = 512, max_reqs: int = 12) -> Pools:
    kinds = MemoryKinds((SlidingWindow(WINDOW, window_tokens), RecurrentState(16, max_reqs)))
    return make_pools(max_reqs, 64, 1024, CPU, page_size, memory=kinds)


def _reqs() -> list[Req]:
    return [Req(rid, tuple(range(100, 100 + length))) for rid, length in enumerate(LENGTHS)]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_prebuilt_row_holds_its_window_tail_and_then_decodes_as_an_extended_one(
    page_size: int,
) -> None:
    arrived, pools = unwrap(admit_prefilled(idle(CPU), _reqs(), _pools(page_size)))
    check_pools(pools, [arrived])
    windows = pools.memory.windows[0]
    slots = arrived.rows.req_pool_indices.host.tolist()
    for slot, length in zip(slots, LENGTHS, strict=True):
        first_read = max(length - WINDOW + 1, 0)  # what the decode at `length` reads first
        start = first_read - first_read % page_size
        assert int(windows.starts[slot]) == start
        assert windows.row_pages(slot, length).shape[0] == -(-length // page_size) - (
            start // page_size
        )
    assert sorted(pools.memory.states[0].of_slot[slots].tolist()) == list(
        range(1, len(LENGTHS) + 1)
    )
    # After one decode it holds what the same prompt holds after an extend and a decode.
    decoded, pools = unwrap(decode(arrived, pools))
    check_pools(pools, [decoded])
    extended, other = unwrap(extend(idle(CPU), _reqs(), _pools(page_size)))
    alike, other = unwrap(decode(extended, other))
    for slot, again in zip(slots, alike.rows.req_pool_indices.host.tolist(), strict=True):
        ours, theirs = pools.memory.windows[0], other.memory.windows[0]
        length = int(pools.slot_tokens[slot])
        assert int(ours.starts[slot]) == int(theirs.starts[again])
        assert ours.row_pages(slot, length).shape[0] == theirs.row_pages(again, length).shape[0]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_transfer_targets_name_every_location_the_next_decode_reads(page_size: int) -> None:
    arrived, pools = unwrap(admit_prefilled(idle(CPU), _reqs(), _pools(page_size)))
    targets = transfer_targets(arrived, pools)
    slots = arrived.rows.req_pool_indices.host
    # Full attention: every prompt position, at the table's cells.
    expected = np.concatenate(
        [pools.table.host[slot, :length] for slot, length in zip(slots, LENGTHS, strict=True)]
    )
    assert targets.kv_locs.host.tolist() == expected.tolist()
    assert targets.kv_locs.device.tolist() == expected.tolist()
    window, pages = targets.hybrid.windows[0], pools.memory.windows[0]
    tails = [length - int(pages.starts[slot]) for slot, length in zip(slots, LENGTHS, strict=True)]
    assert len(window.out_cache_loc) == sum(tails)
    filled = set(window.out_cache_loc.host.tolist())
    assert len(filled) == sum(tails)  # each tail position its own window location
    state = targets.hybrid.states[0].state_indices.host
    assert state.tolist() == pools.memory.states[0].of_slot[slots].tolist()
    # The decode reads only window locations the transfer filled, and the one it writes.
    decoded, pools = unwrap(decode(arrived, pools))
    inputs = forward_inputs(decoded, pools.table, pools.page_size)
    read = hybrid_inputs(inputs, pools).windows[0]
    indptr, starts = read.kv_indptr.host, read.kv_starts.host
    for row, length in enumerate(LENGTHS):
        row_pages = read.kv_indices.host[indptr[row] : indptr[row + 1]]
        first = max(length - WINDOW + 1, 0)  # the decode at `length` reads [first, length]
        for position in range(first, length):
            page = row_pages[(position - int(starts[row])) // page_size]
            assert int(page) * page_size + position % page_size in filled


def test_full_attention_pools_name_the_kv_alone() -> None:
    pools = make_pools(4, 32, 128, CPU, 4)
    arrived, pools = unwrap(admit_prefilled(idle(CPU), [Req(0, tuple(range(10)))], pools))
    targets = transfer_targets(arrived, pools)
    assert targets.kv_locs.host.tolist() == pools.table.host[1, :10].tolist()
    assert targets.hybrid.windows == () and targets.hybrid.states == ()


def test_window_pages_for_the_tails_alone_admit_more() -> None:
    # 16 window pages of 4: three prompts of 41 tokens need 33 if whole, 9 as tails.
    reqs = [Req(rid, tuple(range(41))) for rid in range(3)]
    arrived, pools = unwrap(admit_prefilled(idle(CPU), reqs, _pools(4, window_tokens=64)))
    check_pools(pools, [arrived])
    assert isinstance(extend(idle(CPU), reqs, pools), Failure)  # whole prompts do not fit
    # Tails running short: refused, naming how many fit, nothing changed.
    pools = _pools(4, window_tokens=16)
    before = snapshot(pools)
    refused = admit_prefilled(idle(CPU), reqs, pools)
    assert isinstance(refused, Failure)
    failure = refused.failure()
    assert isinstance(failure, OutOfKVTokens) and failure.fits == 1
    assert_unchanged(before, pools)
    assert pools.is_newest


def test_a_released_row_is_refused_everywhere_and_changes_nothing() -> None:
    arrived, pools = unwrap(admit_prefilled(idle(CPU), _reqs()[:3], _pools(4)))
    kept, left = split(arrived, [2])
    pools = unwrap(release(left, kept, pools))  # rows 0 and 1: slots, windows, states back
    again, pools = unwrap(extend(idle(CPU), [Req(50, tuple(range(20)))], pools))
    before = snapshot(pools)
    with pytest.raises(StaleRecord):
        transfer_targets(arrived, pools)
    with pytest.raises(StaleRecord):
        decode(arrived, pools)
    # Row 1 as a chunk holding its 7 tokens, with more to compute: its slot is gone.
    slot, gen = int(arrived.rows.req_pool_indices.host[1]), int(arrived.rows.gens[1])
    req = arrived.rows.reqs[1]
    held = Chunked(Req(req.rid, (*req.input_ids, 1, 2)), slot, LENGTHS[1], gen=gen)
    refused = extend(idle(CPU), [held], pools)
    assert isinstance(refused, Failure) and isinstance(refused.failure(), NotHeld)
    assert_unchanged(before, pools)
    check_pools(pools, [kept, again])
