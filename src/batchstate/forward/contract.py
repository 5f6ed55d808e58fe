"""The forward's contract, checked for a record about to run: what any attention kernel may assume.

When a forward starts, every cell below a row's prefix length holds KV an
earlier forward wrote, and the forward writes exactly `out_cache_loc`, none
of it a cell some row reads as its prefix. A kernel may then read the
prefix and write the new KV in either order: SGLang's FlashInfer ragged
path and FlashAttention's varlen path attend over the step's own keys and
over the paged prefix before the write, a paged kernel writes each layer's
KV and then reads everything through the table (docs/design.md, "The
forward's contract").

`check_forward` verifies it for one record and the pools its transition
returned, on the host, but for one read: the locations an extend or mixed
forward writes, which only its device side holds.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from batchstate.base.errors import (
    ForwardInputsError,
    InvariantViolation,
    PhaseError,
    RecordShapeError,
)
from batchstate.base.mirrored import HostArray
from batchstate.checks.invariants import expect_generations
from batchstate.columns.columns import C
from batchstate.forward.hybrid import hybrid_inputs
from batchstate.forward.inputs import ForwardPhase, forward_inputs, row_layout
from batchstate.pools.pools import Pools, expect_pools
from batchstate.records.mixed import Mixed
from batchstate.records.phases import Decoding, Extended, Idle
from batchstate.records.verifying import Verifying

__all__ = ["check_forward"]


def check_forward(batch: ForwardPhase[C] | Verifying[C], pools: Pools) -> None:
    """Check that `batch`'s forward keeps the forward's contract on `pools`; it is about to run.

    `pools` are the ones `batch`'s transition returned (or, for a verify
    window, its successors). Checked, for every row of the forward:

    - its slot holds exactly the row's tokens after the forward, at the
      row's generation;
    - each cell below its prefix length points at a page an earlier forward
      wrote: a page the pools hold (not free, not retired, not the padding
      page 0);
    - no location of `out_cache_loc` is written twice, and each is the row's
      own cell at that position or, where the row moved onto the prefix
      cache's copy of a page, a retired page (written, read by no row);
    - no cell below any row's prefix length is a location `out_cache_loc`
      writes;
    - on hybrid pools, the same for the window layers (a window's prefix
      cells against the window locations written), and the copies from the
      cache's anchors read no window page or state slot the forward writes.

    It reads `out_cache_loc` from the device (one copy, which waits for
    the device: for tests and periodic checks, as
    `check_batch(..., compare_device=True)`), but for a `Verifying`, whose
    locations are mirrored. On `meta`, which holds no values, a
    `Decoding`'s locations are its table cells (`decode` writes both from
    one host array) and an `Extended` or `Mixed` is refused. `Idle` runs
    no forward: nothing to check.

    Raises:
        InvariantViolation: naming the row, its request and slot, the
            position and the location that break the contract.
        PhaseError: `batch` runs no forward (a `Filtered`, say).
        RecordShapeError: an extend or mixed record on `meta`, whose
            locations no one can read.
        StalePools: `pools` is not the newest pools.
    """
    if isinstance(batch, Idle):
        return
    if not isinstance(batch, Extended | Decoding | Mixed | Verifying):
        raise PhaseError(
            "check_forward takes Idle, Extended, Decoding, Mixed or Verifying,"
            f" got {type(batch).__name__}"
        )
    expect_pools(pools)
    try:
        slots_pair, prefix, extend, seq, _ = row_layout(batch, pools.table, pools.slot_tokens)
    except ForwardInputsError as error:  # a verify window the pools do not hold
        raise InvariantViolation(f"check_forward: {error}") from error
    slots = slots_pair.host
    rids = batch.rids if isinstance(batch, Verifying) else batch.rows.rids
    gens = batch.gens if isinstance(batch, Verifying) else batch.rows.gens
    _expect_held(pools, slots, seq, rids)
    expect_generations(pools, slots, gens)
    locs = _written(batch, pools, slots, seq)
    rows = _Rows(slots, rids, prefix, extend)
    _expect_written_once(pools, rows, locs)
    _expect_prefix_unwritten(pools, rows, locs)
    if pools.memory.kinds.is_hybrid:
        _expect_hybrid(batch, pools, rows)


class _Rows:
    # The forward's rows: slots, request ids, prefix and query lengths, and each token's
    # row and position, host arrays.
    def __init__(self, slots: HostArray, rids: HostArray, prefix: HostArray, extend: HostArray):
        self.slots, self.rids = slots, rids
        self.prefix, self.extend = prefix.astype(np.int64), extend.astype(np.int64)
        self.token_rows, self.positions = _spans(self.prefix, self.extend)

    def name(self, row: int) -> str:
        return f"row {row} (request {int(self.rids[row])}, slot {int(self.slots[row])})"

    def prefix_cells(self) -> tuple[HostArray, HostArray]:
        # Each prefix cell's row and position, every row's `[0, prefix)` back to back.
        return _spans(np.zeros_like(self.prefix), self.prefix)


def _expect_held(pools: Pools, slots: HostArray, seq: HostArray, rids: HostArray) -> None:
    inside = (slots >= 1) & (slots <= pools.max_reqs)
    held = np.where(inside, pools.slot_tokens[np.where(inside, slots, 0)], -1)
    wrong = held != seq
    if wrong.any():
        row = int(wrong.argmax())
        raise InvariantViolation(
            f"check_forward: row {row} (request {int(rids[row])}, slot {int(slots[row])})"
            f" runs to {int(seq[row])} tokens, the pools hold"
            f" {int(held[row]) if held[row] >= 0 else 'none'} in its slot: pass the pools"
            " its transition returned"
        )


def _written(
    batch: Extended[C] | Decoding[C] | Mixed[C] | Verifying[C],
    pools: Pools,
    slots: HostArray,
    seq: HostArray,
) -> HostArray:
    # The locations the forward writes, on the host.
    if isinstance(batch, Verifying):
        return batch.out_cache_loc.host
    device = batch.out_cache_loc.device
    if device.device.type == "meta":
        if isinstance(batch, Decoding):  # decode wrote the table's cells from the same array
            return pools.table.host[slots, seq - 1].astype(np.int64)
        raise RecordShapeError(
            f"check_forward: {type(batch).__name__} on meta holds no locations to read"
        )
    # NOTE: the one device read: the locations exist only on the device.
    return device.to("cpu", torch.int64).numpy()


def _expect_written_once(pools: Pools, rows: _Rows, locs: HostArray) -> None:
    # Every location once, each the row's cell at its position or a retired page's.
    page_size = pools.page_size
    if locs.shape[0] != rows.positions.shape[0]:
        raise InvariantViolation(
            f"check_forward: {locs.shape[0]} locations written for {rows.positions.shape[0]} tokens"
        )
    outside = (locs < page_size) | (locs >= pools.kv_cache_size)
    if outside.any():
        token = int(outside.argmax())
        raise InvariantViolation(
            f"check_forward: {rows.name(int(rows.token_rows[token]))} writes position"
            f" {int(rows.positions[token])} at location {int(locs[token])}, outside the"
            f" pages 1..{pools.num_pages}"
        )
    order = np.argsort(locs, kind="stable")
    twice = np.flatnonzero(locs[order][1:] == locs[order][:-1])
    if twice.shape[0]:
        first, second = int(order[twice[0]]), int(order[twice[0] + 1])
        raise InvariantViolation(
            f"check_forward: location {int(locs[first])} is written twice: by"
            f" {rows.name(int(rows.token_rows[first]))} at position"
            f" {int(rows.positions[first])} and by {rows.name(int(rows.token_rows[second]))}"
            f" at position {int(rows.positions[second])}"
        )
    cells = pools.table.host[rows.slots[rows.token_rows], rows.positions].astype(np.int64)
    retired = np.zeros(pools.num_pages + 1, dtype=bool)
    retired[pools.retired] = True
    elsewhere = (cells != locs) & ~retired[locs // page_size]
    if elsewhere.any():
        token = int(elsewhere.argmax())
        raise InvariantViolation(
            f"check_forward: {rows.name(int(rows.token_rows[token]))} writes position"
            f" {int(rows.positions[token])} at location {int(locs[token])}, but its cell"
            f" there is {int(cells[token])} and the page is not retired"
        )


def _expect_prefix_unwritten(pools: Pools, rows: _Rows, locs: HostArray) -> None:
    # Each prefix cell: a page the pools hold (written by an earlier forward), and no
    # location this forward writes.
    cell_rows, positions = rows.prefix_cells()
    if not cell_rows.shape[0]:
        return
    page_size = pools.page_size
    cells = pools.table.host[rows.slots[cell_rows], positions].astype(np.int64)
    unheld = np.zeros(pools.num_pages + 1, dtype=bool)
    unheld[0] = True
    unheld[pools.free_pages] = True
    unheld[pools.retired] = True
    pages = cells // page_size
    outside = (pages < 0) | (pages > pools.num_pages)
    bad = outside | unheld[np.where(outside, 0, pages)]
    if bad.any():
        at = int(bad.argmax())
        raise InvariantViolation(
            f"check_forward: {rows.name(int(cell_rows[at]))} reads position"
            f" {int(positions[at])} of its prefix at location {int(cells[at])}, on a page"
            " no row holds (free, retired or padding): no earlier forward wrote it"
        )
    # Which token writes each prefix cell, if any: a sorted search (no array as large as
    # the KV cache, which production pools count in millions of locations).
    order = np.argsort(locs, kind="stable")
    ordered = locs[order]
    found = np.searchsorted(ordered, cells).clip(max=max(ordered.shape[0] - 1, 0))
    clash = ordered[found] == cells if ordered.shape[0] else np.zeros(cells.shape[0], dtype=bool)
    if clash.any():
        at = int(clash.argmax())
        by = int(order[found[at]])
        raise InvariantViolation(
            f"check_forward: {rows.name(int(cell_rows[at]))} reads position"
            f" {int(positions[at])} of its prefix at location {int(cells[at])}, which this"
            f" forward writes ({rows.name(int(rows.token_rows[by]))}, position"
            f" {int(rows.positions[by])}): a kernel that reads the prefix before the"
            " write reads what is there before"
        )


def _expect_hybrid(
    batch: Extended[C] | Decoding[C] | Mixed[C] | Verifying[C], pools: Pools, rows: _Rows
) -> None:
    # Window layers: the window cells below each row's prefix against the window locations
    # written; the anchors' copies read nothing the forward writes.
    if isinstance(batch, Verifying):
        inputs = forward_inputs(batch, pools.table, pools.page_size, slot_tokens=pools.slot_tokens)
    else:
        inputs = forward_inputs(batch, pools.table, pools.page_size)
    hybrid = hybrid_inputs(inputs, pools)
    page_size = pools.page_size
    for window, kind in zip(hybrid.windows, pools.memory.windows, strict=True):
        written = window.out_cache_loc.host.astype(np.int64)
        starts = window.kv_starts.host.astype(np.int64)
        cell_rows, positions = _spans(starts, np.maximum(rows.prefix - starts, 0))
        table = kind.table
        cells = (
            table[rows.slots[cell_rows], positions // page_size] * page_size + positions % page_size
        )
        at = _first_in(cells, written)
        if at is not None:
            raise InvariantViolation(
                f"check_forward: {rows.name(int(cell_rows[at]))} reads window position"
                f" {int(positions[at])} at window location {int(cells[at])}, which this"
                " forward's window layer writes"
            )
    pages = [window.out_cache_loc.host.astype(np.int64) // page_size for window in hybrid.windows]
    for copies in hybrid.cached:
        window_written = np.concatenate((*pages, copies.window_to.host, copies.publish_to.host))
        states_written = np.concatenate((copies.state_to.host, copies.checkpoint_states.host))
        for what, read, written in (
            ("window page", copies.window_from.host, window_written),
            ("state slot", copies.state_from.host, states_written),
        ):
            at = _first_in(read, written)
            if at is not None:
                raise InvariantViolation(
                    f"check_forward: an anchor's {what} {int(read[at])} is copied into a"
                    " resuming row and written by the same forward"
                )


def _spans(starts: HostArray, lengths: HostArray) -> tuple[HostArray, HostArray]:
    # Row `r`'s `[starts[r], starts[r] + lengths[r])`, every row's back to back: each
    # element's row, and its value.
    element_rows = np.repeat(np.arange(lengths.shape[0]), lengths)
    first = np.cumsum(lengths) - lengths
    within = np.arange(element_rows.shape[0]) - first[element_rows]
    return element_rows, starts[element_rows] + within


def _first_in(read: npt.NDArray[np.int64], written: npt.NDArray[np.int64]) -> int | None:
    # The index of the first entry of `read` that `written` holds too, None if none does.
    if not read.shape[0] or not written.shape[0]:
        return None
    clash = np.isin(read, written)
    return int(clash.argmax()) if clash.any() else None
