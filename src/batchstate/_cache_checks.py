"""`check_pools`' prefix cache checks, incremental: what was proven once is not proven again.

Three facts are kept per pools lineage, each about immutable values only,
so none can go stale: a tree node's summary (`_tree_summaries`), "this
prefix tuple spells these token tuples at these offsets" for each slot,
and "this request's input starts with this prefix tuple" for each row.
Everything a later write could change (the table, the free lists, the
counts, which pages a row reads, each page's place in the tree) is read
again at every check. A check therefore costs what the step changed, plus
a few array passes over the pages and the table's page-start cells.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from batchstate._errors import InvariantViolation
from batchstate._lineage import Stamp
from batchstate._mirrored import HostArray
from batchstate._pools import Pools
from batchstate._prefix_cache import PrefixCache, Tokens
from batchstate._rows import Req
from batchstate._tree_index import TreeIndex

__all__ = [
    "check_inputs",
    "check_prefix_paths",
    "check_tree",
    "prove_rows",
    "unread_cells",
]


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
    proven = _PROVEN.get(pools._stamp)
    if (
        proven is None
        or proven.page_size != pools.page_size
        or proven.table is not pools.table
        or proven.lens.shape[0] != pools.max_reqs + 1
        or proven.tree.depth.shape[0] != pools.num_pages + 1
    ):
        proven = _PROVEN[pools._stamp] = _Proven(pools)
    return proven


def unread_cells(pools: Pools, owned: HostArray, *, every_row: bool) -> HostArray:
    """Per owned slot, the first cell to read: from where a write or a longer row began.

    Cells before it were read by an earlier check and found whole pages, and
    no `TokenTable.write*` wrote them since. Rounded down to a page start.
    """
    if every_row:
        return np.zeros_like(owned)
    proven = _proven(pools)
    first: HostArray = np.minimum(proven.lens[owned], pools.table._written_from[owned])
    return first - first % pools.page_size


def prove_rows(pools: Pools, owned: HostArray) -> None:
    """Record that `owned`'s cells were read and found whole pages, as they are now."""
    _proven(pools).lens[owned] = pools.slot_tokens[owned]
    pools.table._mark_read(owned)


def check_tree(pools: Pools) -> TreeIndex:
    """The tree indexed by page, its shape, counts and index of unlocked leaves checked."""
    cache, proven = pools.cache, _proven(pools)
    tree = proven.tree
    try:
        tree.move_to(cache._root)
    except InvariantViolation:
        del _PROVEN[pools._stamp]  # the index is half-moved: the next check starts afresh
        raise
    _expect(
        tree.num_pages == cache.num_pages and tree.num_locked == cache.num_locked,
        f"cache counts {cache.num_pages} pages ({cache.num_locked} locked),"
        f" the tree holds {tree.num_pages} ({tree.num_locked})",
    )
    # The cache's dict is copied on change, never written: the dict found equal last
    # time still equals leaves that did not move.
    if tree.leaves_moved or proven.leaves is not cache._leaves:
        _expect(
            _same_leaves(proven, cache._leaves, tree),
            "the cache's index of unlocked leaves (what eviction pops) differs from its tree",
        )
        proven.leaves = cache._leaves
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
    node, length, page_size = cache._root, 0, cache.page_size
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


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantViolation(message)
