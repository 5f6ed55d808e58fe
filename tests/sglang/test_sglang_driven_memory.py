"""SGLang's memory objects as views of one `Pools` value (`batchstate.sglang.driven.memory`),
read by SGLang's own `PrefillAdder` beside the stock objects at every step of SGLang's real
scheduler loop. Skipped when SGLang is not installed."""

from __future__ import annotations

import copy
import random
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest

from tests.sglang.needs_sglang import SGLANG_MARKS, SGLANG_MISSING, SGLANG_PRESENT

if not SGLANG_PRESENT:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from batchstate import Pools
from batchstate.sglang import Shadow, cpu_topology
from batchstate.sglang.driven.memory import KVAllocatorView, RadixCacheView, ReqToTokenView
from batchstate.sglang.replica import ExtendItem, Replica
from batchstate.sglang.scheduler_loop import SchedulerLoop

pytestmark = SGLANG_MARKS


@pytest.fixture(params=[1, 16], ids=["page1", "page16"])
def page_size(request: pytest.FixtureRequest) -> Iterator[int]:
    with cpu_topology(
        chunked_prefill_size=128,
        page_size=request.param,
        max_running_requests=16,
        pp_max_micro_batch_size=16,
    ):
        yield request.param


def test_a_view_reads_the_newest_pools_and_holds_no_copy() -> None:
    replica = Replica(page_size=16, kv_tokens=256, rows=4, context=512)
    table, allocator, cache = (
        ReqToTokenView(replica),
        KVAllocatorView(replica),
        RadixCacheView(replica),
    )
    assert (table.size, allocator.size, table.available_size(), allocator.available_size()) == (
        4,
        256,
        4,
        256,
    )
    prompt = tuple(range(100, 140))  # two whole pages and 8 tokens
    replica.extend("b0", [ExtendItem("r0", prompt, extend_len=40, prefix_len=0)])
    # The same tensor the transitions write, not a copy of it.
    assert table.req_to_token is replica.pools.table.device
    assert tuple(table.req_to_token.shape) == (5, 512)
    assert (table.available_size(), allocator.available_size()) == (3, 256 - 48)
    assert (cache.protected_size(), cache.evictable_size(), cache.total_size()) == (32, 0, 32)
    replica.release("r0", tokens=prompt)
    assert (table.available_size(), allocator.available_size()) == (4, 256 - 32)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 32)


def test_a_view_of_something_without_pools_or_a_match_without_a_key_is_refused() -> None:
    from batchstate.errors import PoolsArgumentError
    from batchstate.sglang import UnsupportedSGLang

    for view in (ReqToTokenView, KVAllocatorView, RadixCacheView):
        with pytest.raises(PoolsArgumentError, match=f"{view.__name__}: the owner must hold"):
            view(object())  # type: ignore[arg-type]
    cache = RadixCacheView(Replica(page_size=16, kv_tokens=256, rows=4, context=512))
    with pytest.raises(UnsupportedSGLang, match="MatchPrefixParams has no attribute 'key'"):
        cache.match_prefix(object())


