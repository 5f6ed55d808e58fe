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
`Pools` (`lock`, `unlock`), as admission does; inserting and evicting are not views
yet.
"""

from __future__ import annotations

from typing import Any, Protocol, final

import numpy as np
import torch

from batchstate import Pools
from batchstate.errors import PoolsArgumentError
from batchstate.sglang._fields import require

__all__ = ["HoldsPools", "KVAllocatorView", "RadixCacheView", "ReqToTokenView"]


class HoldsPools(Protocol):
    """Whatever owns the one `Pools` value: each transition's result replaces it (and
    the cache view's `lock` and `unlock` do)."""

    pools: Pools


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


@final
class RadixCacheView:
    """SGLang's `RadixCache` counters as a view of `owner.pools`' prefix cache."""

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
        result: object = MatchResult(
            device_prefix_len=length,
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
        )
        return result

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

    def supports_mamba(self) -> bool:
        """False: hybrid state pools are not driven."""
        return False

    def supports_swa(self) -> bool:
        """False: sliding-window pools are not driven."""
        return False
