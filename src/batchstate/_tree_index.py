"""The last checked radix tree of a lineage, indexed by KV page, moved to the next by a diff.

Nodes are immutable and shared between cache values: an update copies the
nodes on one root-to-node path and keeps every other. So the tree a check
sees differs from the one the check before saw only along a few paths;
`TreeIndex.move_to` walks those (descending only where the node objects
differ), checks each node it meets for the first time, and updates the
page-indexed arrays, counts and leaf index in place: a cost of what the
steps between the two checks changed.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from batchstate._errors import InvariantViolation
from batchstate._radix_nodes import ROOT, Node, Tokens

__all__ = ["TreeIndex"]


class TreeIndex:
    """What `check_pools` knows of one tree: each page's place in it, counts, unlocked leaves.

    Per page (`[num_pages + 1]`, -1 or 0 where no node holds it): `depth` (its
    index on its root-to-page path), `parent` (the page before it there, 0 for
    none), `tokens` (id() of its node's token tuple: the tree held in `root`
    keeps the tuple alive), `offset` (where its tokens start in that tuple),
    `locks` (its node's) and `holders` (how many places in the tree hold it).
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.root = ROOT
        self.depth = np.full(num_pages + 1, -1, dtype=np.int64)
        self.parent = np.full(num_pages + 1, -1, dtype=np.int64)
        self.tokens = np.zeros(num_pages + 1, dtype=np.int64)
        self.offset = np.full(num_pages + 1, -1, dtype=np.int64)
        self.locks = np.zeros(num_pages + 1, dtype=np.int64)
        self.holders = np.zeros(num_pages + 1, dtype=np.int64)
        self.num_pages = self.num_locked = 0
        # Unlocked leaves: full prefix -> (that prefix, the leaf's `used`).
        self.leaves: dict[Tokens, tuple[Tokens, int]] = {}
        self.leaves_moved = False  # whether `leaves` changed in the last move
        # Pages whose place (depth, parent, tokens, offset) the last move wrote.
        self.touched = np.zeros(num_pages + 1, dtype=np.bool_)
        self._touched: list[npt.NDArray[np.int64]] = []

    def move_to(self, root: Node) -> None:
        """Index `root`'s tree instead; on `InvariantViolation` the index is left half-moved."""
        self.leaves_moved = False
        for pages in self._touched:
            self.touched[pages] = False
        self._touched = []
        for key, child in root.children.items():
            before = self.root.children.get(key)
            if before is child:
                continue
            if before is None:
                self._add(child, (), 0, 0)
            else:
                self._move(before, child, (), 0, 0)
        for key, child in self.root.children.items():
            if key not in root.children:
                self._remove(child, ())
        self.root = root

    def _move(self, old: Node, new: Node, above: Tokens, depth: int, parent: int) -> None:
        # `old` and `new` sit at the same place (the same keys from the root, above
        # them edges of the same tokens, so the same depth), and are not one object.
        if old.tokens is not new.tokens and old.tokens != new.tokens:
            # What lies below has other prefixes: redo it whole.
            self._remove(old, above)
            self._add(new, above, depth, parent)
            return
        if old.tokens is new.tokens and old.pages == new.pages:
            self._relock(old, new, above)  # its pages keep their places
        else:
            self._remove_own(old, above)
            self._add_own(new, above, depth, parent)
        below, after = above + new.tokens, depth + len(new.pages)
        last = new.pages[-1]
        moved_last = last != old.pages[-1]
        for key, child in new.children.items():
            before = old.children.get(key)
            if before is child:  # the same subtree at the same depth: its parent page only
                if moved_last:
                    self.parent[child.pages[0]] = last
                    self.touched[child.pages[0]] = True
                    self._touched.append(np.array(child.pages[:1], dtype=np.int64))
            elif before is None:
                self._add(child, below, after, last)
            else:
                self._move(before, child, below, after, last)
        for key, child in old.children.items():
            if key not in new.children:
                self._remove(child, below)

    def _add(self, node: Node, above: Tokens, depth: int, parent: int) -> None:
        self._add_own(node, above, depth, parent)
        below, after = above + node.tokens, depth + len(node.pages)
        for child in node.children.values():
            self._add(child, below, after, node.pages[-1])

    def _remove(self, node: Node, above: Tokens) -> None:
        self._remove_own(node, above)
        below = above + node.tokens
        for child in node.children.values():
            self._remove(child, below)

    def _relock(self, old: Node, new: Node, above: Tokens) -> None:
        # The same edge and pages, other locks or children.
        self._validate(new, above, old)
        at = np.array(new.pages, dtype=np.int64)
        self.locks[at] = new.locks
        self.num_locked += (len(at) if new.locks else 0) - (len(at) if old.locks else 0)
        was_leaf, is_leaf = not old.children and not old.locks, not new.children and not new.locks
        if was_leaf or is_leaf:
            prefix = above + new.tokens
            self.leaves.pop(prefix, None)
            if is_leaf:
                self.leaves[prefix] = (prefix, new.used)
            self.leaves_moved = True

    def _validate(self, node: Node, above: Tokens, old: Node | None = None) -> None:
        # `old`: the node `node` replaces, already valid: its children need no second
        # look at their keys.
        tokens, pages, page_size = node.tokens, node.pages, self.page_size
        end = len(above) + len(tokens)
        _expect(
            len(tokens) > 0
            and len(tokens) % page_size == 0
            and len(pages) == len(tokens) // page_size,
            f"cache node at {end} tokens: edge of {len(tokens)} tokens, {len(pages)} pages",
        )
        known = old.children if old is not None else None
        locks = node.locks
        for key, child in node.children.items():
            if (known is None or known.get(key) is not child) and key != child.tokens[:page_size]:
                raise InvariantViolation("a cache node is keyed by other tokens")
            if child.locks > locks:
                raise InvariantViolation("a cache node is locked more than its parent")
        _expect(node.locks >= 0, "a cache node has negative locks")

    def _add_own(self, node: Node, above: Tokens, depth: int, parent: int) -> None:
        self._validate(node, above)
        tokens, pages, page_size = node.tokens, node.pages, self.page_size
        at = np.array(pages, dtype=np.int64)
        num_pages = self.depth.shape[0] - 1
        _expect(
            bool(((at >= 1) & (at <= num_pages)).all()),
            f"the cache holds a KV page outside 1..{num_pages}",
        )
        count = len(pages)
        self.touched[at] = True
        self._touched.append(at)
        self.holders[at] += 1
        self.depth[at] = np.arange(depth, depth + count)
        self.parent[at[0]] = parent
        self.parent[at[1:]] = at[:-1]
        self.tokens[at] = id(tokens)
        self.offset[at] = np.arange(0, count * page_size, page_size)
        self.locks[at] = node.locks
        self.num_pages += count
        self.num_locked += count if node.locks else 0
        if not node.children and not node.locks:
            prefix = above + tokens
            self.leaves[prefix] = (prefix, node.used)
            self.leaves_moved = True

    def _remove_own(self, node: Node, above: Tokens) -> None:
        at = np.array(node.pages, dtype=np.int64)
        self.touched[at] = True
        self._touched.append(at)
        self.holders[at] -= 1
        gone = at[self.holders[at] == 0]
        self.depth[gone] = self.parent[gone] = self.offset[gone] = -1
        self.tokens[gone] = self.locks[gone] = 0
        self.num_pages -= len(node.pages)
        self.num_locked -= len(node.pages) if node.locks else 0
        if not node.children and not node.locks:
            self.leaves.pop(above + node.tokens, None)
            self.leaves_moved = True


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantViolation(message)
