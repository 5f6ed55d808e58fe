"""Hybrid pools with the prefix cache on: full pages cached, window tails and states at anchors.

A request that reads a cached prefix also needs the window pages of its
last `window` positions and the state after it: the pools keep both at
anchors (each extend row's last page boundary), and a match is cut back to
the longest anchor, where the request resumes. A row's whole pages go into
the cache (and rows of one step share them); releasing a row that ends
within a page frees its window pages and state, the anchors' stay, and
eviction of the full-attention pages an anchor ends drops it.
"""

from __future__ import annotations

from typing import Final

import pytest
import torch
from returns.result import Failure

from batchstate import (
    MemoryKinds,
    NotOwned,
    Pools,
    RecurrentState,
    Req,
    SlidingWindow,
    admit_prefilled,
    check_pools,
    decode,
    extend,
    find_leaks,
    flush,
    forward_inputs,
    hybrid_inputs,
    idle,
    make_pools,
    mix,
    release,
    split,
    unwrap,
)
from batchstate.audit import device_reads
from batchstate.pools.eviction import evict_leaves, unlocked_leaves
from tests.strategies import assert_unchanged, snapshot

CPU: Final = torch.device("cpu")
HEADER: Final = tuple(range(100, 140))  # 40 tokens: ten whole pages of 4
KINDS: Final = MemoryKinds((SlidingWindow(8, 512), RecurrentState(16, 8)))


def _pools(device: torch.device = CPU, kinds: MemoryKinds = KINDS) -> Pools:
    return make_pools(8, 128, 160, device, 4, prefix_cache=True, memory=kinds)


def _finish_one(pools: Pools, tail: tuple[int, ...], device: torch.device = CPU) -> Pools:
    # A request with the header runs its prefill and three decode steps, then leaves.
    extended, pools = unwrap(extend(idle(device), [Req(0, HEADER + tail)], pools))
    batch, pools = unwrap(decode(extended, pools))
    for _ in range(2):
        batch, pools = unwrap(decode(batch, pools))
    kept, left = split(batch, [])
    return unwrap(release(left, kept, pools))


