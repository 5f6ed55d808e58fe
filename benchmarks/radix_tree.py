"""The mutable baseline's prefix cache: a radix tree in the style of SGLang's `RadixCache`.

Written from a description of SGLang's `RadixCache` (python/sglang/srt/mem_cache/
radix_cache.py), not from its code: nodes that own a token-id `key` (a Python
list) and its KV token locations `value` (an int64 tensor), children keyed by
their first token (first page with pages of more than one token), a
`lock_ref` per node raised and lowered along the path to the root, a set of
evictable leaves kept up to date, and LRU eviction by `last_access_time`
with a heap. `match_prefix` splits a node where a match ends inside it;
`cache_unfinished_req` runs at a chunk's end and `cache_finished_req` at
release, as SGLang's scheduler calls them.

Two choices keep it bookkeeping-equal to batchstate, so the smoke test can
compare states: access times come from a counter bumped once per match or
insert (SGLang reads `time.monotonic()` once per call), and when a node is
split only the upper half is stamped (SGLang also stamps the lower half,
which can reorder leaves of equal age).
"""

from __future__ import annotations

import heapq
from typing import Protocol

import torch

__all__ = ["MutableReq", "RadixCache", "TreeNode"]

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    """One radix edge: its tokens, their KV token locations, locks and last access."""

    __slots__ = ("children", "key", "last_access_time", "lock_ref", "parent", "value")

    def __init__(self) -> None:
        self.children: dict[object, TreeNode] = {}
        self.parent: TreeNode | None = None
        self.key: list[int] = []
        self.value: torch.Tensor = _EMPTY
        self.lock_ref = 0
        self.last_access_time = 0

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access_time < other.last_access_time


