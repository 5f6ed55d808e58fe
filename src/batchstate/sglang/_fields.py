"""The SGLang attributes batchstate reads, checked up front with a clear error.

A batch from an SGLang release whose fields moved must fail with the attribute's
name and the releases this package was built against, never with an
`AttributeError` from deep inside a check.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from batchstate.errors import Error

SUPPORTED_VERSIONS: tuple[str, ...] = ("0.5.23",)
"""SGLang releases whose scheduler bookkeeping this package reads and was tested on."""

BATCH_FIELDS = (
    "reqs",
    "req_pool_indices",
    "req_pool_indices_cpu",
    "seq_lens",
    "seq_lens_cpu",
    "seq_lens_sum",
    "spec_info",
    "spec_algorithm",
    "forward_mode",
    "req_to_token_pool",
    "token_to_kv_pool_allocator",
    "tree_cache",
)
REQ_FIELDS = ("rid", "kv", "last_node", "finished")
KV_FIELDS = ("req_pool_idx", "cache_protected_len", "kv_allocated_len")
REQ_POOL_FIELDS = ("req_to_token", "free_slots", "size")
ALLOCATOR_FIELDS = ("size", "page_size", "free_pages", "available_size")
TREE_FIELDS = ("evictable_size", "protected_size", "root_node")
UNIFIED_TREE_FIELDS = ("tree_core", "full_evictable_size", "full_protected_size")
"""What `audit` and `Watch` read of a `UnifiedRadixCache` in place of its node tree."""
COMPONENT_FIELDS = {
    "SWA": ("swa_evictable_size", "swa_protected_size"),
    "MAMBA": ("mamba_evictable_size", "mamba_protected_size"),
}
"""Its counters per component beside FULL (whose pools are read: docs/sglang.md)."""
SHADOW_BATCH_FIELDS = ("chunked_req",)
SHADOW_REQ_FIELDS = (
    "full_untruncated_fill_ids",
    "extend_len",
    "prefix_len",
    "extend_end",
    "origin_input_ids",
    "output_ids",
    "inflight_middle_chunks",
)
"""What a `Shadow` reads besides what `audit` reads."""


class UnsupportedSGLang(Error, TypeError):
    """An SGLang object lacks an attribute batchstate reads: its version is not supported."""

    def __init__(self, owner: str, attribute: str) -> None:
        self.owner = owner
        self.attribute = attribute
        super().__init__(
            f"{owner} has no attribute {attribute!r}: batchstate.sglang reads SGLang "
            f"{', '.join(SUPPORTED_VERSIONS)} (installed: {installed_version()})"
        )


class UnsupportedCache(Error, TypeError):
    """The scheduler's tree cache is one this reader does not read: a `Shadow` replays
    `RadixCache`'s node tree, and SGLang's hybrid caches (`UnifiedRadixCache` with SWA
    or Mamba components) keep theirs in a tree core of their own; `Watch` reads those
    from their counters, and refuses a component it has no counters for."""

    def __init__(self, cache: object, components: object) -> None:
        self.cache = type(cache).__name__
        self.components = components
        super().__init__(
            f"tree cache {self.cache} (components {components}) is not read here: a "
            "Shadow replays RadixCache's node tree only, and Watch reads the FULL, SWA and "
            "MAMBA components of a unified cache (docs/sglang.md, Coverage)"
        )


class NotReplayed(Error, TypeError):
    """A batch on a path a `Shadow` does not replay (speculative decoding: SGLang reserves
    KV for the next verify windows across steps, batchstate allocates each window and
    frees the rejected slots, and no normalisation between the two is written)."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(
            f"a Shadow does not replay {path}; Watch checks it (docs/sglang.md, Coverage)"
        )


def installed_version() -> str:
    """The installed SGLang's version, or 'not installed'."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "not installed"


def require(obj: object, owner: str, names: tuple[str, ...]) -> None:
    """Raise `UnsupportedSGLang` naming the first of `names` that `obj` lacks."""
    for name in names:
        if not hasattr(obj, name):
            raise UnsupportedSGLang(owner, name)


def _require_radix_cache(tree: object) -> None:
    components = getattr(tree, "tree_components", None)
    if components is not None:  # a UnifiedRadixCache: its tree is not RadixCache's
        raise UnsupportedCache(tree, tuple(c.name for c in components))


def _require_tree(tree: object) -> None:
    """`RadixCache`'s fields, or a unified cache's counters for each of its components."""
    found = getattr(tree, "tree_components", None)
    if found is None:
        require(tree, "tree cache", TREE_FIELDS)
        return
    names = tuple(c.name for c in found)
    if any(n != "FULL" and n not in COMPONENT_FIELDS for n in names):
        raise UnsupportedCache(tree, names)
    # Not `root_node`: the default Rust tree core raises NotImplementedError for it.
    require(tree, "tree cache", TREE_FIELDS[:2] + UNIFIED_TREE_FIELDS)
    for name in names:
        require(tree, "tree cache", COMPONENT_FIELDS.get(name, ()))


def require_batch(batch: Any) -> None:
    """Check every attribute `audit` and `Watch` read on a batch and what it points to."""
    require(batch, "ScheduleBatch", BATCH_FIELDS)
    require(batch.req_to_token_pool, "ReqToTokenPool", REQ_POOL_FIELDS)
    require(batch.token_to_kv_pool_allocator, "KV allocator", ALLOCATOR_FIELDS)
    _require_tree(batch.tree_cache)
    for req in batch.reqs:
        require(req, "Req", REQ_FIELDS)
        require(req.kv, "Req.kv", KV_FIELDS)


def require_shadowed(batch: Any, reqs: Iterable[Any] | None = None) -> None:
    """`require_batch`, and what a `Shadow` reads besides; of the requests, only `reqs`
    when given (a shadow checks each request once, at the extend that brings it in:
    no other call adds a request to a batch)."""
    require(batch, "ScheduleBatch", BATCH_FIELDS)
    require(batch.req_to_token_pool, "ReqToTokenPool", REQ_POOL_FIELDS)
    require(batch.token_to_kv_pool_allocator, "KV allocator", ALLOCATOR_FIELDS)
    _require_radix_cache(batch.tree_cache)
    require(batch.tree_cache, "tree cache", TREE_FIELDS)
    if not batch.spec_algorithm.is_none():
        raise NotReplayed(f"speculative decoding ({batch.spec_algorithm.name})")
    require(batch, "ScheduleBatch", SHADOW_BATCH_FIELDS)
    for req in batch.reqs if reqs is None else reqs:
        require(req, "Req", REQ_FIELDS + SHADOW_REQ_FIELDS)
        require(req.kv, "Req.kv", KV_FIELDS)
