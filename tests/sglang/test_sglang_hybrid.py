"""SGLang's hybrid stacks run on CPU: sliding window (`SWAKVPool`,
`SWATokenToKVPoolAllocator`, `UnifiedRadixCache` with FULL and SWA components) and
Mamba (`HybridReqToTokenPool` with its `MambaPool`, `UnifiedRadixCache` with FULL and
MAMBA components). `Watch` checks both from the pools' and the cache's counters (zero
findings over a long run; a bug reintroduced into SGLang named at its call, with its
request); `Shadow`, which replays `RadixCache`'s node tree, refuses both by name.
Skipped when SGLang is not installed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pytest import MonkeyPatch

from tests.sglang.needs_sglang import SGLANG_MARKS, SGLANG_MISSING, SGLANG_PRESENT

if not SGLANG_PRESENT:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

import torch

from batchstate.sglang import (
    Divergence,
    Shadow,
    UnsupportedCache,
    Watch,
    audit,
    cpu_topology,
)
from batchstate.sglang.drive import Driver

pytestmark = SGLANG_MARKS


@pytest.fixture(scope="module")
def topology() -> Iterator[None]:
    with cpu_topology(page_size=1) as args:
        # The Mamba cache's chunk: SGLang reads it from the model's Hugging Face config
        # unless pre-seeded, as SGLang's own test fixtures seed it (FLA's chunk, 64).
        args._mamba_cache_chunk_size = 64  # type: ignore[attr-defined]
        yield


def _swa_driver() -> Driver:
    """The `Driver` over SGLang's SWA pools and unified radix cache (a 64-token window,
    1024 full and 512 window KV slots, one layer of each kind)."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    driver = Driver(page_size=1, kv_tokens=1024, rows=16, seed=1)
    kv = SWAKVPool(
        size=1024,
        size_swa=512,
        page_size=1,
        dtype=torch.float16,
        head_num=1,
        head_dim=4,
        swa_attention_layer_ids=[0],
        full_attention_layer_ids=[1],
        device="cpu",
    )
    pool = ReqToTokenPool(size=16, max_context_len=1024, device="cpu", enable_memory_saver=False)
    allocator = SWATokenToKVPoolAllocator(
        size=1024,
        size_swa=512,
        page_size=1,
        dtype=torch.float16,
        device="cpu",
        kvcache=kv,
        need_sort=False,
    )
    cache = UnifiedRadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=pool,
            token_to_kv_pool_allocator=allocator,
            page_size=1,
            sliding_window_size=64,
            tree_components=(ComponentType.FULL, ComponentType.SWA),
        )
    )
    driver.req_to_token_pool, driver.allocator, driver.tree_cache = pool, allocator, cache
    driver.running = driver._batch([])
    for n in range(4):
        driver.submit(list(range(100 + n, 180 + n)), 8)
    return driver


def _mamba_driver() -> Driver:
    """The `Driver` over SGLang's `HybridReqToTokenPool` (32 Mamba state slots, one Mamba2
    layer), its token KV allocator and the unified radix cache with a MAMBA component."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    driver = Driver(page_size=1, kv_tokens=1024, rows=16, seed=1)
    shape = Mamba2StateShape.create(
        tp_world_size=1,
        intermediate_size=8,
        n_groups=1,
        num_heads=2,
        head_dim=4,
        state_size=4,
        conv_kernel=4,
    )
    pool = HybridReqToTokenPool(
        size=16,
        mamba_size=32,
        mamba_spec_state_size=0,
        max_context_len=1024,
        device="cpu",
        enable_memory_saver=False,
        cache_params=Mamba2CacheParams(shape=shape, layers=[0]),
        mamba_layer_ids=[0],
        enable_mamba_extra_buffer=False,
        enable_overlap_schedule=False,
    )
    cache = UnifiedRadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=pool,
            token_to_kv_pool_allocator=driver.allocator,
            page_size=1,
            tree_components=(ComponentType.FULL, ComponentType.MAMBA),
        )
    )
    driver.req_to_token_pool, driver.tree_cache = pool, cache
    driver.running = driver._batch([])
    for n in range(4):
        driver.submit(list(range(100 + n, 180 + n)), 8)
    return driver


STACKS = {"swa": (_swa_driver, ("FULL", "SWA")), "mamba": (_mamba_driver, ("FULL", "MAMBA"))}


@pytest.mark.parametrize("stack", STACKS)
def test_sglangs_hybrid_stacks_run_on_cpu(topology: None, stack: str) -> None:
    driver = STACKS[stack][0]()
    while driver.step() != "idle" or driver.waiting:
        pass
    assert driver.finished == 4
    free = int(driver.allocator.available_size())
    if stack == "swa":
        free = int(driver.allocator.full_available_size())
    assert free + int(driver.tree_cache.evictable_size()) == 1024  # full KV: all back


def _busy(driver: Driver) -> Driver:
    """`driver` with 10 more requests, most longer than the window: they decode past it,
    share prompt prefixes, and outgrow the KV pools (SGLang retracts some under SWA)."""
    for n in range(8):
        driver.submit(list(range(100 + n % 3, 150 + n)), 90 + 7 * n)
    for _ in range(2):  # one prompt twice: the second finds its state in the tree
        driver.submit(list(range(300, 340)), 30)
    return driver


def _run(driver: Driver) -> int:
    """Step `driver` until every request is done; the steps taken."""
    steps = 0
    while driver.step() != "idle" or driver.waiting:
        steps += 1
        assert steps < 1000
    return steps


CORES = {"rust": "RustUnifiedTreeCore", "python": "UnifiedTreeCore"}


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("stack", STACKS)
def test_watch_checks_the_hybrid_stacks_with_zero_findings(
    topology: None, monkeypatch: MonkeyPatch, stack: str, core: str
) -> None:
    # SGLang's two tree cores (Rust, its default; Python): neither's tree is walked.
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", core)
    driver = _busy(STACKS[stack][0]())
    assert type(driver.tree_cache.tree_core).__name__ == CORES[core]
    with Watch(on_divergence="log") as watch:
        steps = _run(driver)
    assert watch.divergences == []
    assert driver.finished == 14
    assert steps > 100 and len(watch.trace) > 2 * steps  # every call checked
    if stack == "swa":
        assert driver.retracted > 0  # retract_decode and its releases ran under the watch
    live = watch.holdings.held
    assert live == {}  # every request released, every holding forgotten


@pytest.mark.parametrize("stack", STACKS)
def test_watch_counts_what_an_open_free_group_holds_back(topology: None, stack: str) -> None:
    # SGLang's result processing releases inside free_group_begin / free_group_end: the
    # freed full and window slots show in the allocators only at the group's end.
    driver = _busy(STACKS[stack][0]())
    driver.free_group = True
    with Watch(on_divergence="log") as watch:
        _run(driver)
    assert watch.divergences == []
    assert driver.finished == 14


@pytest.mark.parametrize("stack", STACKS)
def test_shadow_refuses_the_unified_cache_by_name(topology: None, stack: str) -> None:
    make, components = STACKS[stack]
    driver = make()
    with Shadow(), pytest.raises(UnsupportedCache) as raised:
        driver.step()
    assert raised.value.cache == "UnifiedRadixCache"
    assert raised.value.components == components


def _window_leak(monkeypatch: MonkeyPatch) -> None:
    """A release that keeps the window slots of the row's own KV: the mapping is cleared
    but the window sub-allocator never gets them back."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    original = UnifiedRadixCache.free_kv_row

    def leaky(self: Any, kv: Any, ranges: list[tuple[int, int]]) -> None:
        window = self.token_to_kv_pool_allocator.swa_attn_allocator
        with MonkeyPatch.context() as inner:
            inner.setattr(window, "free_page_ids", lambda ids: None)
            inner.setattr(window, "free", lambda index: None)
            original(self, kv, ranges)

    monkeypatch.setattr(UnifiedRadixCache, "free_kv_row", leaky)


