"""SGLang's memory objects as views of one batchstate `Pools` value.

Drive mode keeps one `Pools` (request slots, KV pages, prefix cache, the
request-to-token table) and hands SGLang's scheduler these three objects where it
held its `ReqToTokenPool`, KV allocator and `RadixCache`. Each view holds only the
owner of that `Pools` and reads the owner's newest value at every call, so there
is no second copy of a count or a table to drift: the request-to-token table SGLang
reads is the table's own device tensor, and free, evictable and protected tokens
are the pools' host counters (no device read).

What SGLang's admission reads goes through these: `PrefillAdder` builds SGLang's
own `PrefillBudget` over the allocator view (`create_prefill_budget`), which reads
`available_size()` and the cache view's `evictable_size()`; the scheduler's pool
metrics read the same two and `protected_size()`. The cache view also matches a
request's prefix (`match_prefix`, reading only) and locks and unlocks it in the one
`Pools` (`lock`, `unlock`), as admission does.

SGLang's own `release_kv_cache` and `checkpoint_kv_cache` run unmodified over the
views: the cache view's `checkpoint` tells the owner SGLang published what a request
computed (batchstate published it at the extend), its `on_release` is the one place
a request's memory goes back (the owner's `release`: one batchstate transition),
and `free_kv_row` and the table view's `free` give back nothing of their own. The
allocator view evicts as SGLang's does, ahead of an allocation and after a
retraction, least recently used first (`evict_to_free_tokens`), and the cache view's
match touches what it matched, as SGLang's match does: so the same prefixes stay
cached as in stock SGLang.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any, Protocol, final

import numpy as np
import torch

from batchstate import Pools
from batchstate.errors import PoolsArgumentError
from batchstate.pools.eviction import evict_least_recent
from batchstate.sglang._fields import require

__all__ = [
    "SGLANG_ALLOCATOR_POLICY",
    "SGLANG_CACHE_HOOKS",
    "HoldsPools",
    "KVAllocatorView",
    "RadixCacheView",
    "ReqToTokenView",
]

SGLANG_ALLOCATOR_POLICY = frozenset(
    {
        "max_new_tokens_for_memory",
        "prealloc_fits_assumes_reclaim",
        "prealloc_ceiling_fits",
        "prealloc_fits",
    }
)
"""Methods of SGLang's `BaseTokenToKVPoolAllocator` the allocator view runs as SGLang's
own: each computes from `page_size` and the counts the view reads from the pools."""

SGLANG_CACHE_HOOKS = frozenset(
    {
        "available_and_evictable_str",
        "discard_storage_prefetch_accounting",
        "finish",
        "finish_storage_prefetch_admission",
        "load_back_is_cache_owned",
        "prefix_device_indices",
        "release_aborted_request",
        "release_host_resources",
        "release_radix_session",
        "release_session",
        "resolve_node_handle",
        "rotation_base_of",
        "session_records",
        "supports_auxiliary_swa",
        "swa_evictable_size",
        "swa_protected_size",
        "swa_retain_floor",
        "swa_transient_size",
        "take_events",
        "update_eviction_metrics",
        "waiting_storage_span",
    }
)
"""Methods of SGLang's `BasePrefixCache` the cache view runs as SGLang's own: hooks for
what drive does not run (host tiers, sessions, a window), each a no-op, a constant or
a read of the view's own counts."""


class HoldsPools(Protocol):
    """Whatever owns the one `Pools` value: each transition's result replaces it (and
    the cache view's `lock` and `unlock` do). `release` and `checkpoint` are SGLang's
    `release_kv_cache` and `checkpoint_kv_cache` for one request, by rid."""

    pools: Pools

    def release(self, rid: str, tokens: Sequence[int]) -> None:
        """Give back request `rid`'s slot and KV; the whole pages of `tokens` stay cached."""

    def checkpoint(self, rid: str) -> None:
        """SGLang published what request `rid` computed so far."""


def _held(owner: HoldsPools, view: str) -> HoldsPools:
    # A view of something that holds no Pools would fail at SGLang's first read, far away.
    held = getattr(owner, "pools", None)
    if not isinstance(held, Pools):
        raise PoolsArgumentError(
            f"{view}: the owner must hold a Pools in `pools`, got {type(held).__name__}"
        )
    return owner


