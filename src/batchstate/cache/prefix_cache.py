"""A radix prefix cache as a persistent value: token prefixes -> KV pages, with row locks."""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import final

import attrs
import numpy as np

from batchstate.base.mirrored import NO_INTS, HostArray, frozen
from batchstate.cache.radix import (
    NO_CHILDREN,
    ROOT,
    Node,
    Tokens,
    common_pages,
    descend,
    insert_tokens,
    rebuild,
    release_tokens,
    remove_leaf,
    touch_path,
    update_locks,
    with_children,
)

__all__ = ["PrefixCache", "Tokens"]


@final
@attrs.frozen(eq=False, repr=False)
class PrefixCache:
    """Token prefixes of finished requests and the KV pages holding them, as a value.

    A radix tree over token ids whose edges are whole pages: a cached
    prefix is always a multiple of `page_size` tokens, and page `j` of a
    prefix holds the KV of its tokens `[j * page_size, (j + 1) * page_size)`.
    Updates copy the nodes on one root-to-node path and share the rest, so
    an older value stays valid and unchanged.

    A node is locked while live rows read its pages (their cached prefix
    runs through it); locks are prefix-closed (a child holds no more locks
    than its parent) and every lock ends at a node boundary, so a node's
    pages are all locked or all unlocked. Only unlocked leaves are evicted,
    least recently used first: a page in use cannot be evicted.

    Part of every `Pools` (`make_pools(..., prefix_cache=True)` turns it
    on) and changed only by the transitions that take those pools. A
    disabled cache (`enabled` false, the default) never matches and never
    holds a page: every page a row computes stays private to it and is
    freed on release.
    """

    page_size: int
    enabled: bool
    root: Node
    clock: int  # bumped by every match that locks and every insert
    num_pages: int  # pages the cache holds
    num_locked: int  # of which, pages that live rows read
    num_evicted: int  # pages evicted since the cache was made: a running total, for reports
    # Every unlocked leaf, by the tokens from the root to its end (a split of the leaf
    # keeps them) -> its `used`: what eviction pops, kept beside the tree so that it
    # never scans it. Copied on change, never mutated.
    leaves: dict[Tokens, int]
    # Whether a match on the cache alone may be read instead of computed: false for
    # hybrid pools, whose requests also need a window tail and a state at the prefix's
    # end, kept beside the cache (`HybridPools.cached`, `_hybrid_reuse.usable_prefix`).
    reuses: bool = True

    @classmethod
    def empty(cls, page_size: int, *, enabled: bool = True, reuses: bool = True) -> PrefixCache:
        return cls(page_size, enabled, ROOT, 0, 0, 0, 0, {}, reuses)

    @property
    def num_evictable(self) -> int:
        """Cached pages no live row reads: what allocation may evict."""
        return self.num_pages - self.num_locked

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the cache holds (shared prefixes counted once)."""
        return self.num_pages * self.page_size

    def match(self, tokens: Sequence[int]) -> tuple[int, HostArray]:
        """The longest cached prefix of `tokens` a request may read: its length and pages.

        Reads only: the cache is unchanged. Costs O(len(tokens)) token
        compares, done a node at a time at C speed. On hybrid pools a
        prefix is usable only up to an anchor that keeps its window tail
        and state, which the pools keep beside the cache (`Pools.memory`):
        the cache alone matches 0 there, and the transitions that admit
        requests cut their matches back to an anchor (docs/hybrid.md).

        >>> cache = PrefixCache.empty(2)
        >>> cache.match((1, 2, 3))[0]
        0
        """
        return self.cached_prefix(tokens) if self.reuses else (0, NO_INTS)

    def readers(self, tokens: Tokens, length: int) -> int:
        """The fewest rows reading any page of the cached prefix `tokens[:length]` (whole
        pages): 0 when some of it is not cached, or no row reads it. Reads only."""
        if (
            length <= 0
            or length % self.page_size
            or self.cached_prefix(tokens[:length])[0] < length
        ):
            return 0
        return min(node.locks for _, node in descend(self.root, tokens, length, self.page_size))

    def cached_prefix(self, tokens: Sequence[int]) -> tuple[int, HostArray]:
        # The longest prefix of `tokens` whose full-attention pages the cache holds.
        ids = tuple(tokens)
        length, pages = self._walk(ids, len(ids)) if self.enabled else (0, [])
        return length, frozen(np.array(pages, dtype=np.int64))

    def entries(self) -> dict[Tokens, tuple[int, int]]:
        """Every cached page: the prefix it ends -> (page, rows reading it).

        For checks and tests: O(cached tokens * depth) to build.
        """
        out: dict[Tokens, tuple[int, int]] = {}
        for prefix, node in self.nodes():
            start = len(prefix) - len(node.tokens)
            for index, page in enumerate(node.pages):
                end = start + (index + 1) * self.page_size
                out[prefix[:end]] = (page, node.locks)
        return out

    def __len__(self) -> int:
        """Nodes of the radix tree, the root excluded."""
        return sum(1 for _ in self.nodes())

    def __repr__(self) -> str:
        if not self.enabled:
            return f"PrefixCache(disabled, page_size={self.page_size})"
        return (
            f"PrefixCache(pages={self.num_pages}, locked={self.num_locked},"
            f" page_size={self.page_size})"
        )

    # ---- what the cached transitions use --------------------------------------------------

    def lock(self, tokens: Tokens, length: int) -> PrefixCache:
        # One more row reads the cached prefix `tokens[:length]` (whole pages, all cached).
        clock = self.clock + 1
        root, newly, _ = update_locks(self.root, tokens, length, self.page_size, 1, clock)
        leaves, prefix = self.leaves, tokens[:length]
        if prefix in leaves:  # an unlocked leaf, locked now
            leaves = dict(leaves)
            del leaves[prefix]
        return PrefixCache(
            self.page_size, self.enabled, root, clock, self.num_pages, self.num_locked + newly,
            self.num_evicted, leaves, self.reuses,
        )  # fmt: skip

    def touch(self, tokens: Tokens, length: int) -> PrefixCache:
        # A match of the cached `tokens[:length]` (whole pages) that reads nothing: its
        # nodes become the most recently used, and so does the rest of a node it ends
        # inside (split there), as a radix tree's match leaves them.
        if length <= 0:
            return self
        clock = self.clock + 1
        root, split_end = touch_path(self.root, tokens, length, self.page_size, clock)
        leaves, prefix = self.leaves, tokens[:length]
        touched = [end for end in (prefix, split_end) if end is not None and end in leaves]
        if touched:
            leaves = dict(leaves)
            for end in touched:
                leaves[end] = clock
        return PrefixCache(
            self.page_size, self.enabled, root, clock, self.num_pages, self.num_locked,
            self.num_evicted, leaves, self.reuses,
        )  # fmt: skip

    def unlock(self, tokens: Tokens, length: int) -> PrefixCache:
        # A row that read `tokens[:length]` left.
        root, freed, end = update_locks(self.root, tokens, length, self.page_size, -1, self.clock)
        leaves = self.leaves
        if not end.children and not end.locks:  # the last row reading this leaf left
            leaves = {**leaves, tokens[:length]: end.used}
        return PrefixCache(
            self.page_size, self.enabled, root, self.clock, self.num_pages, self.num_locked - freed,
            self.num_evicted, leaves, self.reuses,
        )  # fmt: skip

    def _insert(self, tokens: Tokens, pages: Sequence[int]) -> tuple[PrefixCache, int]:
        # Cache `tokens` (whole pages) at `pages`; returns the new cache and how many
        # leading tokens were cached already (their `pages` stay the caller's to free).
        clock = self.clock + 1
        root, present = insert_tokens(self.root, tokens, pages, self.page_size, clock)
        added = (len(tokens) - present) // self.page_size
        leaves = self.leaves
        if added or tokens in leaves:  # a new leaf, or a cached one used now
            leaves = dict(leaves)
            leaves.pop(tokens[:present], None)  # the new leaf's parent is no leaf now
            leaves[tokens] = clock
        cache = PrefixCache(
            self.page_size, self.enabled, root, clock, self.num_pages + added, self.num_locked,
            self.num_evicted, leaves, self.reuses,
        )  # fmt: skip
        return cache, present

    def _release(self, read: Tokens, tokens: Tokens, pages: HostArray) -> tuple[PrefixCache, int]:
        # A row that read `read` leaves and its `tokens` (whole pages, starting with
        # `read`) go in at `pages`: the value of `_unlock` then `_insert`, in one walk.
        if not read or len(tokens) < len(read):
            cache = self.unlock(read, len(read)) if read else self
            return cache._insert(tokens, pages.tolist())
        clock = self.clock + 1
        root, present, unlocked, bare = release_tokens(
            self.root, len(read), tokens, pages, self.page_size, clock
        )
        added = (len(tokens) - present) // self.page_size
        leaves = self.leaves
        # A leaf the unlock left bare is `tokens`' end, or their new leaf's parent.
        if bare or added or tokens in leaves:
            leaves = dict(leaves)
            leaves.pop(tokens[:present], None)
            leaves[tokens] = clock
        cache = PrefixCache(
            self.page_size, self.enabled, root, clock, self.num_pages + added,
            self.num_locked - unlocked, self.num_evicted, leaves, self.reuses,
        )  # fmt: skip
        return cache, present

    def publish(self, tokens: Tokens, start: int, pages: Sequence[int]) -> PrefixCache | None:
        # A row that reads (locks) the cached `tokens[:start]` computed the rest (whole
        # pages, at `pages`): cache them and move its lock to their end, in one walk. The
        # same value as `_insert` then `_lock` then `_unlock` of the old prefix, clock
        # included; None if the cache holds a page past `start` already (another row's).
        page_size = self.page_size
        path = descend(self.root, tokens, start, page_size)
        parent = path[-1][1] if path else self.root
        key = tokens[start : start + page_size]
        if key in parent.children:
            return None
        clock = self.clock + 2  # an insert's tick and a lock's
        leaf = Node(tokens[start:], tuple(pages), NO_CHILDREN, 1, clock)
        updated = [
            (edge, Node(node.tokens, node.pages, node.children, node.locks, clock))
            for edge, node in path
        ]  # the row's lock moves past these: their counts stay, their clock moves on
        if updated:
            last_key, last = updated[-1]
            updated[-1] = (last_key, with_children(last, last.children.set(key, leaf)))
            root = rebuild(self.root, updated)
        else:
            root = with_children(self.root, self.root.children.set(key, leaf))
        return PrefixCache(
            page_size, self.enabled, root, clock, self.num_pages + len(pages),
            self.num_locked + len(pages), self.num_evicted, self.leaves, self.reuses,
        )  # fmt: skip

    def evict(self, num_pages: int) -> tuple[PrefixCache, list[int]]:
        # Drop unlocked leaves, least recently used first, until `num_pages` pages are
        # out (or none is left); returns the cache and the pages dropped, whole leaves.
        # Heaps the unlocked leaves it keeps: O(leaves + evicted * log leaves), no scan.
        if num_pages <= 0 or not self.leaves:
            return self, []
        heap = list(zip(self.leaves.values(), self.leaves, strict=True))  # ties: by prefix
        heapq.heapify(heap)
        leaves = dict(self.leaves)
        root, freed, page_size = self.root, list[int](), self.page_size
        while heap and len(freed) < num_pages:
            _, prefix = heapq.heappop(heap)
            del leaves[prefix]
            root, leaf, parent = remove_leaf(root, prefix, page_size)
            freed += leaf.pages
            if parent.tokens and not parent.children and not parent.locks:
                above = prefix[: -len(leaf.tokens)]
                leaves[above] = parent.used
                heapq.heappush(heap, (parent.used, above))
        cache = PrefixCache(
            self.page_size, self.enabled, root, self.clock, self.num_pages - len(freed),
            self.num_locked, self.num_evicted + len(freed), leaves, self.reuses,
        )  # fmt: skip
        return cache, freed

    def _unlocked_leaves(self) -> dict[Tokens, int]:
        # The unlocked leaves found by a scan of the tree, for checks: `leaves` must equal it.
        return {
            prefix: node.used
            for prefix, node in self.nodes()
            if not node.children and not node.locks
        }

    def _walk(self, tokens: Tokens, limit: int) -> tuple[int, list[int]]:
        # Longest cached prefix of tokens[:limit]: (length, pages).
        page_size, node, length = self.page_size, self.root, 0
        pages: list[int] = []
        while length + page_size <= limit:
            child = node.children.get(tokens[length : length + page_size])
            if child is None:
                break
            common = common_pages(child.tokens, tokens, length, limit, page_size)
            pages.extend(child.pages[: common // page_size])
            length += common
            if common < len(child.tokens):
                break
            node = child
        return length, pages

    def nodes(self) -> Iterator[tuple[Tokens, Node]]:
        # Every node but the root, with the full prefix it ends.
        stack: list[tuple[Tokens, Node]] = [((), self.root)]
        while stack:
            prefix, node = stack.pop()
            for child in node.children.values():
                path = prefix + child.tokens
                yield path, child
                stack.append((path, child))
