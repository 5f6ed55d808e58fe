"""`check_pools`' prefix cache checks: a tree index moved by diffs, and the checks it serves.

The last checked radix tree of a lineage, indexed by KV page, is moved to the
next by a diff: nodes are immutable and shared between cache values (an
update copies the nodes on one root-to-node path and keeps every other), so
the tree a check sees differs from the one the check before saw only along a
few paths; `TreeIndex.move_to` walks those (descending only where the node
objects differ), checks each node it meets for the first time, and updates
the page-indexed arrays, counts and leaf index in place: a cost of what the
steps between the two checks changed.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from batchstate.base.errors import InvariantViolation
from batchstate.base.mirrored import HostArray
from batchstate.cache.prefix_cache import PrefixCache
from batchstate.cache.radix import ROOT, Node, Tokens
from batchstate.pools.lineage import Stamp
from batchstate.pools.pools import Pools
from batchstate.records.rows import Req

__all__ = [
    "TreeIndex",
    "check_inputs",
    "check_prefix_paths",
    "check_tree",
    "prove_rows",
    "unread_cells",
]


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


# `check_pools`' prefix cache checks, incremental: what was proven once is not proven again.
#
# Three facts are kept per pools lineage, each about immutable values only,
# so none can go stale: a tree node's summary (`_tree_summaries`), "this
# prefix tuple spells these token tuples at these offsets" for each slot,
# and "this request's input starts with this prefix tuple" for each row.
# Everything a later write could change (the table, the free lists, the
# counts, which pages a row reads, each page's place in the tree) is read
# again at every check. A check therefore costs what the step changed, plus
# a few array passes over the pages and the table's page-start cells.


class _Proven:
    """What earlier checks of one lineage proved, each fact about immutable values."""

    def __init__(self, pools: Pools) -> None:
        self.page_size = pools.page_size
        self.tree = TreeIndex(pools.num_pages, pools.page_size)
        self.leaves: dict[Tokens, int] = {}  # the cache's index of leaves last found equal
        self.leaf_pairs: dict[int, tuple[Tokens, Tokens]] = {}  # its keys, the tree's equal ones
        rows, columns = pools.max_reqs, -(-pools.max_context_len // pools.page_size)
        self.prefixes: list[Tokens | None] = [None] * rows  # slot s at s - 1
        self.prefix_ids = np.zeros(rows, dtype=np.int64)  # their id()s
        self.pages = np.zeros((rows, columns), dtype=np.int64)  # the pages they were read at
        self.tokens = np.zeros((rows, columns), dtype=np.int64)  # id()s of token tuples
        self.offsets = np.zeros((rows, columns), dtype=np.int64)
        self.held: list[tuple[Tokens, ...]] = [()] * rows  # those tuples, so the ids stay theirs
        self.inputs: dict[int, tuple[Req, Tokens]] = {}  # per slot, a row found reading right
        self.req_ids = np.zeros(rows + 1, dtype=np.int64)  # their id()s
        self.read_ids = np.zeros(rows + 1, dtype=np.int64)
        # Per slot, the cells of its row last read and found whole pages (0: none).
        self.table = pools.table
        self.lens = np.zeros(rows + 1, dtype=np.int64)


_PROVEN: weakref.WeakKeyDictionary[Stamp, _Proven] = weakref.WeakKeyDictionary()


def _proven(pools: Pools) -> _Proven:
    proven = _PROVEN.get(pools.stamp)
    if (
        proven is None
        or proven.page_size != pools.page_size
        or proven.table is not pools.table
        or proven.lens.shape[0] != pools.max_reqs + 1
        or proven.tree.depth.shape[0] != pools.num_pages + 1
    ):
        proven = _PROVEN[pools.stamp] = _Proven(pools)
    return proven


def unread_cells(pools: Pools, owned: HostArray, *, every_row: bool) -> HostArray:
    """Per owned slot, the first cell to read: from where a write or a longer row began.

    Cells before it were read by an earlier check and found whole pages, and
    no `TokenTable.write*` wrote them since. Rounded down to a page start.
    """
    if every_row:
        return np.zeros_like(owned)
    proven = _proven(pools)
    first: HostArray = np.minimum(proven.lens[owned], pools.table.written_from[owned])
    return first - first % pools.page_size


def prove_rows(pools: Pools, owned: HostArray) -> None:
    """Record that `owned`'s cells were read and found whole pages, as they are now."""
    _proven(pools).lens[owned] = pools.slot_tokens[owned]
    pools.table.mark_read(owned)


def check_tree(pools: Pools) -> TreeIndex:
    """The tree indexed by page, its shape, counts and index of unlocked leaves checked."""
    cache, proven = pools.cache, _proven(pools)
    tree = proven.tree
    try:
        tree.move_to(cache.root)
    except InvariantViolation:
        del _PROVEN[pools.stamp]  # the index is half-moved: the next check starts afresh
        raise
    _expect(
        tree.num_pages == cache.num_pages and tree.num_locked == cache.num_locked,
        f"cache counts {cache.num_pages} pages ({cache.num_locked} locked),"
        f" the tree holds {tree.num_pages} ({tree.num_locked})",
    )
    # The cache's dict is copied on change, never written: the dict found equal last
    # time still equals leaves that did not move.
    if tree.leaves_moved or proven.leaves is not cache.leaves:
        _expect(
            _same_leaves(proven, cache.leaves, tree),
            "the cache's index of unlocked leaves (what eviction pops) differs from its tree",
        )
        proven.leaves = cache.leaves
    return tree


