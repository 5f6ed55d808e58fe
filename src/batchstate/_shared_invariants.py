"""The invariants of pools with the prefix cache on: every page free, cached or in use."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from batchstate._cache_checks import (
    check_inputs,
    check_prefix_paths,
    check_tree,
    prove_rows,
    unread_cells,
)
from batchstate._columns import C
from batchstate._errors import InvariantViolation
from batchstate._hybrid_checks import check_hybrid
from batchstate._mirrored import HostArray
from batchstate._phases import Batch
from batchstate._pools import Pools

__all__ = [
    "check_shared_pools",
    "expect_generations",
    "expect_whole_pages",
    "owned_by_generation",
]


def check_shared_pools(
    pools: Pools, batches: Iterable[Batch[C]] = (), *, compare_device: bool = False
) -> None:
    """Check that every KV page is exactly one of free, cached or in use, and counted right.

    - free (retired included) + cached + private (in use by one row, past its
      prefix) = capacity,
      no page in two of them, page 0 in none, every cached page and every
      page a row reads in 1..num_pages;
    - each slot's cached prefix is whole pages, no longer than its row, and
      its pages are the cache's pages for its tokens; each cached page is
      locked by exactly the rows that read it (its reference count is those
      rows plus the cache's one);
    - the tree is well formed: edges of whole pages, keys their first page,
      a child locked no more than its parent, page totals as counted;
    - slots, and every row of `batches`, as `check_pools` checks them, and a
      row's cached prefix is the start of its `input_ids`.

    Raises:
        InvariantViolation: naming the invariant and the numbers.
    """
    cache, page_size = pools.cache, pools.page_size
    batches = list(batches)
    _expect(
        cache.page_size == page_size,
        f"the cache has pages of {cache.page_size}, the pools of {page_size}",
    )
    # Slot 0, the padding row, is named below; past the table is named here.
    prefixes = pools.prefixes
    slots = np.fromiter(prefixes.keys(), dtype=np.int64, count=len(prefixes))
    outside = sorted(slots[(slots < 0) | (slots > pools.max_reqs)].tolist())
    _expect(not outside, f"prefixes name slots outside 1..{pools.max_reqs}: {outside}")
    tree = check_tree(pools)
    # The tree index checked each cached page to lie in 1..num_pages.
    table, slot_tokens = pools.table.host, pools.slot_tokens
    prefix_lens = np.zeros_like(slot_tokens)
    prefix_lens[slots] = np.fromiter(map(len, prefixes.values()), np.int64, count=len(prefixes))
    _expect(int(prefix_lens[0]) == 0, "padding slot 0 reads a cached prefix")
    # Every slot's pages at once: its row's page-start cells, masked to its tokens.
    starts = np.arange(0, pools.max_context_len, page_size)
    tokens, prefix = slot_tokens[1:, None], prefix_lens[1:, None]
    bad = (prefix % page_size != 0) | (prefix > tokens) | ((tokens == 0) & (prefix != 0))
    _expect_rows(
        bad[:, 0], "cached prefix {} of {} tokens is not whole pages of its row", prefix, tokens
    )
    grid = table[1:, ::page_size].astype(np.int64) // page_size
    held, in_prefix = starts < tokens, starts < prefix
    off_pages = held & ((grid < 1) | (grid > pools.num_pages))
    _expect_rows(np.any(off_pages, axis=1), f"its row reads a KV page outside 1..{pools.num_pages}")
    readers = np.bincount(grid[in_prefix], minlength=pools.num_pages + 1)
    private = [grid[held & ~in_prefix]]
    if not np.array_equal(readers, tree.locks):  # the slow path names the first page
        cached = tree.holders.nonzero()[0]
        locks = dict(zip(cached.tolist(), tree.locks[cached].tolist(), strict=True))
        for page in np.nonzero(readers)[0].tolist():
            _expect(page in locks, f"page {page} is read as a cached prefix but not cached")
        for page, count in locks.items():
            _expect(
                int(readers[page]) == count,
                f"page {page}: locked by {count} rows, read by {int(readers[page])}",
            )
    free = np.concatenate((pools.free_pages, pools.retired))  # retired: free at the next allocation
    every = np.concatenate((free, *private))
    uses = np.bincount(every, minlength=pools.num_pages + 1)
    num_cached = int(tree.holders.sum())
    _expect(
        uses.shape[0] == pools.num_pages + 1
        and int(uses[0]) == 0
        and bool((uses[1:] + tree.holders[1:] == 1).all()),
        f"KV pages: {free.shape[0]} free + {num_cached} cached"
        f" + {every.shape[0] - free.shape[0]} private"
        f" != {pools.num_pages}, or a page is in two states or none",
    )
    _check_slots(pools, batches, compare_device=compare_device)
    if pools.memory.kinds.is_hybrid:  # window pages and state slots, the anchors' counted
        check_hybrid(pools, owned_by_generation(pools))
    check_prefix_paths(pools, tree, np.where(in_prefix, grid, 0), in_prefix)
    for batch in batches:
        check_inputs(pools, batch.rows.req_pool_indices.host, batch.rows.reqs)


def _check_slots(pools: Pools, batches: list[Batch[C]], *, compare_device: bool) -> None:
    # As `check_pools` for slots: each free or owned once, rows laid out in whole
    # pages, every row of `batches` owning its slot at its length.
    max_reqs, table = pools.max_reqs, pools.table.host
    slot_tokens = pools.slot_tokens
    owned = owned_by_generation(pools)
    uses = np.bincount(np.concatenate((pools.free_slots, owned)), minlength=max_reqs + 1)
    _expect(
        int(slot_tokens[0]) == 0 and int(uses[0]) == 0 and bool((uses[1:] == 1).all()),
        f"request slots: {pools.num_free_slots} free + {owned.shape[0]} owned != {max_reqs},"
        " or a slot is both or neither",
    )
    # Rows written or resized since a check found them whole pages; every row when
    # the device is compared (a write around the table's methods shows there).
    expect_whole_pages(pools, owned, unread_cells(pools, owned, every_row=compare_device))
    prove_rows(pools, owned)
    seen: set[int] = set()
    for batch in batches:
        rows = batch.rows
        slots, lens = rows.req_pool_indices.host, rows.seq_lens.host
        in_range = bool(((slots >= 1) & (slots <= max_reqs)).all())
        if not (
            in_range
            and np.unique(slots).shape[0] == slots.shape[0]
            and not seen.intersection(slots.tolist())
            and np.array_equal(slot_tokens[slots], lens)
        ):
            # The slow path, only to name the first offending row.
            for slot, seq_len in zip(slots.tolist(), lens.tolist(), strict=True):
                _expect(slot not in seen, f"slot {slot} is in two rows")
                seen.add(slot)
                _expect(
                    1 <= slot <= max_reqs and int(slot_tokens[slot]) == seq_len,
                    f"slot {slot}: row has {seq_len} tokens, the pools hold another count",
                )
        seen.update(slots.tolist())
        expect_generations(pools, slots, rows.gens)
    if compare_device:
        device_table = pools.table.device.cpu().numpy()
        _expect(np.array_equal(table, device_table), "table: host != device")


def owned_by_generation(pools: Pools) -> HostArray:
    """The owned slots (a generation, or tokens), checked against the tokens they own."""
    # Slot 0 owning tokens is the padding check's to name (as owned, below).
    slot_gens, slot_tokens = pools.slot_gens, pools.slot_tokens
    _expect(int(slot_gens[0]) == 0, "padding slot 0 has a generation")
    orphans = (((slot_tokens[1:] != 0) & (slot_gens[1:] == 0)).nonzero()[0] + 1).tolist()
    _expect(not orphans, f"slots {orphans} own tokens at no generation (free)")
    _expect(
        int(slot_gens.max()) < pools.next_gen,
        f"a slot's generation {int(slot_gens.max())} was never handed out"
        f" (next is {pools.next_gen})",
    )
    owned: HostArray = ((slot_gens != 0) | (slot_tokens != 0)).nonzero()[0]
    return owned


def expect_whole_pages(pools: Pools, owned: HostArray, starts: HostArray) -> None:
    """Raise `InvariantViolation` unless each owned slot's locations fill whole pages in order.

    Reads each slot's cells from its `starts` (a page start) to its length, at
    once: every cell is its page's first location (a multiple of the page
    size) plus its offset in the page. Pages of one token always hold.
    """
    page_size = pools.page_size
    counts = pools.slot_tokens[owned] - starts
    if page_size == 1 or not (counts > 0).any():
        return
    counts = counts.clip(0)
    rows = np.repeat(owned, counts)
    ends = np.cumsum(counts)
    columns = np.arange(int(ends[-1])) - np.repeat(ends - counts - starts, counts)
    offsets = columns % page_size
    cells = pools.table.host[rows, columns].astype(np.int64)
    firsts = pools.table.host[rows, columns - offsets].astype(np.int64)
    wrong = (firsts % page_size != 0) | (cells != firsts + offsets)
    if wrong.any():
        slot = int(rows[int(wrong.argmax())])
        raise InvariantViolation(f"slot {slot}: locations do not fill whole pages")


def expect_generations(pools: Pools, slots: HostArray, gens: HostArray) -> None:
    """Raise `InvariantViolation` unless each of `slots` (in the table) is at `gens`."""
    held = pools.slot_gens[slots.clip(0, pools.max_reqs)]
    if np.array_equal(held, gens):
        return
    for slot, gen, current in zip(slots.tolist(), gens.tolist(), held.tolist(), strict=True):
        _expect(
            gen == current,
            f"slot {slot}: row holds it at generation {gen}, the pools' slot is at"
            f" generation {current} (released and handed out again: the row is stale)",
        )


def _expect_rows(bad: npt.NDArray[np.bool_], message: str, *values: HostArray) -> None:
    # `bad` per slot 1..max_reqs: name the first, with its `values` filled into `message`.
    if bad.any():
        at = int(bad.argmax())
        numbers = message.format(*(int(value[at, 0]) for value in values))
        raise InvariantViolation(f"slot {at + 1}: {numbers}")


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantViolation(message)
