"""One `Pools`, the prefix cache on or off: publishing, chunk pages, flush, and hostile inputs.

Pages of 4 tokens throughout. With the cache on a prefill (or a chunk of
one) publishes its whole prompt pages when it ends, so a request with the
same prefix hits them while the first still runs, and a row whose pages
the cache holds already reads the cache's instead; a partly filled last
page stays private. Every refused call leaves the pools given exactly as
they were: free lists, cached pages, prefixes and the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import numpy as np
import pytest
import torch
from returns.result import Failure

from batchstate import (
    Chunked,
    Filtered,
    NotHeld,
    NotOwned,
    OutOfKVTokens,
    Pools,
    Req,
    Sampled,
    StillRunning,
    admit_prefilled,
    check_pools,
    decode,
    decode_sampled,
    extend,
    filter_batch,
    finish_mixed,
    flush,
    idle,
    mix,
    release,
    split,
    sync,
    verify,
)
from tests.builders import CPU, make_test_pools
from tests.strategies import assert_unchanged, snapshot

PAGE: Final = 4
HEAD: Final = tuple(range(10, 22))  # three pages
PROMPT: Final = tuple(range(10, 24))  # 14 tokens: three whole pages and two tokens


def _shared(num_kv_tokens: int = 64) -> Pools:
    """16 slots, 16 pages of 4 (by default), the prefix cache on."""
    return make_test_pools(PAGE, num_kv_tokens=num_kv_tokens, prefix_cache=True)


def _state(pools: Pools) -> tuple[object, ...]:
    """What a refused call must leave: free lists, owned counts, cache, prefixes, table."""
    return (
        pools.free_slots.tolist(),
        pools.free_pages.tolist(),
        pools.slot_tokens.tolist(),
        pools.cache.entries(),
        pools.cache.num_evicted,
        dict(pools.prefixes),
        pools.table.host.tolist(),
    )


class _Unchanged:
    """`with _Unchanged(pools):` the block leaves `pools` as it found them, on every side."""

    def __init__(self, pools: Pools) -> None:
        self.pools, self.state, self.deep = pools, _state(pools), snapshot(pools)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        assert _state(self.pools) == self.state
        assert_unchanged(self.deep, self.pools, "pools")
        assert np.array_equal(self.pools.table.host, self.pools.table.device.numpy())


def _pages(pools: Pools, slot: int, end: int) -> list[int]:
    """The pages holding a slot's first `end` tokens."""
    return [int(cell) // PAGE for cell in pools.table.host[slot, :end:PAGE]]


def _chunk(pools: Pools, req: Req, budget: int) -> tuple[Chunked, Filtered, Pools]:
    """`req`'s first chunk, computed alone; fails the test unless it stops part way."""
    mixed, pools = mix(idle(CPU), [req], budget, pools).unwrap()
    settled = finish_mixed(mixed)
    (held,) = settled.held
    check_pools(pools, [settled.running], compare_device=True)
    return held, settled.running, pools


# ---- publishing ---------------------------------------------------------------------------


def test_a_second_request_hits_the_first_ones_prompt_while_it_still_decodes() -> None:
    first, pools = extend(idle(CPU), [Req(1, (*HEAD, 1, 2))], _shared()).unwrap()
    slot = int(first.rows.req_pool_indices.host[0])
    assert dict(pools.prefixes) == {slot: HEAD}  # its three whole pages, published
    assert (pools.cache.num_pages, pools.cache.num_locked) == (3, 3)
    check_pools(pools, [first], compare_device=True)
    decoding, pools = decode(first, pools).unwrap()
    running = filter_batch(decoding, [0])
    second, pools = extend(idle(CPU), [Req(2, (*HEAD, 7))], pools).unwrap()
    assert (second.prefix_lens.tolist(), second.extend_lens.tolist()) == ([12], [1])
    other = int(second.rows.req_pool_indices.host[0])
    assert _pages(pools, other, 12) == _pages(pools, slot, 12)
    assert {locks for _, locks in pools.cache.entries().values()} == {2}
    assert pools.ref_counts()[_pages(pools, slot, 12)].tolist() == [3, 3, 3]
    check_pools(pools, [running, second], compare_device=True)


def test_rows_of_one_extend_each_compute_the_prefix_and_the_second_reads_the_first_copy() -> None:
    pools = _shared()
    batch, pools = extend(idle(CPU), [Req(1, (*HEAD, 1)), Req(2, (*HEAD, 2))], pools).unwrap()
    assert batch.prefix_lens.tolist() == [0, 0]  # both compute HEAD in this forward
    slots = batch.rows.req_pool_indices.host.tolist()
    # At the prefill's end the second reads the first's pages: its lock and its
    # table cells moved there, and its own three pages are retired.
    assert dict(pools.prefixes) == {slots[0]: HEAD, slots[1]: HEAD}
    assert _pages(pools, slots[1], 12) == _pages(pools, slots[0], 12)
    assert pools.retired.shape[0] == 3 and pools.num_retired == 3
    # Held once: 3 shared pages and each row's partly filled last page.
    assert pools.num_free_tokens == pools.num_pages * PAGE - 5 * PAGE
    check_pools(pools, [batch], compare_device=True)
    kept, gone = split(batch, [0])
    after = release(gone, kept, pools).unwrap()
    # Only its partly filled page goes back; the shared pages stay, read by the first.
    assert after.num_free_tokens == pools.num_free_tokens + PAGE
    assert after.cache.entries() == {
        prefix: (page, 1) for prefix, (page, _) in pools.cache.entries().items()
    }
    check_pools(after, [kept])


def test_prebuilt_reads_nothing_from_the_cache_but_publishes() -> None:
    first, pools = extend(idle(CPU), [Req(1, (*HEAD, 1))], _shared()).unwrap()
    pools = release(first, idle(CPU), pools).unwrap()
    arrived, after = admit_prefilled(
        idle(CPU), [Req(2, (*HEAD, 2)), Req(3, (*PROMPT, 5, 6))], pools
    ).unwrap()
    slots = arrived.rows.req_pool_indices.host.tolist()
    # Request 2's pages hold what the cache holds already: private (no forward
    # computes them: a KV transfer fills its own pages through the table after
    # this, so its cells stay on them). Request 3's first three pages too; its
    # fourth (tokens 12..15) is new, yet it follows pages of its own that are not
    # cached, so it stays private as well.
    assert all(int(after.prefix_lens[slot]) == 0 for slot in slots)
    assert after.cache.entries() == pools.cache.entries()
    check_pools(after, [arrived], compare_device=True)
    _, fresh = admit_prefilled(idle(CPU), [Req(4, tuple(range(50, 59)))], after).unwrap()
    assert fresh.cache.num_pages == after.cache.num_pages + 2  # a new prompt is published


def test_mix_caches_a_chunks_whole_pages_moves_the_lock_and_another_request_hits() -> None:
    a = Req(1, PROMPT)
    chunk, running, pools = _chunk(_shared(), a, 6)
    slot = chunk.slot
    first, partial = _pages(pools, slot, 6)
    # The first page is cached and read; the second, holding 2 of its 4 tokens, is private.
    assert pools.cache.entries() == {PROMPT[:4]: (first, 1)}
    assert dict(pools.prefixes) == {slot: PROMPT[:4]}
    assert int(pools.ref_counts()[partial]) == 1
    mixed, pools = mix(running, [chunk], 6, pools, []).unwrap()
    settled = finish_mixed(mixed)
    (chunk,) = settled.held
    assert chunk.cached == 12
    pages = _pages(pools, slot, 12)
    assert pages[:2] == [first, partial]  # the page it filled is the one it had
    # The lock moved onto the three pages: each is read once, not once per chunk.
    assert pools.cache.entries() == {
        PROMPT[:end]: (page, 1) for end, page in zip((4, 8, 12), pages, strict=True)
    }
    assert dict(pools.prefixes) == {slot: PROMPT[:12]} and pools.cache.num_locked == 3
    check_pools(pools, [settled.running], compare_device=True)
    reader, pools = extend(idle(CPU), [Req(2, (*PROMPT[:12], 99, 98))], pools).unwrap()
    assert reader.prefix_lens.tolist() == [12]
    assert {locks for _, locks in pools.cache.entries().values()} == {2}
    check_pools(pools, [settled.running, reader], compare_device=True)
    # A held chunk's pages are in use: none is evictable, so only free pages count.
    assert pools.cache.num_evictable == 0
    free = len(pools.free_pages)
    with _Unchanged(pools):
        result = extend(idle(CPU), [Req(3, (5,) * 4 * (free + 1))], pools)
    assert result == Failure(OutOfKVTokens(free + 1, free, PAGE))


def test_a_chunk_given_up_leaves_its_whole_pages_cached_for_the_next_request() -> None:
    chunk, running, pools = _chunk(_shared(), Req(1, PROMPT), 6)
    first, partial = _pages(pools, chunk.slot, 6)
    after = release(chunk, running, pools).unwrap()
    assert after.cache.entries() == {PROMPT[:4]: (first, 0)}  # cached, no longer read
    assert partial in after.free_pages.tolist() and chunk.slot in after.free_slots.tolist()
    assert dict(after.prefixes) == {}
    check_pools(after, [running])
    again, after = extend(idle(CPU), [Req(1, PROMPT)], after).unwrap()
    assert again.prefix_lens.tolist() == [4]
    check_pools(after, [again], compare_device=True)


@pytest.mark.parametrize("with_drafts", [False, True], ids=["prompt", "prompt+drafts"])
def test_a_verify_window_released_goes_into_the_cache_and_twice_is_not_owned(
    with_drafts: bool,
) -> None:
    """9 prompt tokens, one decoded, three drafts: the slot holds 13 tokens in 4 pages."""
    prompt = tuple(range(30, 39))
    first, pools = extend(idle(CPU), [Req(1, prompt)], _shared()).unwrap()
    decoding, pools = decode(first, pools).unwrap()
    window, pools = verify(decoding, [3], pools).unwrap()
    slot = int(window.req_pool_indices.host[0])
    assert int(pools.slot_tokens[slot]) == 13
    pages = _pages(pools, slot, 13)
    tokens = [(*prompt, 5, 6, 7, 8)] if with_drafts else None
    after = release(window, idle(CPU), pools, tokens).unwrap()
    cached = 3 if with_drafts else 2  # whole pages of the tokens given, at most what it holds
    assert after.cache.entries() == {
        (*prompt, 5, 6, 7, 8)[: PAGE * (k + 1)]: (pages[k], 0) for k in range(cached)
    }
    assert sorted(after.free_pages.tolist()) == sorted(set(range(1, 17)) - set(pages[:cached]))
    assert dict(after.prefixes) == {} and int(after.slot_tokens[slot]) == 0
    check_pools(after)
    with _Unchanged(after):
        assert release(window, idle(CPU), after) == Failure(NotOwned((slot,)))


@pytest.mark.parametrize("generated", [False, True], ids=["prompt", "prompt+outputs"])
def test_a_retracted_requests_prefix_stays_cached_and_readmitting_it_hits(generated: bool) -> None:
    prompt = tuple(range(40, 50))  # 10 tokens
    first, pools = extend(idle(CPU), [Req(1, prompt)], _shared()).unwrap()
    decoding, pools = decode(first, pools).unwrap()
    decoding, pools = decode(filter_batch(decoding, [0]), pools).unwrap()  # 12 tokens
    outputs = (1, 2) if generated else ()
    retracted = release(decoding, idle(CPU), pools, [(*prompt, *outputs)]).unwrap()
    assert retracted.num_free_slots == pools.num_free_slots + 1
    assert retracted.cache.num_tokens == (12 if generated else 8)
    assert retracted.cache.num_locked == 0
    check_pools(retracted)
    again, after = extend(idle(CPU), [Req(1, (*prompt, *outputs))], retracted).unwrap()
    # It reads every whole page but the one holding its last token.
    assert again.prefix_lens.tolist() == [8] and again.extend_lens.tolist() == [
        4 if generated else 2
    ]
    check_pools(after, [again], compare_device=True)


def test_flush_evicts_every_evictable_page_and_keeps_pages_live_rows_read() -> None:
    pools = _shared()
    gone, pools = extend(
        idle(CPU), [Req(1, (*HEAD, 1)), Req(2, tuple(range(60, 69)))], pools
    ).unwrap()
    pools = release(gone, idle(CPU), pools).unwrap()
    live, pools = extend(idle(CPU), [Req(3, (*HEAD, 2))], pools).unwrap()
    slot = int(live.rows.req_pool_indices.host[0])
    assert (pools.cache.num_pages, pools.cache.num_locked) == (5, 3)
    before = _state(pools)
    flushed = flush(pools)
    assert _state(pools) == before  # a value: the pools given stay as they were
    assert (flushed.cache.num_pages, flushed.cache.num_locked) == (3, 3)
    assert flushed.cache.num_evicted == pools.cache.num_evicted + 2
    assert set(flushed.cache.entries()) == {HEAD[:4], HEAD[:8], HEAD}
    assert dict(flushed.prefixes) == {slot: HEAD}
    assert flushed.num_free_tokens == flushed.num_available_tokens == (16 - 3 - 1) * PAGE
    check_pools(flushed, [live], compare_device=True)
    assert flush(flushed) is flushed  # nothing evictable left
    off = make_test_pools(PAGE)
    assert flush(off) is off
    # At shutdown, once every row is released and flushed, every page is free.
    empty = flush(release(live, idle(CPU), flushed).unwrap())
    assert empty.num_free_tokens == 16 * PAGE and empty.cache.num_pages == 0
    check_pools(empty)


# ---- hostile inputs -----------------------------------------------------------------------


def test_a_chunk_continued_twice_is_not_held_and_changes_nothing() -> None:
    chunk, running, pools = _chunk(_shared(), Req(1, PROMPT), 6)
    mixed, pools = mix(running, [chunk], 4, pools, []).unwrap()
    running = finish_mixed(mixed).running
    refused = Failure(NotHeld(1, chunk.slot, 6, 10))
    with _Unchanged(pools):
        assert mix(running, [chunk], 4, pools, []) == refused
        assert extend(idle(CPU), [chunk], pools) == refused


def test_a_chunk_released_after_its_prefill_finished_is_refused_and_changes_nothing() -> None:
    chunk, running, pools = _chunk(_shared(), Req(1, PROMPT), 6)
    mixed, pools = mix(running, [chunk], 8, pools, []).unwrap()
    settled = finish_mixed(mixed)
    assert not settled.held and settled.running.rows.seq_lens.host.tolist() == [14]
    with _Unchanged(pools):
        assert release(chunk, idle(CPU), pools) == Failure(NotOwned((chunk.slot,)))
        assert release(chunk, settled.running, pools) == Failure(StillRunning((chunk.slot,)))
    done = release(settled.running, idle(CPU), pools).unwrap()
    with _Unchanged(done):
        assert release(chunk, idle(CPU), done) == Failure(NotOwned((chunk.slot,)))


def test_transitions_given_something_other_than_pools_name_what_they_got() -> None:
    step = extend(idle(CPU), [Req(1, (*HEAD, 1))], _shared()).unwrap()
    batch, pools = step
    decoding, pools = decode(batch, pools).unwrap()
    chunk, running, pools = _chunk(pools, Req(2, tuple(range(70, 84))), 6)
    filtered = filter_batch(decoding, [0])
    sampled = Sampled.of(filtered.rows, torch.tensor([5]))
    wrong: Any = step  # the whole step where its pools belong
    calls: dict[str, Callable[[], object]] = {
        "extend": lambda: extend(idle(CPU), [Req(3, (1,))], wrong),
        "admit_prefilled": lambda: admit_prefilled(idle(CPU), [Req(3, (1,))], wrong),
        "decode": lambda: decode(filtered, wrong),
        "decode_sampled": lambda: decode_sampled(filtered, sampled, wrong),
        "mix": lambda: mix(running, [chunk], 4, wrong, []),
        "release": lambda: release(chunk, running, wrong),
        "verify": lambda: verify(decoding, [1], wrong),
        "flush": lambda: flush(wrong),
    }
    for name, call in calls.items():
        with (
            _Unchanged(pools),
            pytest.raises(TypeError, match=r"^expected Pools, got BatchAndPools$"),
        ):
            call()
            pytest.fail(f"{name} took a BatchAndPools for its pools")
    window, pools = verify(decoding, [1], pools).unwrap()
    with _Unchanged(pools), pytest.raises(TypeError, match=r"^expected Pools, got BatchAndPools$"):
        sync(window, np.array([0]), wrong)


def test_release_with_tokens_that_do_not_start_with_the_prompt_changes_nothing() -> None:
    batch, pools = extend(idle(CPU), [Req(1, PROMPT)], _shared()).unwrap()
    chunk, running, pools = _chunk(pools, Req(2, tuple(range(70, 84))), 6)
    with _Unchanged(pools):
        with pytest.raises(
            ValueError, match=r"^request 1: its tokens do not start with its input_ids$"
        ):
            release(batch, running, pools, [(0, *PROMPT)])
        with pytest.raises(ValueError, match=r"^request 2: its tokens do not start"):
            release(chunk, running, pools, [PROMPT])
        with pytest.raises(ValueError, match=r"^tokens for 2 rows, 1 rows left$"):
            release(batch, running, pools, [PROMPT, PROMPT])


def test_with_the_cache_off_nothing_is_cached_read_or_published() -> None:
    off = make_test_pools(PAGE, num_kv_tokens=64)
    first, pools = extend(idle(CPU), [Req(1, (*HEAD, 1))], off).unwrap()
    pools = release(first, idle(CPU), pools).unwrap()
    again, pools = extend(idle(CPU), [Req(2, (*HEAD, 2))], pools).unwrap()
    assert again.prefix_lens.tolist() == [0]
    assert not pools.cache.enabled and pools.cache.num_pages == 0 and dict(pools.prefixes) == {}
    assert pools.prefix_lens.tolist() == [0] * 17
    assert pools.num_available_tokens == pools.num_free_tokens == (16 - 4) * PAGE
    assert int(pools.ref_counts().max()) == 1
    check_pools(pools, [again], compare_device=True)