def _cached_kv(pools: Pools, path: npt.NDArray[np.int64]) -> None:
    # A cached prefix's locations: whole pages in order, each page cached, none free.
    size = pools.page_size
    assert (path % size == np.arange(len(path)) % size).all()
    cached = {page for page, _ in pools.cache.entries().values()}
    assert set((path // size).tolist()) <= cached
    assert not set((path // size).tolist()) & set(pools.free_pages.tolist())


def _loaded(page_size: int, seed: int, *, overlap: bool = False) -> SchedulerLoop:
    kv_tokens = 800 if page_size == 1 else 1024
    loop = SchedulerLoop(
        page_size=page_size, kv_tokens=kv_tokens, rows=16, seed=seed, overlap=overlap
    )
    rng = random.Random(seed)
    shared = [rng.randrange(100, 30000) for _ in range(48)]
    for _ in range(40):
        head = shared[: rng.randrange(0, 48)]
        tail = [rng.randrange(100, 30000) for _ in range(rng.randrange(4, 300))]
        loop.submit(head + tail, rng.randrange(30, 100))
    return loop


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_prefill_adder_over_the_views_sees_what_it_sees_over_sglangs_pools(
    page_size: int, overlap: bool
) -> None:
    from sglang.srt.managers.schedule_policy import PrefillAdder

    loop = _loaded(page_size, seed=3, overlap=overlap)
    s = loop.scheduler
    compared = steps = 0
    with Shadow() as shadow:  # its Replica holds the one Pools the views read
        while loop.busy and steps < 4000:
            loop.step()
            steps += 1
            replica = shadow.replica
            if replica is None or replica.unpublished:
                continue  # a prefill's pages are published at different moments (policy)
            table, allocator, cache = (
                ReqToTokenView(replica),
                KVAllocatorView(replica),
                RadixCacheView(replica),
            )
            stock = s.req_to_token_pool, s.token_to_kv_pool_allocator, s.tree_cache
            assert table.available_size() == stock[0].available_size()
            assert table.req_to_token.shape == stock[0].req_to_token.shape
            assert table.req_to_token.dtype == stock[0].req_to_token.dtype
            assert (allocator.size, allocator.page_size) == (stock[1].size, stock[1].page_size)
            assert cache.protected_size() == stock[2].protected_size()
            assert cache.total_size() == stock[2].total_size()
            assert allocator.available_size() == stock[1].available_size()
            assert cache.evictable_size() == stock[2].evictable_size()
            ours, theirs = (
                PrefillAdder(
                    page_size, c, a, s.running_batch, s.new_token_ratio_tracker.current, 4096, 128
                )
                for c, a in ((cache, allocator), (stock[2], stock[1]))
            )
            assert ours.rem_total_tokens == theirs.rem_total_tokens
            assert ours.cur_rem_tokens == theirs.cur_rem_tokens
            compared += 1
    assert shadow.divergences == [] and not loop.busy
    # 90 to 96% of the steps measured here; the rest await a checkpoint (overlap: more).
    assert compared >= steps * 0.85 and steps >= 400


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_every_match_the_real_scheduler_makes_finds_the_same_prefix_in_the_view(
    page_size: int, overlap: bool
) -> None:
    from sglang.srt.mem_cache.radix_cache import RadixCache

    loop = _loaded(page_size, seed=5, overlap=overlap)
    lengths: list[int] = []
    with Shadow() as shadow:
        stock = RadixCache.match_prefix

        def compared(tree: RadixCache, params: object) -> object:
            theirs = stock(tree, params)
            replica = shadow.replica
            # Admission's matches carry their request; the tree's own (inside an insert
            # at a release or checkpoint) do not, and run mid-call.
            admitting = getattr(params, "req", None) is not None
            if admitting and replica is not None and not replica.unpublished:
                ours = RadixCacheView(replica).match_prefix(params)
                assert ours.device_prefix_len == theirs.device_prefix_len  # type: ignore[attr-defined]
                path = (
                    RadixCacheView(replica)
                    .path_device_indices(
                        ours.last_device_node  # type: ignore[attr-defined]
                    )
                    .numpy()
                )
                assert len(path) == len(tree.path_device_indices(theirs.last_device_node))
                _cached_kv(replica.pools, path)
                lengths.append(theirs.device_prefix_len)
            return theirs

        RadixCache.match_prefix = compared
        try:
            while loop.busy:
                loop.step()
        finally:
            RadixCache.match_prefix = stock
    assert shadow.divergences == []
    # 62 to 77 matches per run, 37 to 74 of them hits: the shared system prompt.
    assert len(lengths) >= 50 and sum(n > 0 for n in lengths) >= 30


@attrs.define
class _Owner:
    pools: Pools

    def release(self, rid: str, tokens: Sequence[int]) -> None:
        raise AssertionError(f"counts only: nothing releases {rid}")

    def checkpoint(self, rid: str) -> None:
        raise AssertionError(f"counts only: nothing checkpoints {rid}")


def test_a_lock_in_the_view_protects_what_sglangs_lock_protects(page_size: int) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    loop = _loaded(page_size, seed=6)
    s, steps, locked = loop.scheduler, 0, 0
    with Shadow() as shadow:
        while loop.busy:
            loop.step()
            steps += 1
            replica = shadow.replica
            if steps % 5 or replica is None or replica.unpublished:
                continue
            # A branch of the shadow's pools: what a driven scheduler would hold, without
            # touching the shadow's own.
            view, tree = RadixCacheView(_Owner(copy.deepcopy(replica.pools))), s.tree_cache

            def sizes(view: RadixCacheView = view, tree: object = tree) -> None:
                stock: Any = tree
                assert view.protected_size() == stock.protected_size()
                assert view.evictable_size() == stock.evictable_size()

            sizes()
            held = []
            for req in list(s.waiting_queue)[:4]:  # what PrefillAdder would admit next
                tokens = [*req.origin_input_ids, *req.output_ids]
                params = MatchPrefixParams(key=RadixKey(array("q", tokens), limit=len(tokens) - 1))
                theirs, ours = tree.match_prefix(params), view.match_prefix(params)
                assert ours.device_prefix_len == theirs.device_prefix_len  # type: ignore[attr-defined]
                held.append((tree.lock(theirs.last_device_node), view.lock(ours.last_device_node)))  # type: ignore[attr-defined]
                locked += bool(theirs.device_prefix_len)
                sizes()
            for stock_lock, view_lock in reversed(held):
                tree.unlock(stock_lock)
                view.unlock(view_lock)
                sizes()
    assert shadow.divergences == [] and not loop.busy
    assert locked >= 20  # prefixes were locked, not only empty matches
