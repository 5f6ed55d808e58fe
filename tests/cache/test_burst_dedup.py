"""A burst of requests sharing a new prompt holds its KV once after the prefill.

With the prefix cache on, a row whose whole pages the cache holds already
(an earlier row of the same extend or chunk published them, or an earlier
step did) reads the cache's pages from its prefill's end on: its own copy
is retired (the forward in flight writes it, nothing reads it) and the next
allocation frees it. Free tokens are asserted exactly, page sizes 1 and 16.
"""

from __future__ import annotations

from typing import Final

import pytest
import torch
from benchmarks.counting import count_device_work
from hypothesis import given, settings
from hypothesis import strategies as st

from batchstate import (
    Extended,
    Pools,
    Req,
    check_leaks,
    check_pools,
    decode,
    extend,
    filter_batch,
    finish_mixed,
    flush,
    idle,
    make_pools,
    mix,
    release,
    split,
)
from batchstate.audit import device_reads
from batchstate.engine import EngineConfig, SimulationConfig, WorkloadConfig, simulate
from batchstate.engine._report import render_summary, summarize

CPU: Final = torch.device("cpu")
META: Final = torch.device("meta")
SYSTEM: Final = tuple(range(100, 164))  # a 64-token system prompt: 4 pages of 16, 64 of 1
KV_TOKENS: Final = 4096


def _pools(page_size: int, device: torch.device = CPU) -> Pools:
    return make_pools(32, 256, KV_TOKENS, device, page_size=page_size, prefix_cache=True)


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _burst(count: int, tail: int = 3) -> list[Req]:
    return [Req(rid, (*SYSTEM, *range(rid * 10, rid * 10 + tail))) for rid in range(count)]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("count", [2, 8, 32])
def test_a_burst_in_one_extend_holds_the_prompt_once(page_size: int, count: int) -> None:
    reqs = _burst(count)
    batch, pools = extend(idle(CPU), reqs, _pools(page_size)).unwrap()
    assert batch.prefix_lens.tolist() == [0] * count  # every row computes the prompt
    # Held once: the system prompt's pages, then each row's own tail.
    shared = len(SYSTEM) // page_size
    own = _pages(len(reqs[0].input_ids), page_size) - shared
    held = (shared + count * own) * page_size
    assert pools.num_free_tokens == KV_TOKENS - held
    assert len(pools.retired) == (count - 1) * shared  # written by this forward, read by none
    assert pools.num_retired == (count - 1) * shared
    check_pools(pools, [batch], compare_device=True)
    # Every row reads the first row's pages for the prompt.
    slots = batch.rows.req_pool_indices.host.tolist()
    table = pools.table.host
    assert all(
        (table[slot, : len(SYSTEM)] == table[slots[0], : len(SYSTEM)]).all() for slot in slots
    )
    # The next transition's allocation frees the retired pages: nothing is held twice.
    decoding, after = decode(batch, pools).unwrap()
    assert len(after.retired) == 0
    assert (
        after.num_free_tokens == pools.num_free_tokens - _decode_pages(batch, page_size) * page_size
    )
    check_pools(after, [decoding], compare_device=True)