@pytest.mark.parametrize(
    "kinds",
    [
        KINDS,
        MemoryKinds((SlidingWindow(8, 512),)),
        MemoryKinds((RecurrentState(16, 8),)),
        MemoryKinds((SlidingWindow(1, 512),)),  # reads no earlier position: an empty tail
    ],
)
def test_a_release_caches_full_pages_and_frees_window_pages_and_states(
    kinds: MemoryKinds,
) -> None:
    pools = _finish_one(_pools(kinds=kinds), (1, 2, 3))
    assert pools.cache.num_pages == 10  # the prompt's 43 tokens: 10 whole pages cached
    assert pools.num_free_tokens == 160 - 40
    anchor = pools.memory.cached.anchors[HEADER]  # published by the prefill at 40
    for windows in pools.memory.windows:  # the tail of a window of w: positions 41 - w on
        tail = -(-min(windows.window - 1, 40) // 4) if windows.window > 1 else 0
        assert len(anchor.window_pages) == tail
        assert len(windows.page_list) + tail == windows.num_pages  # every other page free
    for states in pools.memory.states:
        assert anchor.state and states.num_free == 7  # the anchor's state, the rest free
    check_pools(pools, [])
    assert not find_leaks(pools, [])
    assert pools.cache.match((*HEADER, 1, 2, 3))[0] == 0  # the cache alone: never read


def test_a_repeated_prompt_resumes_from_the_anchor_and_reads_the_cached_full_pages() -> None:
    pools = _finish_one(_pools(), (1, 2, 3))
    cached_pages = pools.cache.cached_prefix(HEADER)[1].tolist()
    assert len(cached_pages) == 10
    batch, pools = unwrap(extend(idle(CPU), [Req(1, (*HEADER, 7))], pools))
    assert batch.prefix_lens.tolist() == [40]  # only the last token is computed
    assert batch.extend_lens.tolist() == [1]
    slot = int(batch.rows.req_pool_indices.host[0])
    # Its full-attention pages are the cache's; its window pages and state its own: the
    # anchor's tail (positions 32..39) copied into new pages, and its state copied.
    assert pools.prefixes[slot] == HEADER
    assert pools.num_retired == 0
    table_pages = pools.table.host[slot, :40:4] // 4
    assert table_pages.tolist() == cached_pages
    windows = pools.memory.windows[0]
    assert int(windows.starts[slot]) == 32 and windows.row_pages(slot, 41).shape[0] == 3
    assert pools.memory.states[0].num_free == 6  # the row's and the anchor's taken
    anchor = pools.memory.cached.anchors[HEADER]
    assert anchor.locks == 1  # until the row's forward copied it
    copies = hybrid_inputs(forward_inputs(batch, pools.table, pools.page_size), pools).cached
    assert copies[0].window_from.host.tolist() == list(anchor.window_pages)
    assert copies[0].window_to.host.tolist() == windows.row_pages(slot, 41)[:2].tolist()
    check_pools(pools, [batch])

    # `mix` admits the same way: from the anchor.
    mixed, _ = unwrap(mix(idle(CPU), [Req(2, (*HEADER, 8, 9))], 64, pools, []))
    assert mixed.prefix_lens.tolist() == [40]


def test_eviction_frees_full_pages_only_and_every_kind_stays_conserved() -> None:
    pools = _pools()
    for rid in range(4):  # four prompts of 15 pages each into 40 pages: two evicted
        batch, pools = unwrap(
            extend(idle(CPU), [Req(rid, tuple(range(60 * rid, 60 * rid + 60)))], pools)
        )
        kept, left = split(batch, [])
        pools = unwrap(release(left, kept, pools))
        check_pools(pools, [])
    assert pools.cache.num_evicted == 30 and pools.cache.num_pages == 30  # whole prompts out
    # Each prompt published an anchor at 60; the two evicted prompts' anchors went with them.
    cached = pools.memory.cached
    assert sorted(len(prefix) for prefix in cached.anchors) == [60, 60]
    assert cached.num_evicted == 2
    assert pools.memory.states[0].num_free == 8 - 2
    assert len(pools.memory.windows[0].page_list) == pools.memory.windows[0].num_pages - 4


def test_a_released_row_cannot_be_released_again_nor_keep_its_own_state() -> None:
    pools = _pools()
    batch, pools = unwrap(extend(idle(CPU), [Req(0, (*HEADER, 1))], pools))
    state = int(pools.memory.states[0].of_slot[int(batch.rows.req_pool_indices.host[0])])
    kept, left = split(batch, [])
    after = unwrap(release(left, kept, pools))
    before = snapshot([left, kept, after])
    assert release(left, kept, after) == Failure(NotOwned((1,)))
    assert_unchanged(before, [left, kept, after])
    # The row's state slot went back free (its 41 tokens end within a page); the anchor the
    # prefill published at 40 keeps a state of its own, and the same prompt resumes there.
    assert after.memory.states[0].num_free == 7
    assert state not in after.memory.states[0].of_slot.tolist()
    assert after.memory.cached.anchors[HEADER].state != state
    again, after = unwrap(extend(idle(CPU), [Req(1, (*HEADER, 1))], after))
    assert again.prefix_lens.tolist() == [40]
    check_pools(after, [again])


def _cached_steps(device: torch.device) -> list[tuple[list[int], list[int], int]]:
    # Shared prompts on the cached path: an extend whose rows share the header (the second
    # reads the first's published pages), decode steps with their hybrid inputs, releases
    # into the cache, and a second round that matches the cached header.
    pools, seen = _pools(device), []
    for round_ in range(2):
        reqs = [Req(2 * round_ + i, (*HEADER, i, i + 1)) for i in range(2)]
        extended, pools = unwrap(extend(idle(device), reqs, pools))
        batch, pools = unwrap(decode(extended, pools))
        for _ in range(6):
            inputs = forward_inputs(batch, pools.table, pools.page_size)
            window = hybrid_inputs(inputs, pools).windows[0]
            seen.append(
                (
                    window.kv_indices.host.tolist(),
                    batch.rows.seq_lens.host.tolist(),
                    pools.cache.num_pages,
                )
            )
            batch, pools = unwrap(decode(batch, pools))
            batch, pools = unwrap(decode(batch, pools))
        kept, left = split(batch, [])
        pools = unwrap(release(left, kept, pools))
        check_pools(pools, [])
    return seen


def test_the_cached_hybrid_path_reads_nothing_from_the_device() -> None:
    with device_reads(forbid=True) as log:
        on_meta = _cached_steps(torch.device("meta"))
    assert log.report().count == 0
    assert on_meta == _cached_steps(CPU)
    assert {cached for _, _, cached in on_meta} == {10}  # the header's pages, shared by all


def test_flush_drops_every_unlocked_anchor_with_the_pages_it_ends() -> None:
    """After `flush` every page, window page and state slot is free, and the pools check."""
    pools = _finish_one(_pools(), (1,))
    assert pools.memory.cached.anchors  # kept at release, or published by the extend
    flushed = flush(pools)
    check_pools(flushed, [])
    assert not flushed.memory.cached.anchors
    assert flushed.cache.num_pages == 0
    windows, states = flushed.memory.windows[0], flushed.memory.states[0]
    assert len(windows.page_list) == windows.num_pages
    assert states.num_free == 8
    assert flush(flushed) is flushed  # nothing left to evict


def test_the_sglang_shadow_evicting_leaves_drops_the_anchors_they_end() -> None:
    """Evicting named leaves (the SGLang shadow's walk) drops anchors ending in them."""
    pools = _finish_one(_pools(), (1,))
    assert pools.memory.cached.anchors
    evicted = evict_leaves(pools, [(leaf, 0) for leaf, _ in unlocked_leaves(pools)])
    check_pools(evicted, [])
    assert evicted.cache.num_pages == 0
    assert not evicted.memory.cached.anchors


def test_a_prebuilt_row_released_before_its_transfer_keeps_no_anchor() -> None:
    """Its window tail and state were never written: both go back free, no match ends there."""
    prompt = HEADER[:16]
    arrived, pools = unwrap(admit_prefilled(idle(CPU), [Req(0, prompt)], _pools()))
    kept, left = split(arrived, [])
    released = unwrap(release(left, kept, pools, [prompt]))
    check_pools(released, [])
    assert not released.memory.cached.anchors
    assert released.memory.states[0].num_free == 8
    again, _ = unwrap(extend(idle(CPU), [Req(1, (*prompt, 1))], released))
    assert again.prefix_lens.tolist() == [0]  # computed, not read from unwritten memory

    # Once the row grew (its transfer ran before its decode), its release keeps one.
    arrived, pools = unwrap(admit_prefilled(idle(CPU), [Req(0, HEADER[:15])], _pools()))
    running, pools = unwrap(decode(arrived, pools))
    kept, left = split(running, [])
    grown = unwrap(release(left, kept, pools, [prompt]))
    check_pools(grown, [])
    assert set(grown.memory.cached.anchors) == {prompt}


def test_a_row_released_before_its_resume_copies_ran_keeps_no_anchor() -> None:
    """A resumed row that never ran its forward holds no written tail or state to keep."""
    kinds = MemoryKinds((SlidingWindow(8, 512), RecurrentState(16, 2)))
    pools = _finish_one(_pools(kinds=kinds), (1, 2, 3))
    prompt = (*HEADER, 5, 6, 7, 8)  # 44 tokens: resumes at 40, ends on a page boundary
    batch, pools = unwrap(extend(idle(CPU), [Req(1, prompt)], pools))
    assert batch.prefix_lens.tolist() == [40]
    assert set(pools.memory.cached.anchors) == {HEADER}  # no state left to publish at 44
    kept, left = split(batch, [])
    released = unwrap(release(left, kept, pools, [prompt]))
    check_pools(released, [])
    assert set(released.memory.cached.anchors) == {HEADER}
    assert released.memory.states[0].num_free == 1
