"""The invariants every record and pool holds, checked on demand."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from batchstate._columns import C
from batchstate._errors import InvariantViolation, PhaseError, RecordShapeError
from batchstate._hybrid_checks import check_hybrid
from batchstate._mirrored import torch_dtype
from batchstate._phases import Batch, Decoding, Extended
from batchstate._pools import Pools, expect_pools
from batchstate._row_checks import check_columns
from batchstate._rows import GENS, NUM_INTS, RIDS, SEQ_LENS, SLOTS, Rows
from batchstate._shared_invariants import (
    check_shared_pools,
    expect_generations,
    owned_by_generation,
)

__all__ = ["check_batch", "check_pools"]


def check_batch(batch: Batch[C], *, compare_device: bool = False) -> None:
    """Check a record's invariants; `compare_device` also compares mirrors (it syncs).

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
        for name, pair in (
            ("req_pool_indices", rows.req_pool_indices),
            ("seq_lens", rows.seq_lens),
        ):
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


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantViolation(message)