def _decode_pages(batch: Extended, page_size: int) -> int:
    # Pages the next decode takes: one per row whose new token opens a page.
    return int((batch.rows.seq_lens.host % page_size == 0).sum())


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_prompt_published_by_an_earlier_step_is_read_from_the_cache(page_size: int) -> None:
    # The same prompt again: the new row computes its last page (a token is left to
    # compute), which the cache holds already; at its prefill's end it reads the cache's.
    prompt = (*SYSTEM, 7)
    first, pools = extend(idle(CPU), [Req(1, prompt)], _pools(page_size)).unwrap()
    before = pools.num_free_tokens
    second, pools = extend(idle(CPU), [Req(2, prompt)], pools).unwrap()
    hit = (len(prompt) - 1) // page_size * page_size
    full = len(prompt) // page_size * page_size
    assert second.prefix_lens.tolist() == [hit]
    # It holds only a partly filled last page of its own, if the prompt has one.
    own = 1 if len(prompt) % page_size else 0
    assert pools.num_free_tokens == before - own * page_size
    assert len(pools.retired) == (full - hit) // page_size
    slot = int(second.rows.req_pool_indices.host[0])
    assert pools.prefixes[slot] == prompt[:full]  # the lock moved to the whole pages
    check_pools(pools, [first, second], compare_device=True)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_chunk_reads_what_another_row_published_while_it_was_held(page_size: int) -> None:
    # B starts in chunks; A computes the whole prompt meanwhile; at B's next chunk's end
    # its earlier chunk's pages and this chunk's move onto A's, its own are retired.
    a, b = Req(1, (*SYSTEM, 1)), Req(2, (*SYSTEM, 2))
    pools = _pools(page_size)
    mixed, pools = mix(idle(CPU), [b], 24, pools, []).unwrap()
    (held,) = finish_mixed(mixed).held
    batch, pools = extend(idle(CPU), [a], pools).unwrap()  # A publishes all of SYSTEM
    mixed, pools = mix(idle(CPU), [held], 24, pools, []).unwrap()
    settled = finish_mixed(mixed)
    (held,) = settled.held
    assert held.cached == 48
    assert pools.prefixes[held.slot] == SYSTEM[:48]  # B reads A's pages for its 48 tokens
    table = pools.table.host
    assert (table[held.slot, :48] == table[int(batch.rows.req_pool_indices.host[0]), :48]).all()
    assert len(pools.retired) == (48 - 24 // page_size * page_size) // page_size
    # Held once: A's whole prompt and partial page; B holds nothing of its own yet.
    held_tokens = _pages(len(a.input_ids), page_size) * page_size
    assert pools.num_free_tokens == KV_TOKENS - held_tokens
    check_pools(pools, [batch], compare_device=True)
    check_leaks(pools, [batch, held])
    # B finishes: its last chunk computes the rest; release and flush free everything.
    mixed, pools = mix(idle(CPU), [held], 64, pools, []).unwrap()
    done = finish_mixed(mixed).running
    pools = release(done, idle(CPU), pools).unwrap()
    pools = release(batch, idle(CPU), pools).unwrap()
    pools = flush(pools)
    assert pools.num_free_tokens == KV_TOKENS and len(pools.free_pages) * page_size == KV_TOKENS


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_chunk_continued_after_a_new_request_with_its_prompt_publishes_first(
    page_size: int,
) -> None:
    """No cell the chunk reads as its prefix is one the forward writes; the prompt held once.

    The new request goes first in `admit` and computes the prompt past its cached part; the
    chunk continues past cells its earlier chunk wrote, in a page it shares with this
    forward's positions. The chunk publishes first: the new request moves onto the chunk's
    pages at positions it computes itself, and the chunk's own cells stay as they were.
    """
    prompt = (*SYSTEM[:52], 7)  # 53 tokens: the chunk holds 22 (not a page boundary at 4, 16)
    pools = _pools(page_size)
    first, pools = mix(idle(CPU), [Req(0, prompt)], 22, pools, []).unwrap()
    settled = finish_mixed(first)
    (held,) = settled.held
    chunk_cells = pools.table.host[held.slot, :22].copy()
    new = Req(1, (*prompt, 9))
    second, pools = mix(settled.running, [new, held], 128, pools, []).unwrap()
    new_slot, chunk_slot = second.rows.req_pool_indices.host.tolist()
    table = pools.table.host
    assert (table[chunk_slot, :22] == chunk_cells).all()  # what an earlier forward wrote
    written = set(second.out_cache_loc.device.tolist())
    for slot, prefix in zip((new_slot, chunk_slot), second.prefix_lens.tolist(), strict=True):
        assert not written.intersection(table[slot, :prefix].tolist())
    full = len(prompt) // page_size * page_size
    assert (table[new_slot, :full] == table[chunk_slot, :full]).all()  # held once
    assert pools.prefixes[chunk_slot] == pools.prefixes[new_slot][:full] == prompt[:full]
    check_pools(pools, [finish_mixed(second).running], compare_device=True)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_burst_on_meta_reads_nothing_from_the_device(page_size: int) -> None:
    """The new cells go with the extend's one upload; nothing is read back."""
    with device_reads(forbid=True) as log:
        batch, pools = extend(idle(META), _burst(8), _pools(page_size, META)).unwrap()
        running = filter_batch(batch, list(range(8)))
        decoding, pools = decode(running, pools).unwrap()
        kept, left = split(decoding, [0, 1, 2])
        pools = release(left, kept, pools).unwrap()
    assert log.report().count == 0
    assert pools.num_retired == 7 * (len(SYSTEM) // page_size)
    check_pools(pools, [kept])


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_moved_cells_cost_no_extra_copy_nor_kernel(page_size: int) -> None:
    """A burst whose rows move onto the cache's pages costs what distinct prompts cost."""
    distinct = [Req(rid, tuple(range(rid * 100, rid * 100 + 67))) for rid in range(8)]
    work, retired = [], []
    for reqs in (_burst(8), distinct):
        empty, start = _pools(page_size, META), idle(META)
        with device_reads(forbid=True) as log, count_device_work() as done:
            _, pools = extend(start, reqs, empty).unwrap()
        assert log.report().count == 0
        work.append((done.copies, done.kernels))
        retired.append(pools.num_retired)
    assert retired == [7 * (len(SYSTEM) // page_size), 0]
    assert work[0] == work[1]
    assert work[0][0] == 1  # one upload: the columns, the table's cells and the forward's


@settings(max_examples=40, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    shared=st.integers(0, 40),
    tails=st.lists(st.lists(st.integers(1, 3), max_size=20), min_size=1, max_size=8),
)
def test_after_a_prefill_each_whole_page_of_tokens_is_held_once(
    page_size: int, shared: int, tails: list[list[int]]
) -> None:
    """Free tokens equal capacity less one page per distinct whole-page prefix and partial page."""
    prompts = [(*SYSTEM[:shared], *tail) for tail in tails]
    prompts = [prompt for prompt in prompts if prompt]
    if not prompts:
        return
    reqs = [Req(rid, prompt) for rid, prompt in enumerate(prompts)]
    batch, pools = extend(idle(CPU), reqs, _pools(page_size)).unwrap()
    whole = {
        prompt[:end] for prompt in prompts for end in range(page_size, len(prompt) + 1, page_size)
    }
    partial = sum(1 for prompt in prompts if len(prompt) % page_size)
    assert pools.num_free_tokens == KV_TOKENS - (len(whole) + partial) * page_size
    assert pools.cache.num_pages == len(whole)
    check_pools(pools, [batch], compare_device=True)


def test_the_engine_holds_a_burst_prompt_once_and_stays_exact() -> None:
    """Bursts of 32 sharing a 256-token prompt, cold cache: KV held once, the oracle passes."""
    workload = WorkloadConfig(
        num_requests=64,
        arrival="burst",
        burst_size=32,
        prompt_len=(8, 32),
        output_len=(8, 24),
        shared_prefixes=1,
        shared_prefix_len=256,
        shared_fraction=1.0,
    )
    engine = EngineConfig(max_running=64, max_prefill_tokens=16384, overlap=True, check_every=4)
    run = simulate(SimulationConfig(workload=workload, engine=engine, num_kv_tokens=8192))
    assert run.oracle is not None and run.oracle.passed
    assert run.pools_conserved
    trace = run.trace
    # Most of the first burst is admitted in one extend: all but one row's copy of the
    # prompt (16 whole pages; the tails share no page) is freed at its end.
    assert trace.duplicate_tokens_freed % 256 == 0
    assert trace.duplicate_tokens_freed >= 16 * 256
    # What 32 copies of the prompt would hold: never reached.
    assert max(trace.kv_tokens_used) < 32 * 256 // 2
    summary = summarize(run)
    assert summary.duplicate_tokens_freed == trace.duplicate_tokens_freed
    assert f"{trace.duplicate_tokens_freed} duplicate tokens freed" in render_summary(summary)
