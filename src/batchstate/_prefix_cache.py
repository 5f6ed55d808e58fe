"""A radix prefix cache as a persistent value: token prefixes -> KV pages, with row locks."""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import NamedTuple, final

import attrs
import numpy as np
from immutables import Map

from batchstate._mirrored import HostArray, frozen

__all__ = ["PrefixCache"]

Tokens = tuple[int, ...]


class _Node(NamedTuple):
    # A radix edge: `tokens` (whole pages, non-empty but at the root) and their
    # KV `pages`; children keyed by their first page of tokens. Never mutated:
    # an update copies the nodes on its path and shares every other node.
    tokens: Tokens
    pages: tuple[int, ...]
    children: Map[Tokens, _Node]  # persistent: adding a child copies no sibling
    locks: int  # live rows whose cached prefix runs through this node
    used: int  # the cache's clock when a match or insert last went through it


_NO_CHILDREN: Map[Tokens, _Node] = Map()
_ROOT = _Node((), (), _NO_CHILDREN, 0, 0)


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
    _root: _Node
    clock: int  # bumped by every match that locks and every insert
    num_pages: int  # pages the cache holds
    num_locked: int  # of which, pages that live rows read
    num_evicted: int  # pages evicted since the cache was made: a running total, for reports
    # Every unlocked leaf, by the tokens from the root to its end (a split of the leaf
    # keeps them) -> its `used`: what eviction pops, kept beside the tree so that it
    # never scans it. Copied on change, never mutated.
    _leaves: dict[Tokens, int]

    @classmethod
    def _empty(cls, page_size: int, *, enabled: bool = True) -> PrefixCache:
        return cls(page_size, enabled, _ROOT, 0, 0, 0, 0, {})

    @property
    def num_evictable(self) -> int:
        """Cached pages no live row reads: what allocation may evict."""
        return self.num_pages - self.num_locked

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the cache holds (shared prefixes counted once)."""
        return self.num_pages * self.page_size

    def match(self, tokens: Sequence[int]) -> tuple[int, HostArray]:
        """The longest cached prefix of `tokens`: its length (whole pages) and its pages.

        Reads only: the cache is unchanged. Costs O(len(tokens)) token
        compares, done a node at a time at C speed.

        >>> cache = PrefixCache._empty(2)
        >>> cache.match((1, 2, 3))[0]
        0
        """
        ids = tuple(tokens)
        length, pages = self._walk(ids, len(ids)) if self.enabled else (0, [])
        return length, frozen(np.array(pages, dtype=np.int64))

    def entries(self) -> dict[Tokens, tuple[int, int]]:
        """Every cached page: the prefix it ends -> (page, rows reading it).

        For checks and tests: O(cached tokens * depth) to build.
        """
        out: dict[Tokens, tuple[int, int]] = {}
        for prefix, node in self._nodes():
            start = len(prefix) - len(node.tokens)
            for index, page in enumerate(node.pages):
                end = start + (index + 1) * self.page_size
                out[prefix[:end]] = (page, node.locks)
        return out

    def __len__(self) -> int:
        """Nodes of the radix tree, the root excluded."""
        return sum(1 for _ in self._nodes())

    def __repr__(self) -> str:
        if not self.enabled:
            return f"PrefixCache(disabled, page_size={self.page_size})"
        return (
            f"PrefixCache(pages={self.num_pages}, locked={self.num_locked},"
            f" page_size={self.page_size})"
        )

    # ---- what the cached transitions use --------------------------------------------------

    def _lock(self, tokens: Tokens, length: int) -> PrefixCache:
        # One more row reads the cached prefix `tokens[:length]` (whole pages, all cached).
        clock = self.clock + 1
        root, newly, _ = _update(self._root, tokens, length, self.page_size, 1, clock)
        leaves, prefix = self._leaves, tokens[:length]
        if prefix in leaves:  # an unlocked leaf, locked now
            leaves = dict(leaves)
            del leaves[prefix]
        return PrefixCache(
            self.page_size, self.enabled, root, clock, self.num_pages, self.num_locked + newly,
            self.num_evicted, leaves,
        )  # fmt: skip

    def _unlock(self, tokens: Tokens, length: int) -> PrefixCache:
        # A row that read `tokens[:length]` left.
        root, freed, end = _update(self._root, tokens, length, self.page_size, -1, self.clock)
        leaves = self._leaves
        if not end.children and not end.locks:  # the last row reading this leaf left
            leaves = {**leaves, tokens[:length]: end.used}
        return PrefixCache(
            self.page_size, self.enabled, root, self.clock, self.num_pages, self.num_locked - freed,
            self.num_evicted, leaves,
        )  # fmt: skip

    def _insert(self, tokens: Tokens, pages: Sequence[int]) -> tuple[PrefixCache, int]:
        # Cache `tokens` (whole pages) at `pages`; returns the new cache and how many
        # leading tokens were cached already (their `pages` stay the caller's to free).
        clock = self.clock + 1
        root, present = _insert(self._root, tokens, pages, self.page_size, clock)
        added = (len(tokens) - present) // self.page_size
        leaves = self._leaves
        if added or tokens in leaves:  # a new leaf, or a cached one used now
            leaves = dict(leaves)
            leaves.pop(tokens[:present], None)  # the new leaf's parent is no leaf now
            leaves[tokens] = clock
        cache = PrefixCache(
            self.page_size, self.enabled, root, clock, self.num_pages + added, self.num_locked,
            self.num_evicted, leaves,
        )  # fmt: skip
        return cache, present

    def _publish(self, tokens: Tokens, start: int, pages: Sequence[int]) -> PrefixCache | None:
        # A row that reads (locks) the cached `tokens[:start]` computed the rest (whole
        # pages, at `pages`): cache them and move its lock to their end, in one walk. The
        # same value as `_insert` then `_lock` then `_unlock` of the old prefix, clock
        # included; None if the cache holds a page past `start` already (another row's).
        page_size = self.page_size
        path = _descend(self._root, tokens, start, page_size)
        parent = path[-1][1] if path else self._root
        key = tokens[start : start + page_size]
        if key in parent.children:
            return None
        clock = self.clock + 2  # an insert's tick and a lock's
        leaf = _Node(tokens[start:], tuple(pages), _NO_CHILDREN, 1, clock)
        updated = [
            (edge, _Node(node.tokens, node.pages, node.children, node.locks, clock))
            for edge, node in path
        ]  # the row's lock moves past these: their counts stay, their clock moves on
        if updated:
            last_key, last = updated[-1]
            updated[-1] = (last_key, _with_children(last, last.children.set(key, leaf)))
            root = _rebuild(self._root, updated)
        else:
            root = _with_children(self._root, self._root.children.set(key, leaf))
        return PrefixCache(
            page_size, self.enabled, root, clock, self.num_pages + len(pages),
            self.num_locked + len(pages), self.num_evicted, self._leaves,
        )  # fmt: skip

    def _evict(self, num_pages: int) -> tuple[PrefixCache, list[int]]:
        # Drop unlocked leaves, least recently used first, until `num_pages` pages are
        # out (or none is left); returns the cache and the pages dropped, whole leaves.
        # Heaps the unlocked leaves it keeps: O(leaves + evicted * log leaves), no scan.
        heap = [(used, prefix) for prefix, used in self._leaves.items()]
        heapq.heapify(heap)
        leaves = dict(self._leaves)
        root, freed = self._root, list[int]()
        while heap and len(freed) < num_pages:
            _, prefix = heapq.heappop(heap)
            del leaves[prefix]
            root, leaf, parent = _remove(root, prefix, self.page_size)
            freed.extend(leaf.pages)
            if parent.tokens and not parent.children and not parent.locks:
                above = prefix[: -len(leaf.tokens)]
                leaves[above] = parent.used
                heapq.heappush(heap, (parent.used, above))
        cache = PrefixCache(
            self.page_size, self.enabled, root, self.clock, self.num_pages - len(freed),
            self.num_locked, self.num_evicted + len(freed), leaves,
        )  # fmt: skip
        return cache, freed

    def _unlocked_leaves(self) -> dict[Tokens, int]:
        # The unlocked leaves found by a scan of the tree, for checks: `_leaves` must equal it.
        return {
            prefix: node.used
            for prefix, node in self._nodes()
            if not node.children and not node.locks
        }

    def _walk(self, tokens: Tokens, limit: int) -> tuple[int, list[int]]:
        # Longest cached prefix of tokens[:limit]: (length, pages).
        page_size, node, length = self.page_size, self._root, 0
        pages: list[int] = []
        while length + page_size <= limit:
            child = node.children.get(tokens[length : length + page_size])
            if child is None:
                break
            common = _common(child.tokens, tokens, length, limit, page_size)
            pages.extend(child.pages[: common // page_size])
            length += common
            if common < len(child.tokens):
                break
            node = child
        return length, pages

    def _nodes(self) -> Iterator[tuple[Tokens, _Node]]:
        # Every node but the root, with the full prefix it ends.
        stack: list[tuple[Tokens, _Node]] = [((), self._root)]
        while stack:
            prefix, node = stack.pop()
            for child in node.children.values():
                path = prefix + child.tokens
                yield path, child
                stack.append((path, child))


def _common(edge: Tokens, tokens: Tokens, start: int, limit: int, page_size: int) -> int:
    # Whole pages of `edge` equal to tokens[start:limit], from the front.
    span = tokens[start : min(start + len(edge), limit)]
    if edge[: len(span)] == span:
        return len(span) // page_size * page_size
    low, high = 1, len(span) // page_size  # page 0 matched through the children's key
    while low < high:  # the most pages that match: a binary search of C-speed compares
        middle = (low + high + 1) // 2
        end = middle * page_size
        if edge[:end] == span[:end]:
            low = middle
        else:
            high = middle - 1
    return low * page_size


def _split(node: _Node, cut: int, page_size: int) -> _Node:
    # `node` cut after `cut` tokens (whole pages): the upper part, with the lower as its child.
    lower = node._replace(tokens=node.tokens[cut:], pages=node.pages[cut // page_size :])
    return node._replace(
        tokens=node.tokens[:cut],
        pages=node.pages[: cut // page_size],
        children=Map({lower.tokens[:page_size]: lower}),
    )


def _with_children(node: _Node, children: Map[Tokens, _Node]) -> _Node:
    # `node._replace(children=...)` at a third of its cost: updates copy many nodes.
    return _Node(node.tokens, node.pages, children, node.locks, node.used)


def _descend(
    root: _Node, tokens: Tokens, length: int, page_size: int
) -> list[tuple[Tokens, _Node]]:
    # The nodes on the path of tokens[:length] (cached), each with its key; the last
    # one split so that it ends exactly at `length`.
    path: list[tuple[Tokens, _Node]] = []
    node, at = root, 0
    while at < length:
        key = tokens[at : at + page_size]
        child = node.children[key]
        if at + len(child.tokens) > length:
            child = _split(child, length - at, page_size)
        path.append((key, child))
        node, at = child, at + len(child.tokens)
    return path


def _rebuild(root: _Node, path: Sequence[tuple[Tokens, _Node]]) -> _Node:
    # Copy the path's parents bottom-up so that they point at its new nodes.
    if not path:
        return root
    node = path[-1][1]
    for index in range(len(path) - 1, 0, -1):
        key, parent = path[index][0], path[index - 1][1]
        node = _with_children(parent, parent.children.set(key, node))
    return _with_children(root, root.children.set(path[0][0], node))


def _update(  # noqa: PLR0917  # a private helper, called twice
    root: _Node, tokens: Tokens, length: int, page_size: int, delta: int, clock: int
) -> tuple[_Node, int, _Node]:
    # Add `delta` locks along tokens[:length] (non-empty); returns the root, the pages
    # whose nodes went from unlocked to locked (or back, for a negative delta), and
    # the updated node that ends at `length`.
    flipped = 0
    updated = []
    for key, node in _descend(root, tokens, length, page_size):
        locks = node.locks + delta
        if (node.locks == 0) != (locks == 0):
            flipped += len(node.pages)
        used = max(node.used, clock)
        updated.append((key, _Node(node.tokens, node.pages, node.children, locks, used)))
    return _rebuild(root, updated), flipped, updated[-1][1]


def _insert(
    root: _Node, tokens: Tokens, pages: Sequence[int], page_size: int, clock: int
) -> tuple[_Node, int]:
    # Insert tokens (whole pages) at `pages`; returns the root and the cached length before.
    node, at = root, 0
    path: list[tuple[Tokens, _Node]] = []
    while at < len(tokens):
        key = tokens[at : at + page_size]
        child = node.children.get(key)
        if child is None:
            break
        common = _common(child.tokens, tokens, at, len(tokens), page_size)
        split = common < len(child.tokens)
        if split:
            child = _split(child, common, page_size)
        path.append((key, _Node(child.tokens, child.pages, child.children, child.locks, clock)))
        node, at = child, at + common
        if split:
            break
    present = at
    if at < len(tokens):
        leaf = _Node(tokens[at:], tuple(pages[at // page_size :]), _NO_CHILDREN, 0, clock)
        key = tokens[at : at + page_size]
        if not path:
            return _with_children(root, root.children.set(key, leaf)), present
        last_key, last = path[-1]
        path[-1] = (last_key, _with_children(last, last.children.set(key, leaf)))
    return _rebuild(root, path), present


def _remove(root: _Node, prefix: Tokens, page_size: int) -> tuple[_Node, _Node, _Node]:
    # Drop the leaf ending `prefix`; returns the root, the leaf and its parent.
    path: list[tuple[Tokens, _Node]] = []
    node, at = root, 0
    while True:
        key = prefix[at : at + page_size]
        leaf = node.children[key]
        at += len(leaf.tokens)
        if at == len(prefix):
            break
        path.append((key, leaf))
        node = leaf
    parent = _with_children(node, node.children.delete(key))
    if not path:
        return parent, leaf, parent
    path[-1] = (path[-1][0], parent)
    return _rebuild(root, path), leaf, parent
