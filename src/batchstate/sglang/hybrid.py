"""SGLang's hybrid stacks read without their radix tree: `UnifiedRadixCache` with SWA or
Mamba components, over `SWATokenToKVPoolAllocator` or `HybridReqToTokenPool`.

A unified cache keeps its tree in a tree core of its own (the default Rust core does
not expose its nodes, the Python core gives a request's `last_node` as an integer id),
so nothing here walks it: every balance is read from the allocators' and the cache's own
per-component counters (`full_*`, `swa_*`, `mamba_*` evictable and protected sizes),
and from what each request holds (its row's KV, the sliding-window peers of that KV,
its Mamba state slot). Reads the device (the full-to-window mapping, the free lists).
"""

from __future__ import annotations

from typing import Any

import torch

from batchstate.sglang._free_group import free_tokens


def components(tree: Any) -> tuple[str, ...]:
    """The components of a `UnifiedRadixCache` (`("FULL", "SWA")`, ...); () for any
    other cache, whose node tree batchstate walks."""
    found = getattr(tree, "tree_components", None)
    return () if found is None else tuple(c.name for c in found)


def full_allocator(allocator: Any) -> Any:
    """The allocator of full-attention KV: the SWA allocator's full sub-allocator, or the
    allocator itself. Its `size`, `free_pages` and free group are the full KV's."""
    return getattr(allocator, "full_attn_allocator", allocator)


def is_swa(allocator: Any) -> bool:
    """Whether `allocator` pairs each full KV slot with a sliding-window slot."""
    return hasattr(allocator, "full_to_swa_index_mapping")


def swa_tokens(req: Any, table: torch.Tensor, allocator: Any) -> int:
    """The sliding-window KV slots `req`'s row owns outside the tree: the window peers of
    its own full KV (from its cached prefix to its allocated length) that the mapping
    still pairs; tokens that slid out of the window have given theirs back."""
    row = req.kv.req_pool_idx
    start, end = int(req.kv.cache_protected_len), int(req.kv.kv_allocated_len)
    if row is None or end <= start:
        return 0
    locations = table[int(row), start:end].long()
    return int((allocator.full_to_swa_index_mapping[locations] != 0).sum())


def swa_free_tokens(allocator: Any) -> int:
    """The window allocator's free slots, counting those an open free group holds back
    (SGLang frees the window peers at the group's end)."""
    page = int(allocator.page_size)
    pending = sum(int(ids.numel()) for ids in allocator.swa_page_ids_group) * page
    # Page-expanded frees carry padding entries (0), which `_release_swa` drops.
    pending += sum(int((t > 0).sum()) for t in allocator.swa_free_group)
    return int(allocator.swa_available_size()) + pending


def mamba_slot(req: Any) -> int | None:
    """`req`'s Mamba state slot, or None."""
    slot = getattr(req.kv, "mamba_pool_idx", None)
    return None if slot is None else int(slot)


def mamba_free(pool: Any) -> int:
    """Free Mamba state slots of a `HybridReqToTokenPool`."""
    return int(pool.mamba_allocator.available_size())


def full_counts(tree: Any) -> tuple[int, int, int, int]:
    """Full KV: free (an open free group counted), evictable, protected, and the size."""
    allocator = full_allocator(tree.token_to_kv_pool_allocator)
    return (
        free_tokens(allocator),
        int(tree.full_evictable_size()),
        int(tree.full_protected_size()),
        int(allocator.size),
    )


def swa_counts(tree: Any) -> tuple[int, int, int, int]:
    """Sliding-window KV: free (an open free group counted), evictable, protected, size."""
    allocator = tree.token_to_kv_pool_allocator
    return (
        swa_free_tokens(allocator),
        int(tree.swa_evictable_size()),
        int(tree.swa_protected_size()),
        int(allocator.size_swa),
    )


def mamba_counts(tree: Any) -> tuple[int, int, int, int]:
    """Mamba state slots: free, evictable, protected (slots the tree's nodes hold), size."""
    pool = tree.req_to_token_pool
    return (
        mamba_free(pool),
        int(tree.mamba_evictable_size()),
        int(tree.mamba_protected_size()),
        int(pool.mamba_allocator.size),
    )


def _host_set(values: torch.Tensor) -> set[int]:
    return {int(v) for v in values.detach().to("cpu").reshape(-1).tolist()}


def swa_free_slots(allocator: Any) -> set[int]:
    """The window slots the window sub-allocator would hand out."""
    sub = allocator.swa_attn_allocator
    page = int(sub.page_size)
    pieces = [sub.free_pages, *getattr(sub, "staged_pages", [])]
    if getattr(sub, "release_pages", None) is not None:
        pieces.append(sub.release_pages)
    pages = set().union(*map(_host_set, pieces))
    return {p * page + i for p in pages for i in range(page)}


def window_peers(req: Any, table: torch.Tensor, allocator: Any) -> set[int]:
    """The window slots paired with `req`'s own full KV (from its cached prefix on)."""
    row = req.kv.req_pool_idx
    if row is None:
        return set()
    start, end = int(req.kv.cache_protected_len), int(req.kv.kv_allocated_len)
    peers = allocator.full_to_swa_index_mapping[table[int(row), start:end].long()]
    return _host_set(peers[peers != 0])


def mamba_free_slots(pool: Any) -> set[int]:
    """The Mamba state slots on the Mamba allocator's free list."""
    return _host_set(pool.mamba_allocator.free_slots)
