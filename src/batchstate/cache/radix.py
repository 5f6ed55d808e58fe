"""The radix tree under `PrefixCache`: immutable nodes and the path-copying updates on them.

A node is a radix edge of whole pages of tokens and the KV pages holding
them. Nothing here mutates a node: every update copies the nodes on one
root-to-node path and shares every other node, so an older tree stays
valid and unchanged. `PrefixCache` keeps the counts and the index of
unlocked leaves beside the tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from immutables import Map

from batchstate.base.mirrored import HostArray

__all__ = [
    "NO_CHILDREN",
    "ROOT",
    "Node",
    "Tokens",
    "common_pages",
    "descend",
    "insert_tokens",
    "rebuild",
    "release_tokens",
    "remove_leaf",
    "split_node",
    "update_locks",
    "with_children",
]

Tokens = tuple[int, ...]


class Node(NamedTuple):
    # A radix edge: `tokens` (whole pages, non-empty but at the root) and their
    # KV `pages`; children keyed by their first page of tokens. Never mutated:
    # an update copies the nodes on its path and shares every other node.
    tokens: Tokens
    pages: tuple[int, ...]
    children: Map[Tokens, Node]  # persistent: adding a child copies no sibling
    locks: int  # live rows whose cached prefix runs through this node
    used: int  # the cache's clock when a match or insert last went through it


NO_CHILDREN: Map[Tokens, Node] = Map()
ROOT = Node((), (), NO_CHILDREN, 0, 0)


def common_pages(edge: Tokens, tokens: Tokens, start: int, limit: int, page_size: int) -> int:
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


def split_node(node: Node, cut: int, page_size: int) -> Node:
    # `node` cut after `cut` tokens (whole pages): the upper part, with the lower as its child.
    lower = node._replace(tokens=node.tokens[cut:], pages=node.pages[cut // page_size :])
    return node._replace(
        tokens=node.tokens[:cut],
        pages=node.pages[: cut // page_size],
        children=Map({lower.tokens[:page_size]: lower}),
    )


def with_children(node: Node, children: Map[Tokens, Node]) -> Node:
    # `node._replace(children=...)` at a third of its cost: updates copy many nodes.
    return Node(node.tokens, node.pages, children, node.locks, node.used)


def descend(root: Node, tokens: Tokens, length: int, page_size: int) -> list[tuple[Tokens, Node]]:
    # The nodes on the path of tokens[:length] (cached), each with its key; the last
    # one split so that it ends exactly at `length`.
    path: list[tuple[Tokens, Node]] = []
    node, at = root, 0
    while at < length:
        key = tokens[at : at + page_size]
        child = node.children[key]
        if at + len(child.tokens) > length:
            child = split_node(child, length - at, page_size)
        path.append((key, child))
        node, at = child, at + len(child.tokens)
    return path


def rebuild(root: Node, path: Sequence[tuple[Tokens, Node]]) -> Node:
    # Copy the path's parents bottom-up so that they point at its new nodes.
    if not path:
        return root
    node = path[-1][1]
    for index in range(len(path) - 1, 0, -1):
        key, parent = path[index][0], path[index - 1][1]
        node = with_children(parent, parent.children.set(key, node))
    return with_children(root, root.children.set(path[0][0], node))


def touch_path(
    root: Node, tokens: Tokens, length: int, page_size: int, clock: int
) -> tuple[Node, Tokens | None]:
    # Every node on tokens[:length] (cached) used at `clock`; a node the path ends inside
    # is split there and its lower part used too (a radix tree's match enters the node,
    # as SGLang's does). Returns the root and, when it split one, the lower part's end.
    path: list[tuple[Tokens, Node]] = []
    node, at, split_end = root, 0, None
    while at < length:
        key = tokens[at : at + page_size]
        child = node.children[key]
        if at + len(child.tokens) > length:
            cut = length - at
            split_end = tokens[:at] + child.tokens
            lower = Node(
                child.tokens[cut:], child.pages[cut // page_size :], child.children,
                child.locks, clock,
            )  # fmt: skip
            child = Node(
                child.tokens[:cut], child.pages[: cut // page_size],
                Map({lower.tokens[:page_size]: lower}), child.locks, clock,
            )  # fmt: skip
        else:
            child = Node(child.tokens, child.pages, child.children, child.locks, clock)
        path.append((key, child))
        node, at = child, at + len(child.tokens)
    return rebuild(root, path), split_end


def update_locks(  # noqa: PLR0917  # a private helper, called twice
    root: Node, tokens: Tokens, length: int, page_size: int, delta: int, clock: int
) -> tuple[Node, int, Node]:
    # Add `delta` locks along tokens[:length] (non-empty); returns the root, the pages
    # whose nodes went from unlocked to locked (or back, for a negative delta), and
    # the updated node that ends at `length`.
    flipped = 0
    updated = []
    for key, node in descend(root, tokens, length, page_size):
        locks = node.locks + delta
        if (node.locks == 0) != (locks == 0):
            flipped += len(node.pages)
        used = max(node.used, clock)
        updated.append((key, Node(node.tokens, node.pages, node.children, locks, used)))
    return rebuild(root, updated), flipped, updated[-1][1]


def insert_tokens(
    root: Node, tokens: Tokens, pages: Sequence[int], page_size: int, clock: int
) -> tuple[Node, int]:
    # Insert tokens (whole pages) at `pages`; returns the root and the cached length before.
    node, at = root, 0
    path: list[tuple[Tokens, Node]] = []
    while at < len(tokens):
        key = tokens[at : at + page_size]
        child = node.children.get(key)
        if child is None:
            break
        common = common_pages(child.tokens, tokens, at, len(tokens), page_size)
        split = common < len(child.tokens)
        if split:
            child = split_node(child, common, page_size)
        path.append((key, Node(child.tokens, child.pages, child.children, child.locks, clock)))
        node, at = child, at + common
        if split:
            break
    if at < len(tokens):
        leaf = Node(tokens[at:], tuple(pages[at // page_size :]), NO_CHILDREN, 0, clock)
        return _with_leaf(root, path, leaf, tokens[at : at + page_size]), at
    return rebuild(root, path), at


def _with_leaf(root: Node, path: list[tuple[Tokens, Node]], leaf: Node, key: Tokens) -> Node:
    # The root with `leaf` added, under `key`, to the last node of the copied `path`.
    if not path:
        return with_children(root, root.children.set(key, leaf))
    last_key, last = path[-1]
    path[-1] = (last_key, with_children(last, last.children.set(key, leaf)))
    return rebuild(root, path)


def release_tokens(  # noqa: PLR0917  # a private helper, called once
    root: Node, read: int, tokens: Tokens, pages: HostArray, page_size: int, clock: int
) -> tuple[Node, int, int, bool]:
    # A row that read (locked) the cached tokens[:read] (0 < read <= len(tokens)) leaves,
    # and tokens (whole pages) go in at `pages`: `update_locks` of -1 then `insert_tokens`
    # in one walk. Returns the root, the cached length before, the pages unlocked, and
    # whether the unlock left the node ending at `read` an unlocked leaf. Only the
    # pages the tree did not hold become ints: most of a row's tokens were published.
    node, at, unlocked, bare = root, 0, 0, False
    path: list[tuple[Tokens, Node]] = []
    while at < len(tokens):
        key = tokens[at : at + page_size]
        child = node.children.get(key)
        if child is None:
            break
        split = False
        if at < read:  # on the read prefix: cached, so no compare; cut where it ends
            if at + len(child.tokens) > read:
                child = split_node(child, read - at, page_size)
            common, locks = len(child.tokens), child.locks - 1
            if not locks:
                unlocked += len(child.pages)
            bare = at + common == read and not child.children and not locks
        else:
            common, locks = (
                common_pages(child.tokens, tokens, at, len(tokens), page_size),
                child.locks,
            )
            split = common < len(child.tokens)
            if split:
                child = split_node(child, common, page_size)
        path.append((key, Node(child.tokens, child.pages, child.children, locks, clock)))
        node, at = child, at + common
        if split:
            break
    if at < len(tokens):
        leaf = Node(tokens[at:], tuple(pages[at // page_size :].tolist()), NO_CHILDREN, 0, clock)
        return _with_leaf(root, path, leaf, tokens[at : at + page_size]), at, unlocked, bare
    return rebuild(root, path), at, unlocked, bare


def remove_leaf(root: Node, prefix: Tokens, page_size: int) -> tuple[Node, Node, Node]:
    # Drop the leaf ending `prefix`; returns the root, the leaf and its parent.
    path: list[tuple[Tokens, Node]] = []
    node, at = root, 0
    while True:
        key = prefix[at : at + page_size]
        leaf = node.children[key]
        at += len(leaf.tokens)
        if at == len(prefix):
            break
        path.append((key, leaf))
        node = leaf
    parent = with_children(node, node.children.delete(key))
    if not path:
        return parent, leaf, parent
    path[-1] = (path[-1][0], parent)
    return rebuild(root, path), leaf, parent