class MutableReq:
    """A request as SGLang keeps it: mutable, with its prefix-cache fields."""

    __slots__ = (
        "cache_protected_len",
        "extend_input_len",
        "fill_ids",
        "last_node",
        "origin_input_ids",
        "output_ids",
        "prefix_indices",
        "req_pool_idx",
        "rid",
    )

    def __init__(self, rid: int, origin_input_ids: list[int], root: TreeNode) -> None:
        self.rid = rid
        self.origin_input_ids = origin_input_ids
        self.output_ids: list[int] = []
        self.fill_ids: list[int] = []
        self.prefix_indices: torch.Tensor = _EMPTY
        self.last_node = root
        self.extend_input_len = 0
        self.req_pool_idx: int | None = None
        self.cache_protected_len = 0

    def init_next_round_input(self, tree: RadixCache | None = None) -> None:
        """Tokens to fill; with `tree`, match the longest cached prefix (leaving one token)."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        if tree is not None:
            self.prefix_indices, self.last_node = tree.match_prefix(self.fill_ids[:-1])
            self.cache_protected_len = len(self.prefix_indices)  # the tree's pages it reads
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)


class _Allocator(Protocol):
    table_cpu: torch.Tensor
    table: torch.Tensor

    def free(self, locs: torch.Tensor) -> None: ...


class RadixCache:
    """Token prefixes -> KV locations, mutated in place."""

    def __init__(self, allocator: _Allocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.root = TreeNode()
        self.root.lock_ref = 1  # never evicted
        self.evictable_leaves: set[TreeNode] = set()
        self.evictable_size = 0  # tokens
        self.protected_size = 0
        self.num_evicted = 0  # pages, a running total
        self._clock = 0

    # ---- lookups and updates ---------------------------------------------------------

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """The longest cached prefix of `key` (whole pages): its KV locations and last node."""
        key = self._aligned(key)
        if not key:
            return _EMPTY, self.root
        now = self._tick()
        node = self.root
        values = []
        child_key = self._child_key(key)
        while key and child_key in node.children:
            child = node.children[child_key]
            matched = self._key_match(child.key, key)
            if matched < len(child.key):
                child = self._split_node(child, matched)
                child.last_access_time = now
                values.append(child.value)
                node = child
                break
            child.last_access_time = now
            values.append(child.value)
            node = child
            key = key[matched:]
            if key:
                child_key = self._child_key(key)
        return (torch.cat(values) if values else _EMPTY), node

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Cache `key` (whole pages) at `value`; returns how many leading tokens were cached."""
        if not key:
            return 0
        now = self._tick()
        node = self.root
        child_key = self._child_key(key)
        total = 0
        while key and child_key in node.children:
            node = node.children[child_key]
            matched = self._key_match(node.key, key)
            total += matched
            key = key[matched:]
            value = value[matched:]
            if matched < len(node.key):
                node = self._split_node(node, matched)
            node.last_access_time = now
            if key:
                child_key = self._child_key(key)
        if key:
            leaf = TreeNode()
            leaf.parent = node
            leaf.key = key
            leaf.value = value.clone()
            leaf.last_access_time = now
            node.children[child_key] = leaf
            self.evictable_size += len(key)
            self._update_leaf_status(node)
            self._update_leaf_status(leaf)
        return total

    def evict(self, num_pages: int) -> None:
        """Free unlocked leaves, least recently used first, until `num_pages` pages are out."""
        heap = [(node.last_access_time, node) for node in self.evictable_leaves]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_pages and heap:
            _, leaf = heapq.heappop(heap)
            self.allocator.free(leaf.value)
            evicted += len(leaf.value) // self.page_size
            self._delete_leaf(leaf)
            parent = leaf.parent
            assert parent is not None
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, parent))
        self.num_evicted += evicted

    def inc_lock_ref(self, node: TreeNode) -> None:
        """One more live request reads the prefix ending at `node`."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            self._update_leaf_status(node)
            assert node.parent is not None
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """A live request that read the prefix ending at `node` no longer does."""
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node.lock_ref -= 1
            self._update_leaf_status(node)
            assert node.parent is not None
            node = node.parent

    # ---- what the scheduler calls ------------------------------------------------------

    def cache_finished_req(self, req: MutableReq, kv_committed_len: int) -> None:
        """A request finished: cache its tokens' whole pages, free duplicates and the tail."""
        assert req.req_pool_idx is not None
        token_ids = (req.origin_input_ids + req.output_ids)[:kv_committed_len]
        kv_indices = self.allocator.table_cpu[req.req_pool_idx, : len(token_ids)]
        keys = self._aligned(token_ids)
        values = kv_indices[: len(keys)].to(dtype=torch.int64, copy=True)
        new_prefix_len = self.insert(keys, values)
        # Pages the tree held already, past what this request read from it: computed twice.
        self.allocator.free(kv_indices[req.cache_protected_len : new_prefix_len])
        self.allocator.free(kv_indices[len(keys) :])  # the partly filled last page
        self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: MutableReq) -> None:
        """A chunk ended: cache its whole pages and move the request's lock onto them."""
        assert req.req_pool_idx is not None
        slot = req.req_pool_idx
        token_ids = req.fill_ids
        kv_indices = self.allocator.table_cpu[slot, : len(token_ids)]
        keys = self._aligned(token_ids)
        values = kv_indices[: len(keys)].to(dtype=torch.int64, copy=True)
        new_prefix_len = self.insert(keys, values)
        self.allocator.free(kv_indices[req.cache_protected_len : new_prefix_len])
        new_indices, new_last_node = self.match_prefix(keys)
        # The row reads the tree's pages from now on: write them into its table row.
        start, end = req.cache_protected_len, len(new_indices)
        cells = new_indices[start:].to(torch.int32)
        self.allocator.table_cpu[slot, start:end] = cells
        self.allocator.table[slot, start:end] = cells.to(self.allocator.table.device)
        req.cache_protected_len = end
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(new_last_node)
        if end < len(kv_indices):  # the partly filled last page stays the request's
            req.prefix_indices = torch.cat((new_indices, kv_indices[end:].to(torch.int64)))
        else:
            req.prefix_indices = new_indices
        req.last_node = new_last_node

    def entries(self) -> dict[tuple[int, ...], tuple[int, int]]:
        """Every cached page: the prefix it ends -> (page, requests reading it). For tests."""
        out: dict[tuple[int, ...], tuple[int, int]] = {}
        page_size = self.page_size
        stack: list[tuple[tuple[int, ...], TreeNode]] = [((), self.root)]
        while stack:
            prefix, node = stack.pop()
            for child in node.children.values():
                path = prefix + tuple(child.key)
                for index in range(len(child.key) // page_size):
                    page = int(child.value[index * page_size]) // page_size
                    out[path[: len(prefix) + (index + 1) * page_size]] = (page, child.lock_ref)
                stack.append((path, child))
        return out

    # ---- helpers -------------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _aligned(self, key: list[int]) -> list[int]:
        if self.page_size == 1:
            return key
        return key[: len(key) // self.page_size * self.page_size]

    def _child_key(self, key: list[int]) -> object:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _key_match(self, key0: list[int], key1: list[int]) -> int:
        # Tokens in common from the front (whole pages), compared as SGLang does.
        if self.page_size == 1:
            matched = 0
            for left, right in zip(key0, key1, strict=False):
                if left != right:
                    break
                matched += 1
            return matched
        page_size = self.page_size
        shortest = min(len(key0), len(key1))
        matched = 0
        while matched < shortest:
            if key0[matched : matched + page_size] != key1[matched : matched + page_size]:
                break
            matched += page_size
        return matched

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        # `child` cut after `split_len` tokens: a new upper node, with `child` below it.
        upper = TreeNode()
        upper.children = {self._child_key(child.key[split_len:]): child}
        upper.parent = child.parent
        upper.lock_ref = child.lock_ref
        upper.key = child.key[:split_len]
        upper.value = child.value[:split_len].clone()
        upper.last_access_time = child.last_access_time
        child.parent = upper
        child.key = child.key[split_len:]
        child.value = child.value[split_len:].clone()
        assert upper.parent is not None
        upper.parent.children[self._child_key(upper.key)] = upper
        return upper

    def _delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.key)]
        self.evictable_size -= len(node.key)
        self.evictable_leaves.discard(node)
        self._update_leaf_status(parent)

    def _update_leaf_status(self, node: TreeNode) -> None:
        if node.lock_ref > 0 or node.children:
            self.evictable_leaves.discard(node)
        else:
            self.evictable_leaves.add(node)