def _same_leaves(proven: _Proven, leaves: dict[Tokens, int], tree: TreeIndex) -> bool:
    # `leaves == tree.leaves`, without hashing long prefixes found equal before: a key
    # object paired with an equal prefix object of the tree index stays equal (both
    # immutable, both held in `proven`).
    if len(leaves) != len(tree.leaves):
        return False
    indexed = {id(prefix): (prefix, used) for prefix, used in tree.leaves.values()}
    pairs: dict[int, tuple[Tokens, Tokens]] = {}
    for key, used in leaves.items():
        known = proven.leaf_pairs.get(id(key))
        if known is not None and known[0] is key and id(known[1]) in indexed:
            prefix = known[1]
        else:
            found = tree.leaves.get(key)
            if found is None:
                return False
            prefix = found[0]
        if indexed.pop(id(prefix), (None, None))[1] != used:  # gone: two keys, one leaf
            return False
        pairs[id(key)] = (key, prefix)
    proven.leaf_pairs = pairs
    return True


def check_prefix_paths(
    pools: Pools, tree: TreeIndex, pages: HostArray, in_prefix: npt.NDArray[np.bool_]
) -> None:
    """Each slot's cached prefix is the cache's pages for its tokens, as the tree holds them.

    `pages`: each slot's page ids (slots 1.., a column per page) in its cached
    prefix, 0 past it; `in_prefix`: those cells, already checked to be cached
    pages. Only rows whose prefix, pages, or pages' places in the tree changed
    since they were last proven are read.
    """
    proven, prefixes = _proven(pools), pools.prefixes
    slots = np.fromiter(prefixes.keys(), dtype=np.int64, count=len(prefixes))
    ids = np.fromiter(map(id, prefixes.values()), dtype=np.int64, count=len(prefixes))
    changed = (pages != proven.pages).any(axis=1)
    if tree.touched.any():
        changed |= tree.touched[pages].any(axis=1)
    # The prefixes held in `proven` live, so an equal id is the same tuple.
    look = slots[changed[slots - 1] | (proven.prefix_ids[slots - 1] != ids)]
    if not look.shape[0]:
        return
    look.sort()
    rows = look - 1
    read, within = pages[rows], in_prefix[rows]
    before = np.zeros_like(read)
    before[:, 1:] = read[:, :-1]
    columns = np.arange(read.shape[1])
    path = (tree.depth[read] == columns) & (tree.parent[read] == before)
    wrong_path = (within & ~path).any(axis=1)
    tokens = np.where(within, tree.tokens[read], 0)
    offsets = np.where(within, tree.offset[read], 0)
    spelled_before = (tokens == proven.tokens[rows]).all(axis=1) & (
        offsets == proven.offsets[rows]
    ).all(axis=1)
    for at, slot in enumerate(look.tolist()):
        row, prefix_ids = slot - 1, prefixes[slot]
        if prefix_ids and (
            wrong_path[at] or not _still_spelled(proven, row, prefix_ids, spelled_before[at])
        ):
            spelled = None if wrong_path[at] else _walk(pools.cache, prefix_ids)
            count = len(prefix_ids) // pools.page_size
            if spelled is None or spelled[0] != read[at, :count].tolist():
                raise InvariantViolation(
                    f"slot {slot}: its cached prefix is not the cache's pages for its tokens"
                )
            proven.prefixes[row], proven.held[row] = prefix_ids, spelled[1]
            proven.tokens[row], proven.offsets[row] = tokens[at], offsets[at]
        proven.prefix_ids[row] = id(prefix_ids)
        proven.pages[row] = read[at]


def _still_spelled(proven: _Proven, row: int, prefix_ids: Tokens, same_places: bool) -> bool:
    # The same prefix tuple, over the same token tuples at the same offsets.
    return bool(same_places) and proven.prefixes[row] is prefix_ids


def check_inputs(pools: Pools, slots: HostArray, reqs: Sequence[Req]) -> None:
    """Each row's cached prefix (slots checked in range) is the start of its request's input."""
    proven, prefixes = _proven(pools), pools.prefixes
    read_ids = np.full(pools.max_reqs + 1, id(()), dtype=np.int64)
    read_ids[np.fromiter(prefixes.keys(), np.int64, len(prefixes))] = np.fromiter(
        map(id, prefixes.values()), np.int64, len(prefixes)
    )
    req_ids = np.fromiter(map(id, reqs), np.int64, len(reqs))
    # The pairs held in `proven` live, so equal ids are the same objects.
    new = (proven.req_ids[slots] != req_ids) | (proven.read_ids[slots] != read_ids[slots])
    for row in new.nonzero()[0].tolist():
        slot, req = int(slots[row]), reqs[row]
        read = prefixes.get(slot, ())
        _expect(
            req.input_ids[: len(read)] == read,
            f"slot {slot}: its cached prefix is not the start of request {req.rid}'s input",
        )
        proven.inputs[slot] = (req, read)
        proven.req_ids[slot], proven.read_ids[slot] = id(req), id(read)


def _walk(cache: PrefixCache, prefix_ids: Tokens) -> tuple[list[int], tuple[Tokens, ...]] | None:
    # The pages the cache holds for all of `prefix_ids` (whole pages), and the token
    # tuples of the nodes on the way; None if it does not hold them all.
    node, length, page_size = cache.root, 0, cache.page_size
    pages: list[int] = []
    spelled: list[Tokens] = []
    while length < len(prefix_ids):
        child = node.children.get(prefix_ids[length : length + page_size])
        span = prefix_ids[length : length + len(child.tokens)] if child is not None else ()
        if child is None or not span or child.tokens[: len(span)] != span:
            return None
        pages.extend(child.pages[: len(span) // page_size])
        spelled.append(child.tokens)
        node, length = child, length + len(span)
    return pages, tuple(spelled)
