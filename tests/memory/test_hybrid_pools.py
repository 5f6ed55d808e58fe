"""Hybrid pools: window pages and state slots beside full-attention pages, each conserved."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from benchmarks.hybrid import long_run
from returns.result import Failure
from tools.decode_loop import LoopConfig, run_loop, scripted_accept

from batchstate import (
    FULL_ATTENTION,
    Batch,
    Decoding,
    Extended,
    ForwardInputsError,
    Idle,
    MemoryKindError,
    MemoryKinds,
    OutOfKVTokens,
    OutOfReqSlots,
    Pools,
    PoolsArgumentError,
    RecurrentState,
    Req,
    SlidingWindow,
    StaleRecord,
    accepted_states,
    check_batch,
    check_leaks,
    check_pools,
    decode,
    exact_window,
    extend,
    find_leaks,
    finish_mixed,
    forward_inputs,
    hybrid_inputs,
    idle,
    make_pools,
    merge,
    mix,
    pad,
    release,
    split,
    sync,
    unwrap,
    verify,
    verify_ahead,
)
from batchstate.audit import device_reads
from batchstate.base.mirrored import host_int64
from tests.strategies import assert_unchanged, snapshot

CPU = torch.device("cpu")
META = torch.device("meta")


def _kinds(window: int = 8, window_tokens: int = 256, num_states: int = 8) -> MemoryKinds:
    return MemoryKinds(
        (SlidingWindow(window, window_tokens), RecurrentState(state_size=32, num_states=num_states))
    )


def _pools(page_size: int = 4, **kinds: int) -> Pools:
    return make_pools(8, 128, 1024, CPU, page_size, memory=_kinds(**kinds))


def _reqs(first: int, count: int, length: int = 20) -> list[Req]:
    return [Req(rid, tuple(range(length + rid % 3))) for rid in range(first, first + count)]


def test_full_attention_pools_hold_nothing_more() -> None:
    pools = make_pools(4, 32, 64, CPU, page_size=4)
    assert pools.memory_kinds == FULL_ATTENTION
    assert pools.memory.windows == () and pools.memory.states == ()
    assert "memory=" not in repr(pools)


@pytest.mark.parametrize(
    ("kinds", "cache", "message"),
    [
        (MemoryKinds((SlidingWindow(0, 64),)), False, "window of 0"),
        (MemoryKinds((SlidingWindow(129, 1024),)), False, "window of 129"),
        (MemoryKinds((SlidingWindow(8, 10),)), False, "whole pages"),
        (MemoryKinds((SlidingWindow(8, 8),)), False, "one row's window"),
        (MemoryKinds((RecurrentState(0, 4),)), False, "both must be >= 1"),
        (MemoryKinds((RecurrentState(2**28, 8),)), False, "int32-indexed"),
        (MemoryKinds((SlidingWindow(8, 64), SlidingWindow(8, 64))), False, "at most one"),
        (MemoryKinds((RecurrentState(4, 0),)), True, "both must be >= 1"),
    ],
)
def test_bad_memory_kinds_are_refused(kinds: MemoryKinds, cache: bool, message: str) -> None:
    with pytest.raises(MemoryKindError, match=message):
        make_pools(8, 128, 1024, CPU, page_size=4, prefix_cache=cache, memory=kinds)


def test_a_state_slot_per_live_request_taken_and_given_back_with_its_slot() -> None:
    pools = _pools()
    extended, pools = unwrap(extend(idle(CPU), _reqs(0, 3), pools))
    states = pools.memory.states[0]
    slots = extended.rows.req_pool_indices.host
    assert states.num_free == 5
    assert sorted(states.of_slot[slots].tolist()) == [1, 2, 3]
    check_pools(pools, [extended])
    kept, left = split(extended, [0])
    pools = unwrap(release(left, kept, pools))
    assert pools.memory.states[0].num_free == 7
    assert pools.memory.states[0].of_slot[slots[1:]].tolist() == [0, 0]
    check_pools(pools, [kept])


def test_fewer_states_than_slots_admit_fewer_requests_and_change_nothing() -> None:
    pools = _pools(num_states=2)
    refused = extend(idle(CPU), _reqs(0, 3), pools)
    assert refused == Failure(OutOfReqSlots(3, 2))
    assert pools.is_newest and pools.memory.states[0].num_free == 2
    admitted, pools = unwrap(extend(idle(CPU), _reqs(0, 2), pools))
    check_pools(pools, [admitted])


def test_a_row_holds_window_pages_for_its_window_only() -> None:
    page, window = 4, 8
    pools = _pools(page, window=window)
    extended, pools = unwrap(extend(idle(CPU), _reqs(0, 4), pools))
    running, pools = unwrap(decode(extended, pools))
    for _ in range(59):
        running, pools = unwrap(decode(running, pools))
        check_pools(pools, [running])
    pages = pools.memory.windows[0]
    rows = running.rows
    for slot, length in zip(
        rows.req_pool_indices.host.tolist(), rows.seq_lens.host.tolist(), strict=True
    ):
        held = pages.row_pages(slot, length).shape[0]
        # the next token reads `window` positions: at most one page more than they span
        assert held <= -(-window // page) + 1
        assert int(pages.starts[slot]) > 0  # the window moved on: its first pages are back
    # 4 rows of ~80 tokens keep 320 full-attention tokens, but 4 windows of pages only
    assert pages.num_pages - len(pages.page_list) <= 4 * 3
    assert pools.num_pages - len(pools.page_list) >= 80


def test_window_pages_running_short_refuse_the_growth_and_change_nothing() -> None:
    pools = _pools(4, window=8, window_tokens=48)  # 12 window pages
    refused = extend(idle(CPU), _reqs(0, 3, length=17), pools)  # 3 rows of 5 or 6 pages
    assert isinstance(refused, Failure)
    assert isinstance(refused.failure(), OutOfKVTokens)
    assert pools.is_newest and len(pools.memory.windows[0].page_list) == 12
    check_pools(pools)


def test_chunked_prefill_keeps_its_state_and_frees_window_pages_per_chunk() -> None:
    pools = _pools(4, window=8)
    prompt = Req(0, tuple(range(100)))
    step = unwrap(mix(idle(CPU), [prompt], 32, pools))
    pools = step.pools
    running, held = finish_mixed(step.batch)
    chunk = held[0]
    state = int(pools.memory.states[0].of_slot[chunk.slot])
    assert state > 0
    check_leaks(pools, [running, chunk])
    leaks = find_leaks(pools, [running])  # the Chunked forgotten: its memory is named
    assert leaks.unheld == (chunk.slot,) and leaks.unheld_states == 1
    assert leaks.unheld_window_pages == 8
    for _ in range(2):
        step = unwrap(mix(running, [chunk], 32, pools))
        pools = step.pools
        running, held = finish_mixed(step.batch)
        chunk = held[0]
        assert int(pools.memory.states[0].of_slot[chunk.slot]) == state  # the same state
        check_pools(pools, [running])
        check_leaks(pools, [running, chunk])
    # the third chunk started at 64: it reads from 57 on, pages before 56 are back
    assert int(pools.memory.windows[0].starts[chunk.slot]) == 56


def test_a_record_whose_state_slot_was_released_is_refused() -> None:
    pools = _pools()
    extended, pools = unwrap(extend(idle(CPU), _reqs(0, 2), pools))
    kept, left = split(extended, [1])
    pools = unwrap(release(left, kept, pools))
    again, pools = unwrap(extend(idle(CPU), _reqs(5, 1), pools))  # reuses the released slot
    with pytest.raises(StaleRecord):
        decode(extended, pools)  # its first row's slot (and state) belongs to another now
    assert isinstance(release(left, kept, pools), Failure)
    check_pools(pools, [kept, again])


def _host_checks(batch: Batch, pools: Pools) -> None:
    if not isinstance(batch, Idle):
        check_batch(batch)
    check_pools(pools, [batch])
    if isinstance(batch, Decoding | Extended):
        _check_hybrid_inputs(batch, pools)


def _check_hybrid_inputs(batch: Decoding | Extended, pools: Pools) -> None:
    # The window inputs list exactly the window pages each row holds, and every new token's
    # window location lies in one of its row's pages; each row gets its own state slot.
    inputs = forward_inputs(batch, pools.table, pools.page_size)
    hybrid = hybrid_inputs(inputs, pools)
    window, pages = hybrid.windows[0], pools.memory.windows[0]
    slots, lens = batch.rows.req_pool_indices.host.tolist(), batch.rows.seq_lens.host.tolist()
    indptr = window.kv_indptr.host
    tokens = np.cumsum(inputs.extend_lens.host)
    for row, (slot, length) in enumerate(zip(slots, lens, strict=True)):
        held = pages.row_pages(slot, length)
        assert window.kv_indices.host[indptr[row] : indptr[row + 1]].tolist() == held.tolist()
        assert int(window.kv_starts.host[row]) == int(pages.starts[slot])
        first = tokens[row - 1] if row else 0
        assert set(
            (window.out_cache_loc.host[first : tokens[row]] // pools.page_size).tolist()
        ) <= set(held.tolist())
    states = hybrid.states[0].state_indices.host
    assert states.tolist() == pools.memory.states[0].of_slot[slots].tolist()
    assert np.unique(states).shape[0] == len(slots) and (states > 0).all()


@pytest.mark.parametrize("page_size", [1, 16])
def test_hybrid_decode_loop_reads_nothing_from_the_device(page_size: int) -> None:
    kinds = MemoryKinds((SlidingWindow(32, 64 * 48), RecurrentState(64, 48)))
    config = LoopConfig(page_size=page_size, draft_every=4, memory=kinds)
    with device_reads(forbid=True) as log:
        on_meta = run_loop(META, config, check=_host_checks)
    assert log.report().count == 0
    on_cpu = run_loop(CPU, config, check=_host_checks)
    assert [(s.event, s.slots, s.lens) for s in on_meta] == [
        (s.event, s.slots, s.lens) for s in on_cpu
    ]


def test_hybrid_loop_with_accepted_drafts_conserves_every_kind() -> None:
    kinds = MemoryKinds((SlidingWindow(24, 4096), RecurrentState(8, 48)))
    config = LoopConfig(page_size=4, draft_every=3, memory=kinds)
    snapshots = run_loop(CPU, config, accept=scripted_accept, check=_host_checks)
    assert sum(s.event == "sync" for s in snapshots) >= 30


def test_merged_rows_keep_their_states() -> None:
    pools = _pools()
    first, pools = unwrap(extend(idle(CPU), _reqs(0, 2), pools))
    second, pools = unwrap(extend(idle(CPU), _reqs(2, 2), pools))
    running = merge(merge(idle(CPU), first), second)
    states = pools.memory.states[0].of_slot[running.rows.req_pool_indices.host]
    assert np.unique(states).shape == (4,) and (states > 0).all()
    check_pools(pools, [running])


def test_hybrid_inputs_refuse_pools_that_moved_on() -> None:
    pools = _pools()
    extended, pools = unwrap(extend(idle(CPU), _reqs(0, 2), pools))
    inputs = forward_inputs(extended, pools.table, pools.page_size)
    _check_hybrid_inputs(extended, pools)
    _, later = unwrap(decode(extended, pools))
    with pytest.raises(ForwardInputsError, match="other lengths"):
        hybrid_inputs(inputs, later)
    with pytest.raises(ForwardInputsError, match="other pools"):
        hybrid_inputs(inputs, make_pools(4, 128, 1024, CPU, 4, memory=_kinds()))


def test_a_long_run_holds_one_window_of_window_pages_per_row() -> None:
    held = long_run(num_reqs=4, prompt=16, steps=300, page_size=4, window=16)
    assert held["tokens_per_row"] == 316
    assert 4 * 16 <= held["window_tokens"] <= 4 * (16 + 4)  # a window, and a page it straddles
    assert held["full_tokens"] == 4 * 316  # full attention keeps every token
    assert held["states"] == 4


def test_chunked_mixed_steps_on_hybrid_pools_read_nothing_from_the_device() -> None:
    kinds = MemoryKinds((SlidingWindow(6, 512), RecurrentState(16, 8)))
    with device_reads(forbid=True) as log:
        pools = make_pools(8, 128, 1024, META, 4, memory=kinds)
        step = unwrap(mix(idle(META), [Req(0, tuple(range(50))), Req(1, (1, 2, 3))], 16, pools))
        pools = step.pools
        for _ in range(6):
            inputs = forward_inputs(step.batch, pools.table, pools.page_size)
            hybrid_inputs(inputs, pools)
            running, held = finish_mixed(step.batch)
            step = unwrap(mix(running, list(held), 16, pools, [7] * len(running.rows.reqs)))
            pools = step.pools
        running, held = finish_mixed(step.batch)
        check_pools(pools, [running])
        check_leaks(pools, [running, *held])
    assert log.report().count == 0
    assert int(pools.memory.windows[0].starts[int(running.rows.req_pool_indices.host[0])]) > 0


@pytest.mark.parametrize("memory", ["full", None, 3, (SlidingWindow(8, 64),), SlidingWindow(8, 64)])
def test_a_memory_that_is_no_description_is_refused(memory: object) -> None:
    with pytest.raises(MemoryKindError, match="MemoryKinds"):
        make_pools(8, 128, 1024, CPU, 4, memory=memory)  # type: ignore[arg-type]  # the point
    with pytest.raises(MemoryKindError, match="not a memory kind"):
        make_pools(8, 128, 1024, CPU, 4, memory=MemoryKinds(("window",)))  # type: ignore[arg-type]  # the point


def test_shrinking_a_row_behind_its_window_start_is_refused() -> None:
    pools = _pools(4, window=8)
    extended, pools = unwrap(extend(idle(CPU), _reqs(0, 1, length=20), pools))
    running, pools = unwrap(decode(extended, pools))  # reads from 13 on: pages before 12 back
    slot = running.rows.req_pool_indices.host
    assert int(pools.memory.windows[0].starts[slot[0]]) == 12
    before = snapshot(pools)
    with pytest.raises(PoolsArgumentError, match="window pages before position 12"):
        pools.shrink(slot, host_int64([18]))  # its next forward would read from 11
    assert_unchanged(before, pools)
    assert pools.is_newest
    shrunk = unwrap(pools.shrink(slot, host_int64([19])))  # reads from 12: still held
    check_pools(shrunk)


def test_a_deep_copy_of_hybrid_pools_is_a_lineage_of_its_own() -> None:
    pools = _pools()
    running, pools = unwrap(extend(idle(CPU), _reqs(0, 3), pools))
    copied = copy.deepcopy(pools)
    check_pools(copied, [running])
    _, after = unwrap(decode(running, copied))
    assert pools.is_newest and after.is_newest
    check_pools(pools, [running])
    assert not copied.memory.windows[0].table.flags.writeable


def test_verify_windows_keep_the_window_pages_their_forwards_read() -> None:
    # ps 1, window 4: a verify window re-queries its decode token at c - 1, which reads from
    # c - 4; the next window, opened ahead of the read, reads from c + accepted - 3 >= c - 3.
    pools = make_pools(4, 64, 256, CPU, 1, memory=_kinds(window=4, window_tokens=64))
    extended, pools = unwrap(extend(idle(CPU), _reqs(0, 1, length=20), pools))
    decoding, pools = unwrap(decode(extended, pools))  # c = 21, decode token at 20
    slot = int(decoding.rows.req_pool_indices.host[0])
    window, pools = unwrap(verify(decoding, [3], pools))
    assert int(pools.memory.windows[0].starts[slot]) == 17  # 20 - 4 + 1: the decode token's
    ahead, pools = unwrap(verify_ahead(window, torch.tensor([2]), [2], pools))
    assert int(pools.memory.windows[0].starts[slot]) == 18  # 21 - 4 + 1, for none accepted
    check_pools(pools)
    window, pools = exact_window(ahead, np.array([2]), pools)
    synced, pools = sync(window, np.array([1]), pools)
    check_pools(pools, [synced])
    assert int(synced.rows.seq_lens.host[0]) == 21 + 2 + 1 + 1


def test_padded_rows_read_the_padding_window_page_and_state() -> None:
    pools = _pools()
    extended, pools = unwrap(extend(idle(CPU), _reqs(0, 2), pools))
    running, pools = unwrap(decode(extended, pools))
    padded = unwrap(pad(forward_inputs(running, pools.table, pools.page_size), [4]))
    hybrid = hybrid_inputs(padded.inputs, pools)
    window, states = hybrid.windows[0], hybrid.states[0].state_indices.host
    assert hybrid.num_rows == 4
    assert states.tolist()[2:] == [0, 0] and (states[:2] > 0).all()
    indptr = window.kv_indptr.host
    assert window.kv_indices.host[indptr[2] :].tolist() == [0, 0]  # one padding page each
    assert window.out_cache_loc.host[2:].tolist() == [0, 0]
    unpadded = hybrid_inputs(forward_inputs(running, pools.table, pools.page_size), pools)
    assert (
        window.kv_indices.host[: indptr[2]].tolist() == unpadded.windows[0].kv_indices.host.tolist()
    )


def test_a_verify_window_on_hybrid_pools_reads_nothing_from_the_device() -> None:
    with device_reads(forbid=True) as log:
        pools = make_pools(8, 128, 1024, META, 4, memory=_kinds())
        extended, pools = unwrap(extend(idle(META), _reqs(0, 3), pools))
        decoding, pools = unwrap(decode(extended, pools))
        window, pools = unwrap(verify(decoding, [2, 0, 3], pools))
        inputs = forward_inputs(window, pools.table, pools.page_size, slot_tokens=pools.slot_tokens)
        hybrid = hybrid_inputs(inputs, pools)
        accepted = torch.zeros(3, dtype=torch.int64, device=META)  # written by the forward
        copies = accepted_states(inputs, hybrid, accepted)
        padded = unwrap(pad(inputs, [4, 8]))
        hybrid_inputs(padded.inputs, pools)
        synced, pools = sync(window, np.array([1, 0, 3]), pools)  # counts the host has
        check_pools(pools, [synced])
    assert log.report().count == 0
    assert copies.sources.device.device == META
    assert copies.targets.host.tolist() == hybrid.states[0].state_indices.host.tolist()
