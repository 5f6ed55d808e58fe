"""The invariants every record and pool holds, checked on demand: `check_batch`, `check_pools`.

With the prefix cache on, every page is free, cached or in use, and counted
so; each record's rows are owned by the pools at their lengths and
generations; every host mirror equals its device side when asked to compare.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from batchstate.base.errors import InvariantViolation, PhaseError, RecordShapeError
from batchstate.base.mirrored import HostArray, Mirrored, torch_dtype
from batchstate.checks.cache import (
    check_inputs,
    check_prefix_paths,
    check_tree,
    prove_rows,
    unread_cells,
)
from batchstate.checks.hybrid import check_hybrid
from batchstate.columns.columns import C, layout
from batchstate.pools.pools import Pools, expect_pools
from batchstate.records.phases import Batch, Decoding, Extended
from batchstate.records.rows import GENS, NUM_INTS, RIDS, SEQ_LENS, SLOTS, Rows, check_columns

__all__ = [
    "check_batch",
    "check_pools",
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


# The invariants every record and pool holds, checked on demand.


def check_batch(batch: Batch[C], *, compare_device: bool = False) -> None:
    """Check a record's invariants; `compare_device` also compares mirrors (it syncs).

    With `compare_device`, every `Mirrored` the rows hold (`req_pool_indices`,
    `seq_lens`, each mirrored column of their column set) must equal its
    device side in dtype and values and, on a CPU device, share no memory
    with it; `orig_seq_lens` must equal `seq_lens`, and an extend's or
    decode's `out_cache_loc` hold no location twice. The message names the
    column.

    Raises:
        InvariantViolation: naming the invariant and the numbers.
        PhaseError: `batch` is not a batch with rows (a `Verifying`,
            `Departed`, `Chunked` or `Sampled`, say).
    """
    rows = getattr(batch, "rows", None)
    if not isinstance(rows, Rows):
        raise PhaseError(
            "check_batch takes Idle, Extended, Decoding, Filtered or Mixed,"
            f" got {type(batch).__name__}"
        )
    num_reqs = len(rows.reqs)
    try:
        check_columns(rows)  # transitions build Rows without running it
    except RecordShapeError as error:
        raise InvariantViolation(str(error)) from error
    _expect(rows.rids.tolist() == [req.rid for req in rows.reqs], "rids differ from the reqs' rids")
    _expect_packed(rows)
    seq_lens = rows.seq_lens.host
    _expect(
        rows.seq_lens_sum == int(seq_lens.sum()),
        f"seq_lens_sum={rows.seq_lens_sum}, seq_lens sum to {int(seq_lens.sum())}",
    )
    _expect(
        rows.max_seq_len == (int(seq_lens.max()) if num_reqs else 0),
        f"max_seq_len={rows.max_seq_len} differs from seq_lens",
    )
    if isinstance(batch, Extended):
        _expect(
            np.array_equal(batch.prefix_lens + batch.extend_lens, seq_lens),
            "seq_lens differ from prefix_lens + extend_lens",
        )
    if compare_device:
        columns = rows.columns
        mirrors: list[tuple[str, Mirrored]] = [
            ("req_pool_indices", rows.req_pool_indices),
            ("seq_lens", rows.seq_lens),
        ]
        mirrors += [
            (f"columns.{name}", getattr(columns, name))
            for group in layout(type(columns)).mirrored
            for name in group.names
        ]
        for name, pair in mirrors:
            same = pair.device.dtype == torch_dtype(pair.host.dtype) and np.array_equal(
                pair.host, pair.device.cpu().numpy()
            )
            _expect(same, f"{name}: host mirror != device")
            _expect(
                pair.device.device.type != "cpu"
                or not np.shares_memory(pair.host, pair.device.numpy()),
                f"{name}: the device side shares the host side's memory",
            )
        orig = rows.orig_seq_lens.device.cpu().numpy()
        _expect(np.array_equal(orig, seq_lens), "orig_seq_lens != seq_lens")
        if isinstance(batch, Decoding | Extended):
            locs = batch.out_cache_loc.device.cpu().numpy()
            _expect(np.unique(locs).shape == locs.shape, "out_cache_loc repeats a location")


def check_pools(
    pools: Pools, batches: Iterable[Batch[C]] = (), *, compare_device: bool = False
) -> None:
    """Check conservation: free + owned = capacity, nothing owned twice.

    A slot is owned from its allocation (a generation other than 0) and
    free otherwise. Every row of `batches` must own its slot with exactly
    `seq_len` tokens, at the row's generation. `compare_device` also
    compares the table's two sides (it syncs). With the prefix cache on,
    free + cached + private = capacity instead, and the cache's tree and
    locks are checked too (see `check_shared_pools`). Hybrid pools conserve
    each kind too: window pages and state slots, free + held by owned slots
    = capacity, none held by a free slot.

    Raises:
        InvariantViolation: naming the invariant and the numbers.
        StalePools: `pools` is not the newest pools (a later value holds
            the truth; this one's table is no longer its own).
    """
    expect_pools(pools)
    if pools.cache.enabled:
        check_shared_pools(pools, batches, compare_device=compare_device)
        return
    max_reqs, page_size = pools.max_reqs, pools.page_size
    slot_tokens = pools.slot_tokens
    _expect(int(slot_tokens[0]) == 0, "padding slot 0 owns tokens")
    owned_slots = owned_by_generation(pools)
    slot_uses = np.bincount(np.concatenate((pools.free_slots, owned_slots)), minlength=max_reqs + 1)
    _expect(
        slot_uses.shape[0] == max_reqs + 1
        and int(slot_uses[0]) == 0
        and bool((slot_uses[1:] == 1).all()),
        f"request slots: {pools.num_free_slots} free + {owned_slots.shape[0]} owned"
        f" != {max_reqs}, or a slot is both or neither",
    )
    if pools.memory.kinds.is_hybrid:  # window pages and state slots, each conserved
        check_hybrid(pools, owned_slots)
    table = pools.table.host
    owned_pages = [
        table[slot, 0 : int(slot_tokens[slot]) : page_size].astype(np.int64) // page_size
        for slot in owned_slots.tolist()
    ]
    for slot, pages in zip(owned_slots.tolist(), owned_pages, strict=True):
        tokens = table[slot, : int(slot_tokens[slot])].astype(np.int64)
        expected = np.repeat(pages, page_size)[: tokens.shape[0]] * page_size + (
            np.arange(tokens.shape[0]) % page_size
        )
        _expect(
            np.array_equal(tokens, expected),
            f"slot {slot}: token locations do not fill whole pages",
        )
    every_page = np.concatenate((pools.free_pages, pools.retired, *owned_pages))
    num_free_pages = pools.free_pages.shape[0] + pools.retired.shape[0]
    page_uses = np.bincount(every_page, minlength=pools.num_pages + 1)
    _expect(
        page_uses.shape[0] == pools.num_pages + 1
        and int(page_uses[0]) == 0
        and bool((page_uses[1:] == 1).all()),
        f"KV pages: {num_free_pages} free + {every_page.shape[0] - num_free_pages}"
        f" owned != {pools.num_pages}, or a page is owned twice or lost",
    )
    seen: set[int] = set()
    for batch in batches:
        slots = batch.rows.req_pool_indices.host.tolist()
        for slot, seq_len in zip(slots, batch.rows.seq_lens.host.tolist(), strict=True):
            _expect(slot not in seen, f"slot {slot} is in two rows")
            seen.add(slot)
            _expect(
                1 <= slot <= max_reqs and int(slot_tokens[slot]) == seq_len,
                f"slot {slot}: row has {seq_len} tokens, the pools hold"
                f" {int(slot_tokens[slot]) if 1 <= slot <= max_reqs else 'none'}",
            )
        expect_generations(pools, batch.rows.req_pool_indices.host, batch.rows.gens)
    if compare_device:
        device_table = pools.table.device.cpu().numpy()
        _expect(np.array_equal(pools.table.host, device_table), "table: host != device")


def _expect_packed(rows: Rows[C]) -> None:
    # `ints` holds the four int64 host columns that the fields show, one row each.
    ints = rows.ints
    shape = (NUM_INTS, len(rows.reqs))
    _expect(
        ints.shape == shape and ints.dtype == np.int64 and not ints.flags.writeable,
        f"Rows.ints: expected a read-only int64 array {list(shape)}",
    )
    columns = (
        (SEQ_LENS, "seq_lens.host", rows.seq_lens.host),
        (SLOTS, "req_pool_indices.host", rows.req_pool_indices.host),
        (RIDS, "rids", rows.rids),
        (GENS, "gens", rows.gens),
    )
    for row, name, host in columns:
        _expect(np.array_equal(ints[row], host), f"Rows.ints row {row} differs from {name}")
