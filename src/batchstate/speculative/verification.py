"""Speculative decoding: the verify window, when only the device knows each row's length.

After a verify forward, how many drafts each row accepted exists only on the
device. Peers keep a host mirror that is then an upper bound, or `None`, and
rely on readers to remember. Here that window is its own record, `Verifying`,
with no host field for a row's length; `sync` is the one way back to a
mirrored record, and the one device read of the decode path. This module
holds the two transitions (and the check of the draft counts `verify` takes);
the record and the test of which pools hold its window are `records.verifying`'s.

    Decoding --verify(draft_lens)--> Verifying --(verify forward)--> sync --> Filtered
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
import torch
from returns.result import Failure, Result, Success

from batchstate.audit import permitted_reads
from batchstate.base.errors import ContextTooLong, DraftError, OutOfKVTokens, PhaseError
from batchstate.base.mirrored import DeviceOnly, HostArray, Mirrored, frozen, upload
from batchstate.columns.columns import C
from batchstate.pools.pools import Pools, expect_pools
from batchstate.records.phases import BatchAndPools, Decoding, Filtered
from batchstate.records.rows import build_rows, check_columns, expect_current, pack_ints
from batchstate.records.verifying import Verifying, VerifyStep, window_layout, window_lens
from batchstate.transitions.decoding import DecodeError

__all__ = ["Drafts", "sync", "verify"]

# Draft tokens per row: Python ints, or a 1-D integer numpy array or CPU tensor.
Drafts: TypeAlias = Sequence[int] | npt.NDArray[np.integer] | torch.Tensor


def verify(
    batch: Decoding[C], draft_lens: Drafts, pools: Pools
) -> Result[VerifyStep[C], DecodeError]:
    """Reserve KV for each row's drafts, up front, and open the verify window.

    Row i gets locations for positions `[c, c + draft_lens[i])` past its
    length `c`; the table is written (both sides) once that allocation has
    succeeded. Reads nothing from the device.

    Args:
        batch: a decode batch; its `out_cache_loc` token leads each row.
        draft_lens: draft tokens per row, >= 0: ints, or an integer numpy
            array or CPU tensor `[num_reqs]`.
        pools: the pools that own `batch`'s memory.

    Returns:
        `Success(VerifyStep(Verifying, Pools))`; or `Failure(OutOfKVTokens)`
        or `Failure(ContextTooLong)`, with `batch` and `pools` unchanged.

    Raises:
        PhaseError: `batch` is not `Decoding`.
        BatchConflict: `batch` and `pools` live on different devices.
        DraftError: `draft_lens` is not one non-negative integer per row on the CPU.
        StaleRecord: a row's slot does not own exactly that row's tokens, at
            the row's generation, in `pools`.

    >>> from batchstate import Req, decode, extend, idle, make_pools
    >>> pools = make_pools(4, 32, 64, torch.device("cpu"))
    >>> batch, pools = extend(idle("cpu"), [Req(0, (1, 2, 3))], pools).unwrap()
    >>> batch, pools = decode(batch, pools).unwrap()  # 4 tokens
    >>> window, pools = verify(batch, [3], pools).unwrap()
    >>> int(pools.slot_tokens[1])  # the drafts' KV is reserved
    7
    >>> running, pools = sync(window, torch.tensor([1]), pools)  # one of three accepted
    >>> running.rows.seq_lens.host.tolist(), int(pools.slot_tokens[1])
    ([5], 5)
    """
    if not isinstance(batch, Decoding):
        raise PhaseError(f"verify takes Decoding, got {type(batch).__name__}")
    expect_pools(pools)
    rows = batch.rows
    pools.table.expect_on(rows.device)
    drafts = _draft_lens(draft_lens, len(rows))
    committed = rows.seq_lens.host
    # Compared before adding: a count near int64's maximum would wrap the sum negative.
    too_long = drafts > pools.max_context_len - committed
    reserved = committed + np.minimum(drafts, pools.max_context_len)
    if too_long.any():
        row = int(too_long.argmax())
        needed = int(committed[row]) + int(drafts[row])  # Python ints: no wrap
        return Failure(ContextTooLong(rows.reqs[row].rid, needed, pools.max_context_len))
    expect_current(rows, pools)
    slots = rows.req_pool_indices.host
    # The window's forward queries the decode token again, at `committed - 1`.
    allocation = pools.take_tokens(slots, committed, reserved, committed - 1)
    if isinstance(allocation, OutOfKVTokens):
        return Failure(allocation)
    draft_locs, after = allocation
    window_rows, positions = window_layout(committed, drafts)
    is_draft = positions >= committed[window_rows]  # the rest lead their rows: decode tokens
    draft_rows, draft_positions = window_rows[is_draft], positions[is_draft]
    out_cache_loc = np.empty(positions.shape[0], dtype=np.int64)
    # Position c - 1 is not among the cells the write below sets (drafts start at c).
    out_cache_loc[~is_draft] = after.table.host[slots, committed - 1]
    out_cache_loc[is_draft] = draft_locs
    cells = (slots[draft_rows], draft_positions, draft_locs.astype(np.int32))
    # One host-to-device copy for the table write and what the forward reads.
    forward_locs, forward_lens, *cell_sides = upload((out_cache_loc, reserved, *cells), rows.device)
    verifying = Verifying(
        rows.device,
        rows.reqs,
        rows.rids,
        rows.gens,
        rows.req_pool_indices,
        frozen(drafts),
        DeviceOnly(forward_lens),
        Mirrored.trusted(frozen(out_cache_loc), forward_locs),
        rows.columns,
    )
    # NOTE: the table write comes last: a failure before it leaves the table as it was.
    after.table.write(
        Mirrored.trusted(frozen(cells[0]), cell_sides[0]),
        Mirrored.trusted(frozen(cells[1]), cell_sides[1]),
        Mirrored.trusted(frozen(cells[2]), cell_sides[2]),
    )
    return Success(VerifyStep(verifying, after.commit()))


def sync(
    batch: Verifying[C], num_accepted: torch.Tensor | npt.NDArray[np.integer], pools: Pools
) -> BatchAndPools[Filtered[C]]:
    """Read each row's accepted drafts from the device, free the rest, mirror the lengths again.

    The one device read of the decode path: it waits for the verify forward
    that wrote `num_accepted`. It runs inside `permitted_reads`, so an
    audit counts it and does not forbid it. Row i's length becomes
    `c + num_accepted[i]`; KV pages holding only unaccepted drafts go back
    to the pools. Pools that do not hold the window (those from before
    `verify`) are refused before the read, and so is a window already
    synced: its rows come back holding their slots at a new generation.
    Counts the host has already (a
    numpy integer array: an engine that read them itself, or one that
    verifies on the host) are taken as they are, with no read.

    Args:
        batch: the verify window.
        num_accepted: int32 or int64 `[num_reqs]` on `batch.device`, each in
            `[0, draft_lens[i]]`, written by the verify forward; or the same
            counts as a 1-D numpy integer array.
        pools: the pools `verify` returned, or their successors.

    Returns:
        `BatchAndPools(Filtered, Pools)`: a running batch to filter, merge or decode.

    Raises:
        PhaseError: `batch` is not `Verifying`.
        DraftError: `num_accepted` has the wrong shape, dtype or device, a
            count out of range, or `pools` do not hold `batch`'s drafts.
    """
    if not isinstance(batch, Verifying):
        raise PhaseError(f"sync takes Verifying, got {type(batch).__name__}")
    num_reqs = len(batch.reqs)
    if isinstance(num_accepted, np.ndarray):
        if num_accepted.dtype.kind not in "iu" or num_accepted.shape != (num_reqs,):
            raise DraftError(
                f"num_accepted: expected integers [{num_reqs}], got {num_accepted.dtype}"
                f" {list(num_accepted.shape)}"
            )
    elif not isinstance(num_accepted, torch.Tensor):
        raise DraftError(
            f"num_accepted must be a torch tensor on {batch.device} or a numpy array, got"
            f" {type(num_accepted).__name__}"
        )
    elif (
        num_accepted.shape != (num_reqs,)
        or num_accepted.dtype not in (torch.int32, torch.int64)
        or num_accepted.device != batch.device
    ):
        raise DraftError(
            f"num_accepted: expected int32 or int64 [{num_reqs}] on {batch.device}, got"
            f" {num_accepted.dtype} {list(num_accepted.shape)} on {num_accepted.device}"
        )
    expect_pools(pools)
    drafts, slots = batch.draft_lens, batch.req_pool_indices.host
    held = window_lens(pools, batch)
    if held is None:
        raise DraftError(
            "the pools do not hold this batch's drafts: pass the pools verify returned"
        )
    committed = held - drafts
    if isinstance(num_accepted, np.ndarray):
        accepted = num_accepted.astype(np.int64)  # known on the host: nothing to read
    else:
        with permitted_reads("speculative sync: accepted draft counts"):
            # NOTE: the one device read; it waits
            accepted = num_accepted.to("cpu").numpy().astype(np.int64)
    bad = (accepted < 0) | (accepted > drafts)
    if bad.any():
        row = int(bad.argmax())
        raise DraftError(f"row {row} accepted {int(accepted[row])} of {int(drafts[row])} drafts")
    seq_lens = committed + accepted
    shrunk = pools.shrink_slots(slots, seq_lens)
    if not isinstance(shrunk, Success):
        raise DraftError(f"the pools do not own this batch's slots: {shrunk.failure()}")
    # The window is consumed: its slots move to a new generation, so a second
    # sync or a release of the window is refused, whatever it accepted.
    gens, after = shrunk.unwrap().reissue(slots)
    rows, _ = build_rows(
        batch.device,
        batch.reqs,
        pack_ints(seq_lens, batch.req_pool_indices.host, batch.rids, gens),
        batch.req_pool_indices,
        int(seq_lens.sum()),
        int(seq_lens.max()) if num_reqs else 0,
        batch.columns,
    )
    check_columns(rows)
    return BatchAndPools(Filtered(rows), after.commit())


def _draft_lens(draft_lens: Drafts, num_reqs: int) -> HostArray:
    if isinstance(draft_lens, np.ndarray):
        if draft_lens.dtype.kind not in "iu":
            raise DraftError(f"draft_lens must be integers, got {draft_lens.dtype}")
        drafts = draft_lens.astype(np.int64)
    elif isinstance(draft_lens, torch.Tensor):
        if draft_lens.device.type != "cpu":
            raise DraftError(
                f"draft_lens must be on the CPU, got {draft_lens.device}: reading it would sync"
            )
        if (
            draft_lens.dtype.is_floating_point
            or draft_lens.dtype.is_complex
            or draft_lens.dtype == torch.bool
        ):
            raise DraftError(f"draft_lens must be integers, got {draft_lens.dtype}")
        drafts = draft_lens.numpy().astype(np.int64)
    elif any(isinstance(value, bool) for value in draft_lens):
        raise DraftError("draft_lens must be integers, got a bool")
    else:
        try:
            drafts = np.frombuffer(array("q", draft_lens), dtype=np.int64).copy()
        except TypeError as error:
            raise DraftError(f"draft_lens must be integers: {error}") from None
        except OverflowError as error:
            raise DraftError(f"draft_lens must fit in int64: {error}") from None
    if drafts.shape != (num_reqs,):
        raise DraftError(f"draft_lens: expected [{num_reqs}], got {list(drafts.shape)}")
    if (drafts < 0).any():
        raise DraftError(f"draft_lens must be >= 0, got {drafts.tolist()}")
    return drafts
