"""SGLang's hybrid sliding-window stack (`SWAKVPool`, `SWATokenToKVPoolAllocator`,
`UnifiedRadixCache` with FULL and SWA components) runs on CPU, and `Watch` and
`Shadow`, which read `RadixCache`'s node tree, refuse it by name. Skipped when SGLang
is not installed."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "SGLang 0.5.23 is not installed: docs/sglang.md#install gives the commands",
        allow_module_level=True,
    )

import torch

from batchstate.sglang import Shadow, UnsupportedCache, Watch, cpu_topology
from batchstate.sglang.drive import Driver

pytestmark = [
    pytest.mark.filterwarnings(
        "ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"
    ),
    pytest.mark.xdist_group("sglang"),
]


@pytest.fixture(scope="module")
def topology() -> Iterator[None]:
    with cpu_topology(page_size=1):
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


def test_sglangs_swa_stack_runs_on_cpu(topology: None) -> None:
    driver = _swa_driver()
    while driver.step() != "idle" or driver.waiting:
        pass
    assert driver.finished == 4
    assert driver.allocator.full_available_size() + driver.tree_cache.evictable_size() == 1024


@pytest.mark.parametrize("tool", [Watch, Shadow])
def test_watch_and_shadow_refuse_the_unified_cache_by_name(
    topology: None, tool: type[Watch] | type[Shadow]
) -> None:
    driver = _swa_driver()
    with tool(), pytest.raises(UnsupportedCache) as raised:
        driver.step()
    assert raised.value.cache == "UnifiedRadixCache"
    assert raised.value.components == ("FULL", "SWA")