@final
class ReqToTokenView:
    """SGLang's `ReqToTokenPool` as a view of `owner.pools`: the table and the free
    request slots."""

    def __init__(self, owner: HoldsPools) -> None:
        self._owner = _held(owner, type(self).__name__)

    @property
    def owner(self) -> HoldsPools:
        """What holds the `Pools` this view reads."""
        return self._owner

    @property
    def req_to_token(self) -> torch.Tensor:
        """`[size + 1, max_context_len]` int32, slot, position -> KV location: the pools'
        table itself (row 0 is padding, as in SGLang)."""
        return self._owner.pools.table.device

    @property
    def size(self) -> int:
        """Request slots (SGLang's `size`: rows without the padding row)."""
        return self._owner.pools.max_reqs

    @property
    def max_context_len(self) -> int:
        """Positions per row: the longest request the table holds."""
        return self._owner.pools.max_context_len

    @property
    def device(self) -> str:
        """The table's device, as SGLang names one ("cpu", "cuda:0")."""
        return str(self._owner.pools.table.device.device)

    def available_size(self) -> int:
        """Free request slots."""
        return self._owner.pools.num_free_slots

    @property
    def free_slots(self) -> list[int]:
        """The free request slots, as SGLang lists them."""
        slots: list[int] = self._owner.pools.free_slots.tolist()
        return slots

    def free(self, req: object) -> None:
        """SGLang's last step of a release: the request forgets its slot, which the
        release transition (the cache view's `on_release`, just before) gave back."""
        kv: Any = getattr(req, "kv")  # noqa: B009  # SGLang's Req is untyped
        require(kv, "ReqKvInfo", ("req_pool_idx",))
        kv.req_pool_idx = None


@final
class KVAllocatorView:
    """SGLang's token (page size 1) or paged KV allocator as a view of `owner.pools`."""

    def __init__(self, owner: HoldsPools) -> None:
        self._owner = _held(owner, type(self).__name__)

    @property
    def size(self) -> int:
        """KV tokens the allocator hands out (the padding page not counted)."""
        pools = self._owner.pools
        return pools.num_pages * pools.page_size

    @property
    def page_size(self) -> int:
        """Tokens per KV page."""
        return self._owner.pools.page_size

    def available_size(self) -> int:
        """Tokens in free pages, as SGLang counts its free and to-be-released pages;
        eviction's are the cache view's `evictable_size()`."""
        return self._owner.pools.num_free_tokens

    @property
    def free_pages(self) -> torch.Tensor:
        """int64 ids of the free pages (location = page * page_size + offset), on the CPU."""
        return torch.from_numpy(np.array(self._owner.pools.free_pages, dtype=np.int64))

    def create_prefill_budget(
        self, tree_cache: RadixCacheView, *, num_mixed_decode_tokens: int = 0
    ) -> object:
        """SGLang's own `PrefillBudget` over this view and `tree_cache` (what
        `PrefillAdder` admits against)."""
        from batchstate.sglang._stubs import install_stubs

        install_stubs()
        from sglang.srt.mem_cache.prefill_budget import PrefillBudget

        budget: object = PrefillBudget(
            self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens
        )
        return budget

    def request_slot_reserve(self, *, has_req_pool_slot: bool, prefill_tokens: int = 0) -> int:
        """KV tokens a request needs beyond its prefill: none (no per-request workspace)."""
        del has_req_pool_slot, prefill_tokens
        return 0

    def __getattr__(self, name: str) -> object:
        # SGLang's allocator policy (what fits, how far a request may generate) is
        # computed from page_size and the counts alone: run SGLang's own over the view.
        if name not in SGLANG_ALLOCATOR_POLICY:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        from batchstate.sglang._stubs import install_stubs

        install_stubs()
        from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

        return types.MethodType(getattr(BaseTokenToKVPoolAllocator, name), self)

    def evict_to_free_tokens(self, tree_cache: object, num_tokens: int) -> None:
        """Evict cached prefixes no row reads, least recently used first, until
        `num_tokens` are free or nothing is evictable: SGLang's eager eviction (before
        an allocation, after a retraction), taken from the one `Pools`."""
        shortfall = num_tokens - self._owner.pools.num_free_tokens
        if shortfall <= 0:
            return
        from batchstate.sglang._stubs import install_stubs

        install_stubs()
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        # Through the cache's own door, as SGLang's (a shadow watches that door).
        cache = (
            tree_cache if isinstance(tree_cache, RadixCacheView) else RadixCacheView(self._owner)
        )
        cache.evict(EvictParams(num_tokens=shortfall))

    def check_decode_capacity(self, *, num_tokens: int, **context: object) -> bool:
        """Whether a decode of `num_tokens` new KV tokens fits, after evicting for it
        (as SGLang's allocator answers it)."""
        self.evict_to_free_tokens(context.get("tree_cache"), num_tokens)
        return self._owner.pools.num_free_tokens >= num_tokens

    def free_group_begin(self) -> None:
        """SGLang batches frees of one result processing; batchstate frees at release."""

    def free_group_end(self) -> None:
        """The end of a free group: nothing was held back."""