def _full_freed_twice(monkeypatch: MonkeyPatch) -> None:
    """A release that gives the full KV slot of the row's last token back twice."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    original = UnifiedRadixCache.free_kv_row

    def twice(self: Any, kv: Any, ranges: list[tuple[int, int]]) -> None:
        last = self.req_to_token_pool.req_to_token[kv.req_pool_idx, kv.kv_allocated_len - 1]
        original(self, kv, ranges)
        self.token_to_kv_pool_allocator.full_attn_allocator.free(last.reshape(1).long())

    monkeypatch.setattr(UnifiedRadixCache, "free_kv_row", twice)


def _mamba_fork_kept(monkeypatch: MonkeyPatch) -> None:
    """A checkpoint that keeps the Mamba state it forked for the tree when the tree
    already holds that state, instead of freeing the fork's slot."""
    from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

    monkeypatch.setattr(MambaComponent, "_free_mamba_value", lambda self, value: None)


BUGS = {
    "window slots leaked at release": (
        "swa",
        _window_leak,
        "release_kv_cache",
        "window conservation",
    ),
    "full KV slot freed twice": ("swa", _full_freed_twice, "release_kv_cache", "conservation"),
    "mamba fork not freed": (
        "mamba",
        _mamba_fork_kept,
        "checkpoint_kv_cache",
        "mamba slot returned",
    ),
}


@pytest.mark.parametrize("bug", BUGS)
def test_watch_names_a_bug_reintroduced_into_sglang_at_its_call(
    topology: None, monkeypatch: MonkeyPatch, bug: str
) -> None:
    stack, reintroduce, operation, check = BUGS[bug]
    driver = _busy(STACKS[stack][0]())
    reintroduce(monkeypatch)
    with Watch() as watch, pytest.raises(Divergence) as raised:
        _run(driver)
    found = raised.value
    assert found.operation == operation
    assert found.violation.check == check
    # The request that call released or checkpointed: the one the trace's last step names.
    assert found.violation.request == watch.trace[-1].rids[0]
    assert found.violation.request.startswith("r")


@pytest.mark.parametrize("stack", STACKS)
def test_audit_names_a_live_requests_slot_on_a_free_list(topology: None, stack: str) -> None:
    driver = _busy(STACKS[stack][0]())
    for _ in range(5):
        driver.step()
    batch = driver.running
    assert audit(batch).ok
    victim = batch.reqs[1]
    if stack == "swa":  # one window slot of its own KV handed back behind SGLang's back
        allocator = driver.allocator
        location = batch.req_to_token_pool.req_to_token[
            victim.kv.req_pool_idx, victim.kv.kv_allocated_len - 1
        ]
        peer = allocator.full_to_swa_index_mapping[location.long()].reshape(1)
        allocator.swa_attn_allocator.free(peer)
        check = "window slot freed while held"
    else:  # its Mamba state slot
        driver.req_to_token_pool.mamba_allocator.free(victim.kv.mamba_pool_idx.reshape(1))
        check = "mamba slot freed while held"
    (found,) = audit(batch).violations
    assert (found.check, found.request) == (check, victim.rid)