@final
class RadixCacheView:
    """SGLang's `RadixCache` counters as a view of `owner.pools`' prefix cache."""

    root_node: None = None
    """No SGLang tree: the prefix cache is batchstate's (`cached_length` reads it)."""
    buffer_pipeline: None = None
    """SGLang's host-buffer pipeline of a hierarchical cache: none."""
    kv_events: None = None
    """SGLang's KV event queue (for a router): none."""
    metrics_collector: None = None
    """SGLang's eviction metrics: none."""
    sliding_window_size: None = None
    """No sliding window."""
    cache_controller: None = None
    """A hierarchical cache's host controller: none."""
    storage_prefetch_retries: None = None
    """A storage tier's prefetch retries: none."""
    draft_swa_window: int = 0
    """A draft model's window: none."""

    def __getattr__(self, name: str) -> object:
        # SGLang's hooks for what batchstate does not model (host tiers, sessions, the
        # window) are no-ops or constants on its base cache: run SGLang's own.
        if name not in SGLANG_CACHE_HOOKS:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        from batchstate.sglang._stubs import install_stubs

        install_stubs()
        from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

        return types.MethodType(getattr(BasePrefixCache, name), self)

    def __init__(self, owner: HoldsPools) -> None:
        self._owner = _held(owner, type(self).__name__)

    @property
    def page_size(self) -> int:
        """Tokens per KV page: the cache matches whole pages."""
        return self._owner.pools.page_size

    @property
    def disable(self) -> bool:
        """Whether the cache is off (SGLang's `--disable-radix-cache`)."""
        return not self._owner.pools.cache.enabled

    def evictable_size(self) -> int:
        """Cached tokens no live row reads: what allocation may evict."""
        pools = self._owner.pools
        return pools.cache.num_evictable * pools.page_size

    def full_evictable_size(self) -> int:
        """`evictable_size()`: one kind of memory, full attention."""
        return self.evictable_size()

    def protected_size(self) -> int:
        """Cached tokens that live rows read (locked)."""
        pools = self._owner.pools
        return pools.cache.num_locked * pools.page_size

    def full_protected_size(self) -> int:
        """`protected_size()`: one kind of memory, full attention."""
        return self.protected_size()

    def total_size(self) -> int:
        """Tokens the cache holds, shared prefixes counted once."""
        return self._owner.pools.cache.num_tokens

    def supports_prefix_sharing(self) -> bool:
        """Whether requests may read each other's cached prefixes: the cache is on."""
        return not self.disable

    def match_prefix(self, params: object) -> object:
        """SGLang's `MatchResult` for `params.key` (a `RadixKey`, its `limit` honoured):
        the longest cached prefix of whole pages, read from the pools' prefix cache
        without changing it. Its node is the matched tokens themselves."""
        from batchstate.sglang._stubs import install_stubs

        install_stubs()
        from sglang.srt.mem_cache.base_prefix_cache import MatchResult

        require(params, "MatchPrefixParams", ("key",))  # a clear error where SGLang's moved
        key: Any = getattr(params, "key")  # noqa: B009  # SGLang's params are untyped
        require(key, "RadixKey", ("raw_token_ids",))
        tokens = tuple(key.raw_token_ids())
        length = self._owner.pools.cache.match(tokens)[0] if not self.disable else 0
        node = tokens[:length]
        self._touch(node)
        result: object = MatchResult(
            device_prefix_len=length,
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
        )
        return result

    def evict(self, params: object) -> object:
        """SGLang's `evict(EvictParams)`: cached prefixes no row reads, least recently
        used first, whole leaves, until `params.num_tokens` are freed or none is left.
        Returns SGLang's `EvictResult`."""
        from batchstate.sglang._stubs import install_stubs

        install_stubs()
        from sglang.srt.mem_cache.base_prefix_cache import EvictResult

        require(params, "EvictParams", ("num_tokens",))
        return EvictResult(num_tokens_evicted=self.evict_tokens(int(getattr(params, "num_tokens"))))  # noqa: B009

    def evict_tokens(self, num_tokens: int) -> int:
        """`evict` in plain numbers: the tokens evicted (whole pages) for `num_tokens`."""
        owner = self._owner
        before = owner.pools
        if num_tokens <= 0:
            return 0
        after = evict_least_recent(before, -(-num_tokens // before.page_size))
        owner.pools = after
        return (after.num_free_tokens - before.num_free_tokens) if after is not before else 0

    def cached_length(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the cache holds, whole pages (reading only)."""
        return self._owner.pools.cache.match(tuple(tokens))[0]

    def _touch(self, node: tuple[int, ...]) -> None:
        # A match or an insert makes the prefix (and the rest of a node it ends inside)
        # the most recently used, in SGLang's tree and in the pools: eviction then picks
        # the same prefixes as SGLang's would.
        if node:
            owner = self._owner
            owner.pools = owner.pools.touch_prefix(node, len(node)).commit()

    def lock(self, node: tuple[int, ...]) -> tuple[int, ...]:
        """One more reader of the cached prefix `node` (a match's node), in the one
        `Pools`: its pages stop being evictable, as SGLang's lock makes them. Returns
        the lock `unlock` takes."""
        if node:
            owner = self._owner
            owner.pools = owner.pools.lock_matched_prefixes([node], [len(node)]).commit()
        return node

    def unlock(self, lock: tuple[int, ...] | None) -> None:
        """Give back a `lock` (None: nothing, as SGLang's).

        Raises `PoolsArgumentError` (nothing changes) when it holds no lock.
        """
        if lock:
            owner = self._owner
            owner.pools = owner.pools.unlock_matched_prefixes([lock], [len(lock)]).commit()

    def path_device_indices(self, node: tuple[int, ...]) -> torch.Tensor:
        """int64 KV locations of the cached prefix `node` (a match's node), on the
        table's device: what SGLang's `prefix_device_indices` reads. Computed from the
        cache's host pages (one upload, no device read); empty when not cached."""
        pools = self._owner.pools
        length, pages = pools.cache.match(node)
        offsets = np.arange(pools.page_size, dtype=np.int64)
        locations = (pages.astype(np.int64)[:, None] * pools.page_size + offsets).reshape(-1)
        return torch.from_numpy(locations[:length].copy()).to(pools.table.device.device)

    @property
    def req_to_token_pool(self) -> ReqToTokenView:
        """The table view of the same owner (SGLang's release frees the row through it)."""
        return ReqToTokenView(self._owner)

    @property
    def token_to_kv_pool_allocator(self) -> KVAllocatorView:
        """The allocator view of the same owner (SGLang's eviction asks it)."""
        return KVAllocatorView(self._owner)

    def checkpoint(self, req: object, *, up_to: int) -> None:
        """SGLang published request `req`'s first `up_to` tokens. batchstate published
        the whole pages its extend computed already, so only the request's own record of
        what the cache holds moves (SGLang's `cache_protected_len`: whole pages)."""
        r: Any = req
        require(r, "Req", ("rid", "kv", "full_untruncated_fill_ids"))
        if not self.disable:
            aligned = up_to // self.page_size * self.page_size
            r.kv.cache_protected_len = max(r.kv.cache_protected_len, aligned)
            tokens = tuple(r.full_untruncated_fill_ids[:aligned])
            self._touch(tokens[: self._owner.pools.cache.match(tokens)[0]])
        self._owner.checkpoint(r.rid)

    def claim_kv_row(self, req: object) -> bool:
        """False: no streaming session keeps a row."""
        del req
        return False

    def free_kv_row(self, kv: object, ranges: list[tuple[int, int]]) -> None:
        """Nothing: the release transition (`on_release`) gives the row's KV back whole."""
        del kv, ranges

    def on_release(self, req: object, *, checkpointed: bool) -> None:
        """Request `req` leaves: its slot and KV go back in one batchstate release; what
        stays cached is what SGLang's tree keeps of it (its tokens up to what it owns
        when `checkpointed`, else what earlier checkpoints published)."""
        r: Any = req
        require(r, "Req", ("rid", "origin_input_ids", "output_ids", "kv"))
        kept = r.owned_kv_len() if checkpointed else r.kv.cache_protected_len
        tokens = [*r.origin_input_ids, *r.output_ids][:kept]
        self._owner.release(r.rid, tokens)

    def flush_pending_backups(self) -> None:
        """Nothing: no host tier to back up to (SGLang calls it after every result)."""

    def supports_fast_match_prefix(self) -> bool:
        """False, as SGLang's radix cache: a cache-agnostic policy does not match ahead."""
        return False

    def touch_prefix(self, key: object) -> None:
        """Nothing: batchstate's clock moves on a match or an insert."""
        del key

    def swa_reprefill_tail_tokens(self, req: object = None) -> int:
        """0: no sliding window to recompute."""
        del req
        return 0

    def maybe_hand_to_session(self, req: object) -> None:
        """Nothing: no streaming session."""
        del req

    def supports_mamba(self) -> bool:
        """False: hybrid state pools are not driven."""
        return False

    def supports_swa(self) -> bool:
        """False: sliding-window pools are not driven."""
        return False
